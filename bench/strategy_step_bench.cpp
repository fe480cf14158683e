// Step time of one sharding strategy on a plain MLP (issue 18): the Tessera half of
// bench/vs_pytorch.py, which runs PyTorch's DDP and DDP + ZeroRedundancyOptimizer on the
// same model, batch, data and thread count (bench/vs_pytorch_reference.py) and prints
// the ratios. Run under tessera-run, one process per rank:
//
//   tessera-run --standalone --nproc-per-node 2 build/bin/bench_strategy_step_bench --strategy no_shard
//
// Model: Linear layers of the given widths with ReLU between them (1024-2048-2048-1024 by
// default, 8.4M parameters); zero3 makes every Linear a unit. Each step: zeroGrad,
// forward of this rank's slice of the global batch, MSE loss against a fixed target,
// backward, AdamW step. Host memory comes from the caching allocator tessera-train
// installs (--torch-allocator: LibTorch's). Prints one JSON line on rank 0: the median
// and every step time after the warm-up (rank 0's wall clock, as the reference
// measures), the median of each phase, and the number of collectives per step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <chrono>
#include <numeric>
#include <cstdio>
#include <string>
#include <vector>

#include "common/app_main.h"
#include "common/errors.h"
#include "distributed/communicator.h"
#include "distributed/rank_env.h"
#include "distributed/runtime.h"
#include "sharding/fully_shard.h"
#include "sharding/host_allocator.h"
#include "sharding/strategy.h"

namespace {

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(const std::vector<int64_t>& widths) : layers(register_module("layers", torch::nn::ModuleList())) {
    for (size_t i = 0; i + 1 < widths.size(); ++i) layers->push_back(torch::nn::Linear(widths[i], widths[i + 1]));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (size_t i = 0; i < layers->size(); ++i) {
      auto& layer = *layers[i];
      auto* linear = layer.as<torch::nn::Linear>();
      h = tessera::sharding::unitForward(layer, h, [linear](const at::Tensor& in) { return linear->forward(in); });
      if (i + 1 < layers->size()) h = at::relu(h);
    }
    return h;
  }
  torch::nn::ModuleList layers;
};
TORCH_MODULE(Mlp);

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  return tessera::runMain("bench_strategy_step_bench", [&]() -> int {
    using namespace tessera;
    CLI::App app{"Step time of one Tessera strategy on an MLP (the Tessera half of bench/vs_pytorch.py)"};
    std::string strategyName = "no_shard";
    std::vector<int64_t> widths{1024, 2048, 2048, 1024};
    int64_t globalBatch = 64;
    int warmup = 3, steps = 15, threads = 1;
    app.add_option("--strategy", strategyName, "no_shard | zero1 | zero2 | zero3")->capture_default_str();
    app.add_option("--widths", widths, "layer widths, input first")->capture_default_str()->expected(2, 64);
    app.add_option("--global-batch", globalBatch, "samples per step over all ranks")->capture_default_str();
    app.add_option("--warmup", warmup, "untimed steps first")->capture_default_str();
    app.add_option("--steps", steps, "timed steps")->capture_default_str()->check(CLI::PositiveNumber);
    app.add_option("--threads", threads, "intra-op threads per rank")->capture_default_str()->check(CLI::PositiveNumber);
    bool torchAllocator = false;
    app.add_flag("--torch-allocator", torchAllocator,
                 "keep LibTorch's CPU allocator (default: the caching host allocator tessera-train runs with)");
    std::string backend = "cpu";
    app.add_option("--backend", backend, "cpu (shm on one host, else gloo), shm or gloo")
        ->check(CLI::IsMember({"cpu", "shm", "gloo"}))
        ->capture_default_str();
    CLI11_PARSE(app, argc, argv);
    if (!torchAllocator) sharding::useCachingHostAllocator();

    at::set_num_threads(threads);
    // As tessera-train's run.backend auto on the CPU: shm on one host, else gloo.
    distributed::RuntimeOptions runtimeOptions;
    runtimeOptions.backend = backend;
    auto runtime = distributed::Runtime::init(distributed::RankEnv::fromEnvironment(), runtimeOptions);
    auto comm = runtime->comm();
    const int rank = comm->rank(), world = comm->worldSize();
    if (globalBatch % world != 0) throw UsageError(strCat("--global-batch ", globalBatch, " is not a multiple of the ", world, " ranks"));
    const int64_t localBatch = globalBatch / world;

    at::manual_seed(0);
    Mlp model(widths);
    sharding::StrategyOptions options;
    options.strategy = sharding::parseStrategyKind(strategyName);
    options.wrap = {"layers.*"};
    options.optimizer.kind = optim::OptimizerKind::kAdamW;
    auto strategy = sharding::makeStrategy(*model, comm, options);

    // The same global batch every step (the reference draws it the same way: randn with
    // seed 1, then the target): the step time does not depend on the values.
    at::manual_seed(1);
    const at::Tensor x = at::randn({globalBatch, widths.front()}).narrow(0, rank * localBatch, localBatch);
    const at::Tensor y = at::randn({globalBatch, widths.back()}).narrow(0, rank * localBatch, localBatch);

    std::vector<double> times, forwardTimes, backwardTimes, stepTimes;
    comm->resetStats();
    for (int step = 0; step < warmup + steps; ++step) {
      const double start = seconds();
      strategy->zeroGrad();
      at::Tensor loss =
          at::mse_loss(sharding::unitForward(*model, x, [&](const at::Tensor& in) { return model->forward(in); }), y);
      const double forwardEnd = seconds();
      loss.backward();
      const double backwardEnd = seconds();
      strategy->step(1e-4);
      const double end = seconds();
      if (step < warmup) continue;
      times.push_back(end - start);
      forwardTimes.push_back(forwardEnd - start);
      backwardTimes.push_back(backwardEnd - forwardEnd);
      stepTimes.push_back(end - backwardEnd);
    }
    const double collectivesPerStep =
        static_cast<double>(comm->stats().totalCalls()) / (warmup + steps);
    if (rank == 0) {
      // Phases: zeroGrad + forward; backward (with the reductions it issues); step()
      // (the rest of the reductions, the optimizer, the parameter all-gathers).
      nlohmann::json out = {{"framework", "tessera"},
                            {"strategy", strategyName},
                            {"world", world},
                            {"median_s", median(times)},
                            {"phases_median_s",
                             {{"forward", median(forwardTimes)},
                              {"backward", median(backwardTimes)},
                              {"step", median(stepTimes)}}},
                            {"step_s_mean", std::accumulate(times.begin(), times.end(), 0.0) / static_cast<double>(times.size())},
                            {"times_s", times},
                            {"collectives_per_step", collectivesPerStep},
                            {"backend", comm->backendName()},
                            {"allocator", torchAllocator ? "torch" : "caching"}};
      std::printf("%s\n", out.dump().c_str());
    }
    return 0;
  });
}
