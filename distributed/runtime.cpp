// Runtime: rendezvous + communicators from the rank environment (see runtime.h).
#include "distributed/runtime.h"

#include <ATen/Context.h>
#include <unistd.h>

#include <fstream>

#include "common/errors.h"
#include "common/logging.h"
#include "distributed/gloo_communicator.h"
#include "distributed/rendezvous.h"
#include "distributed/shm_communicator.h"
#if defined(TESSERA_WITH_NCCL)
#include "distributed/nccl_communicator.h"
#endif

namespace tessera::distributed {

namespace {

// What every communicator of the runtime is given.
CommOptions commOptionsOf(const RuntimeOptions& options) {
  CommOptions comm;
  comm.timeout = options.commTimeout;
  comm.checkCollectives = options.checkCollectives;
  comm.flightEntries = options.flightEntries;
  comm.lostWhenStoppedFor = options.lostWhenStoppedFor;
  return comm;
}

// This machine as ranks compare it: host name and boot id (two containers of one host share
// both but not always /dev/shm: ShmCommunicator's creation finds that out and gloo takes over).
std::string hostIdentity() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  std::ifstream bootId("/proc/sys/kernel/random/boot_id");
  std::string boot;
  std::getline(bootId, boot);
  return strCat(name, "/", boot);
}

// Whether every rank of `env` runs on this machine although its launcher does not start them
// all (several tessera-run nodes on one machine, as tests and elastic runs on one host do):
// rank 0 compares everyone's hostIdentity() and says.
bool allRanksOnThisHost(Store& store, const RankEnv& env, std::chrono::milliseconds timeout) {
  const std::string me = hostIdentity();
  store.set(strCat("host_identity/", env.rank), me);
  if (env.rank == 0) {
    bool same = true;
    for (int r = 1; r < env.world_size && same; ++r) same = store.get(strCat("host_identity/", r), timeout) == me;
    store.set("host_identity/verdict", same ? "1" : "0");
  }
  return store.get("host_identity/verdict", timeout) == "1";
}

}  // namespace

std::shared_ptr<Runtime> Runtime::init(const RankEnv& env, const RuntimeOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  std::string backend = options.backend;
  if (backend == "auto") backend = ncclAvailable() && at::hasCUDA() ? "nccl" : "cpu";
  if (backend != "gloo" && backend != "shm" && backend != "cpu" && backend != "nccl") {
    throw ConfigError(
        strCat("Runtime::init: unknown backend '", options.backend, "' (gloo | shm | cpu | nccl | auto)"));
  }
  if (backend == "shm" && !env.singleNode()) {
    throw ConfigError(strCat("Runtime::init: backend 'shm' needs every rank on one host, but ", env.local_world_size,
                             " of ", env.world_size, " ranks run on this one (use gloo across hosts)"));
  }
  if (backend == "nccl" && !ncclAvailable()) {
    // Fail before rendezvous, with makeCommunicator's explanation.
    makeCommunicator("nccl", nullptr, env.rank, env.world_size);
  }

  log::adoptRank(env.rank);  // library use: lines say which rank wrote them
  std::shared_ptr<Runtime> runtime(new Runtime());
  runtime->env_ = env;
  RendezvousOptions rendezvousOptions;
  rendezvousOptions.timeout = options.rendezvousTimeout;
  runtime->store_ = rendezvous(env, rendezvousOptions);

  // The CPU communicator: shared memory when every rank is on this host (asked for, or
  // "cpu" and it can be set up), else gloo.
  const bool oneHost = env.singleNode() ||
                       (backend == "cpu" && allRanksOnThisHost(*runtime->store_, env, options.rendezvousTimeout));
  if (backend == "shm" || (backend == "cpu" && oneHost && env.world_size > 1)) {
    ShmOptions shm;
    shm.comm = commOptionsOf(options);
    shm.comm.name = "world_cpu";
    try {
      runtime->cpuComm_ = makeShmCommunicator(runtime->store_, env.rank, env.world_size, shm);
    } catch (const TimeoutError&) {
      throw;  // a rank missing: gloo would miss it too
    } catch (const Error& e) {
      if (backend == "shm") throw;
      // Every rank got the same error (ShmCommunicator agrees on it), so all fall back.
      TLOG_WARN0("Runtime: no shared memory between the ranks of this host (" << e.what()
                                                                              << "); collectives go over gloo");
    }
  }
  if (!runtime->cpuComm_) {
    GlooOptions gloo;
    gloo.comm = commOptionsOf(options);
    gloo.comm.name = "world_cpu";
    // Loopback is always right on one machine; across machines c10d's default device (the
    // host name's address, or $GLOO_SOCKET_IFNAME) is.
    gloo.hostname = oneHost ? "127.0.0.1" : "";
    runtime->cpuComm_ = makeGlooCommunicator(runtime->store_, env.rank, env.world_size, gloo);
  }
  if (backend != "nccl") {
    runtime->comm_ = runtime->cpuComm_;
  } else {
#if defined(TESSERA_WITH_NCCL)
    NcclOptions nccl;
    nccl.comm = commOptionsOf(options);
    nccl.comm.name = "world_nccl";
    // This rank's GPU, as trainer::trainingDevice picks it: LOCAL_RANK modulo the GPUs.
    const int gpus = static_cast<int>(at::getNumGPUs());
    nccl.device = gpus > 0 ? env.local_rank % gpus : env.local_rank;
    runtime->comm_ = makeNcclCommunicator(runtime->store_, env.rank, env.world_size, nccl);
    runtime->comm_->setHost(runtime->cpuComm_);
#endif
  }
  runtime->startupSeconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  TLOG_DEBUG("Runtime: " << env.describe() << ", backend " << runtime->comm_->backendName() << ", ready after "
                         << runtime->startupSeconds_ << " s");
  return runtime;
}

std::shared_ptr<Communicator> initProcessGroup(const RankEnv& env, const RuntimeOptions& options) {
  return Runtime::init(env, options)->comm();
}

}  // namespace tessera::distributed
