// tessera-comm-check: proves the distributed runtime works under a launcher.
//   tessera-comm-check [--backend gloo|nccl|auto] [--timeout SECONDS]
// Reads the rank environment (torchrun, tessera-run, srun, mpirun, or none), rendezvouses,
// runs an all-reduce, an all-gather and a reduce-scatter with known answers, checks them
// and prints "rank R/W: collectives OK (...)". Exit status: 0 ok, 2 bad environment or
// arguments, 1 wrong result, timeout or transport failure.
//   python3 -m torch.distributed.run --nproc-per-node 2 --no-python build/bin/tessera-comm-check
#include <ATen/ATen.h>

#include <cstdio>

#include "common/app_main.h"
#include "common/command_line.h"
#include "common/errors.h"
#include "common/logging.h"
#include "distributed/runtime.h"

namespace {

using tessera::strCat;
namespace dist = tessera::distributed;

void expectEqual(const char* what, const at::Tensor& got, const at::Tensor& want, int rank) {
  if (!got.equal(want)) {
    throw tessera::Error(strCat("tessera-comm-check: rank ", rank, ": ", what, " gave ", got.toString(), " ",
                                got.flatten().slice(0, 0, 8), " but expected ", want.flatten().slice(0, 0, 8)));
  }
}

}  // namespace

int main(int argc, char** argv) {
  return tessera::runMain("tessera-comm-check", [&]() -> int {
    CLI::App app{"Tessera: check rendezvous and collectives on every rank"};
    std::string backend = "gloo";
    double timeoutSeconds = 60;
    app.add_option("--backend", backend, "gloo | shm (ranks on one host) | nccl | auto")
        ->check(CLI::IsMember({"gloo", "shm", "nccl", "auto"}));
    app.add_option("--timeout", timeoutSeconds, "Rendezvous and collective timeout in seconds")->check(CLI::PositiveNumber);
    if (const auto done = tessera::parseCommandLine(app, argc, argv)) return *done;

    const auto env = dist::RankEnv::fromEnvironment();
    tessera::log::LogOptions logOptions;
    logOptions.rank = env.rank;
    tessera::log::init(logOptions);

    dist::RuntimeOptions options;
    options.backend = backend;
    options.rendezvousTimeout = std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000));
    options.commTimeout = options.rendezvousTimeout;
    const auto runtime = dist::Runtime::init(env, options);
    const auto& comm = runtime->comm();
    const int rank = comm->rank();
    const int world = comm->worldSize();
    const auto device = comm->backendName() == "nccl" ? at::Device(at::kCUDA, env.local_rank) : at::Device(at::kCPU);
    const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);

    // all-reduce: every rank contributes rank+1 -> N(N+1)/2 everywhere.
    at::Tensor sum = at::full({5}, static_cast<float>(rank + 1), opts);
    comm->allReduce(sum);
    expectEqual("allReduce(sum)", sum, at::full({5}, world * (world + 1) / 2.0f, opts), rank);

    // all-gather of 3 elements per rank: chunk r holds 10r, 10r+1, 10r+2.
    at::Tensor local = at::arange(3, opts) + 10.0f * rank;
    at::Tensor gathered = at::empty({3 * world}, opts);
    comm->allGatherInto(gathered, local);
    at::Tensor want = (at::arange(3, opts).repeat({world}) + at::arange(world, opts).repeat_interleave(3) * 10.0f);
    expectEqual("allGatherInto", gathered, want, rank);

    // reduce-scatter (avg) of 2 elements per rank: flat = (rank+1) everywhere -> (N+1)/2.
    at::Tensor flat = at::full({2 * world}, static_cast<float>(rank + 1), opts);
    at::Tensor mine = at::empty({2}, opts);
    comm->reduceScatter(mine, flat, dist::ReduceOp::kAvg);
    expectEqual("reduceScatter(avg)", mine, at::full({2}, (world + 1) / 2.0f, opts), rank);

    comm->barrier();
    std::printf("rank %d/%d: collectives OK (%s backend, %s environment, local rank %d, ready in %.3f s, %s)\n", rank,
                world, comm->backendName().c_str(), env.source.c_str(), env.local_rank, runtime->startupSeconds(),
                comm->stats().toString().c_str());
    std::fflush(stdout);
    return 0;
  });
}
