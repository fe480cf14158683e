// All-reduce on one host (issues 18, 45): Gloo's own allreduce (LibTorch 1.13) against the
// split all-reduce (point-to-point reduce-scatter + all-gather) and the shared-memory
// backend (shm_communicator.h), for a range of sizes, on the same ranks in the same run:
// to place GlooOptions::splitAllReduceFromBytes and splitAllReduceBelowBytes, and to
// measure what shm saves over gloo's TCP loopback. Run under
// tessera-run, one process per rank:
//
//   tessera-run --standalone --nproc-per-node 2 build/bin/bench_allreduce_bench
//
// Prints, on rank 0, the median time of each (rank 0's clock, after a barrier) and the
// ratios split / Gloo and shm / Gloo: below 1, faster than Gloo. (GlooOptions::
// splitAllReduceFromBytes / splitAllReduceBelowBytes choose the split one for a range of
// sizes; empty by default, from this bench's figures.)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <vector>

#include "common/app_main.h"
#include "distributed/gloo_communicator.h"
#include "distributed/rank_env.h"
#include "distributed/runtime.h"
#include "distributed/shm_communicator.h"

namespace {

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double medianAllReduceSeconds(tessera::distributed::Communicator& comm, const at::Tensor& t, int reps) {
  std::vector<double> times;
  for (int i = 0; i < reps + 1; ++i) {
    comm.barrier();
    const double start = seconds();
    comm.allReduce(t, tessera::distributed::ReduceOp::kAvg);
    if (i > 0) times.push_back(seconds() - start);  // the first is a warm-up
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  return tessera::runMain("bench_allreduce_bench", [&]() -> int {
    using namespace tessera;
    CLI::App app{"Gloo's allreduce against the split all-reduce (reduce-scatter + all-gather) and shm's"};
    int reps = 15, threads = 1;
    std::vector<int64_t> kib{4, 16, 64, 256, 1024, 4096, 8192, 16384, 65536};
    app.add_option("--reps", reps, "timed repetitions per size")->capture_default_str()->check(CLI::PositiveNumber);
    app.add_option("--kib", kib, "tensor sizes in KiB (fp32)")->capture_default_str();
    app.add_option("--threads", threads, "intra-op threads per rank")->capture_default_str();
    CLI11_PARSE(app, argc, argv);
    at::set_num_threads(threads);

    auto runtime = distributed::Runtime::init(distributed::RankEnv::fromEnvironment());
    const int rank = runtime->comm()->rank(), world = runtime->comm()->worldSize();
    auto make = [&](const char* name, bool split) {
      distributed::GlooOptions options;
      options.hostname = "127.0.0.1";
      options.comm.name = name;
      options.splitAllReduceFromBytes = 0;
      options.splitAllReduceBelowBytes = split ? std::numeric_limits<int64_t>::max() : 0;
      return distributed::makeGlooCommunicator(runtime->store(), rank, world, options);
    };
    auto gloo = make("bench_gloo_allreduce", false);
    auto split = make("bench_split_allreduce", true);
    distributed::ShmOptions shmOptions;
    shmOptions.comm.name = "bench_shm_allreduce";
    auto shm = distributed::makeShmCommunicator(runtime->store(), rank, world, shmOptions);
    if (rank == 0) {
      std::printf("fp32 all-reduce (AVG), %d ranks, median of %d\n\n", world, reps);
      std::printf("| size | Gloo allreduce | split (reduce-scatter + all-gather) | shm | split / Gloo | shm / Gloo |\n"
                  "|---|---|---|---|---|---|\n");
    }
    for (int64_t k : kib) {
      const at::Tensor t = at::randn({k * 1024 / 4});
      const double g = medianAllReduceSeconds(*gloo, t, reps);
      const double s = medianAllReduceSeconds(*split, t, reps);
      const double m = medianAllReduceSeconds(*shm, t, reps);
      if (rank == 0) {
        std::printf("| %lld KiB | %.3f ms | %.3f ms | %.3f ms | %.2fx | %.2fx |\n", static_cast<long long>(k), g * 1e3,
                    s * 1e3, m * 1e3, s / g, m / g);
      }
      std::fflush(stdout);
    }
    return 0;
  });
}
