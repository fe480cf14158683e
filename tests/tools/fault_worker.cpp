// tessera-fault-worker (a test tool): a rank that trains nothing but behaves like a
// trainer to the flight recorder (steps, spans, tagged collectives over the runtime's gloo
// world) and injects one fault on one rank at one step, for the fault tests
// (tests/distributed/fault_test.cpp). Run under tessera-run:
//   tessera-fault-worker --dir RUN_DIR --fault sleep|size|kill|stop|store|none
//                        [--fault-rank R] [--fault-step K] [--steps N] [--timeout-s T]
//                        [--check-collectives]
// Each step: "forward layers.1" (compute, a short sleep) then an all-reduce of 256 floats
// tagged "layers.1". Faults at step K on rank R:
//   sleep  sleeps in compute (forward layers.1) for an hour, before the step's collective
//   size   issues the step's all-reduce with 300 elements instead of 256
//   kill   SIGKILLs itself after issuing the step's all-reduce (inside the collective)
//   stop   SIGSTOPs itself in compute, before the step's collective
//   store  rank R (use 0: it hosts the store) SIGKILLs itself; the others wait on the store
#include <ATen/ATen.h>
#include <signal.h>

#include <chrono>
#include <thread>

#include "common/app_main.h"
#include "common/command_line.h"
#include "common/logging.h"
#include "common/trace.h"
#include "diagnostics/flight_recorder.h"
#include "distributed/rank_env.h"
#include "distributed/runtime.h"

int main(int argc, char** argv) {
  return tessera::runMain("tessera-fault-worker", [&]() -> int {
    CLI::App app{"Tessera test tool: a rank that injects one fault"};
    std::string dir, fault = "none";
    int faultRank = 1;
    int64_t faultStep = 3, steps = 6;
    double timeoutS = 3;
    app.add_option("--dir", dir, "Run directory (flight/ dumps go there)")->required();
    app.add_option("--fault", fault, "The fault")->check(CLI::IsMember({"none", "sleep", "size", "kill", "stop", "store"}));
    app.add_option("--fault-rank", faultRank, "The rank that misbehaves");
    app.add_option("--fault-step", faultStep, "The step at which it does");
    app.add_option("--steps", steps, "Steps");
    app.add_option("--timeout-s", timeoutS, "Collective timeout");
    bool checkCollectives = false;
    app.add_flag("--check-collectives", checkCollectives, "CommOptions::checkCollectives");
    if (const auto done = tessera::parseCommandLine(app, argc, argv)) return *done;

    namespace dist = tessera::distributed;
    namespace trace = tessera::trace;
    const auto env = dist::RankEnv::fromEnvironment();
    tessera::log::LogOptions logOptions;
    logOptions.rank = env.rank;
    tessera::log::init(logOptions);
    tessera::diagnostics::flight::setDumpFiles(tessera::diagnostics::flight::dumpFilesFor(dir, env.rank), env.rank,
                                               env.world_size);
    tessera::diagnostics::flight::installSignalHandlers();
    dist::RuntimeOptions options;
    options.rendezvousTimeout = std::chrono::seconds(60);
    options.commTimeout = std::chrono::milliseconds(static_cast<int64_t>(timeoutS * 1000));
    options.checkCollectives = checkCollectives;
    const auto runtime = dist::Runtime::init(env, options);
    dist::Communicator& comm = *runtime->comm();
    const bool me = env.rank == faultRank;

    for (int64_t step = 1; step <= steps; ++step) {
      trace::setCurrentStep(step);
      const trace::Span stepSpan("step", tessera::strCat("step ", step));
      const bool now = me && step == faultStep;
      {
        const trace::Span forward("compute", "forward layers.1");
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        if (now && fault == "sleep") std::this_thread::sleep_for(std::chrono::hours(1));
        if (now && fault == "stop") ::raise(SIGSTOP);
      }
      if (step == faultStep && fault == "store") {
        if (me) ::raise(SIGKILL);
        const trace::Span wait("store", "wait for a key rank 0 never sets");
        runtime->store()->get("tessera/fault/never", std::chrono::milliseconds(static_cast<int64_t>(timeoutS * 1000)));
      }
      const trace::Tag tag("layers.1");
      at::Tensor t = at::ones({now && fault == "size" ? 300 : 256});
      auto handle = comm.allReduceAsync(t);
      if (now && fault == "kill") ::raise(SIGKILL);
      handle->wait();
    }
    TLOG_INFO0("fault worker: " << steps << " steps done");
    return 0;
  });
}
