// Tessera as a library: a user-defined model trained with zero3 (its blocks are FSDP
// units), a sharded EMA that follows the strategy, and a consolidated safetensors export
// of the EMA. Runs as one process, or under tessera-run / torchrun on several ranks:
//
//   train_with_tessera --out ema.safetensors
//   tessera-run --standalone --nproc-per-node 2 train_with_tessera --out ema.safetensors
//
// Exits 0 when the loss fell, 1 otherwise (the test that builds this against the
// installed package checks that).
#include <torch/torch.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/exporter.h"
#include "checkpoint/state.h"
#include "distributed/rank_env.h"
#include "distributed/runtime.h"
#include "ema/ema_manager.h"
#include "ema/strategy_ema.h"
#include "sharding/fully_shard.h"
#include "sharding/strategy.h"

namespace {

// Two residual MLP blocks and a head; parameter names as PyTorch would give them.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t width) : fc(register_module("fc", torch::nn::Linear(width, width))) {}
  at::Tensor forward(const at::Tensor& x) { return x + torch::tanh(fc(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

struct RegressorImpl : torch::nn::Module {
  explicit RegressorImpl(int64_t width)
      : blocks(register_module("blocks", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(width, 1))) {
    for (int i = 0; i < 2; ++i) blocks->push_back(Block(width));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (const auto& module : *blocks) {
      auto* block = module->as<Block>();
      // A unit's forward goes through unitForward (a plain call under other strategies).
      h = tessera::sharding::unitForward(*module, h, [block](const at::Tensor& in) { return block->forward(in); });
    }
    return head(h);
  }
  torch::nn::ModuleList blocks;
  torch::nn::Linear head;
};
TORCH_MODULE(Regressor);

}  // namespace

int main(int argc, char** argv) {
  std::string out = "ema.safetensors";
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--out") out = argv[i + 1];
  }
  try {
    using namespace tessera;
    auto runtime = distributed::Runtime::init(distributed::RankEnv::fromEnvironment());
    auto comm = runtime->comm();
    const int rank = comm->rank(), world = comm->worldSize();

    torch::manual_seed(0);
    constexpr int64_t kWidth = 16;
    Regressor model(kWidth);
    sharding::StrategyOptions options;
    options.strategy = "zero3";
    options.wrap = {"blocks.*"};  // each block is a unit; the root holds the head
    options.optimizer.name = "adamw";
    const double lr = 1e-2;
    auto strategy = sharding::makeStrategy(*model, comm, options);

    ema::EmaOptions emaOptions;
    emaOptions.decays = {0.99};
    ema::ShardedModelEMAManager ema(emaOptions);
    ema::followStrategy(ema, *strategy);

    // y = sum(x) / 4: every rank draws the same global batch and trains on its slice.
    double first = 0, last = 0;
    for (int step = 0; step < 60; ++step) {
      torch::manual_seed(100 + step);
      const at::Tensor x = torch::randn({8 * world, kWidth});
      const at::Tensor y = x.sum(1, /*keepdim=*/true) / 4;
      strategy->zeroGrad();
      const at::Tensor local = x.narrow(0, 8 * rank, 8);
      at::Tensor pred = sharding::unitForward(*model, local, [&](const at::Tensor& in) { return model->forward(in); });
      at::Tensor loss = torch::mse_loss(pred, y.narrow(0, 8 * rank, 8));
      loss.backward();
      strategy->step(lr);
      ema.update(step + 1);
      at::Tensor mean = loss.detach().reshape({1});
      comm->allReduce(mean, distributed::ReduceOp::kAvg);
      (step == 0 ? first : last) = mean.item<double>();
    }

    // The EMA as one safetensors file, gathered one tensor at a time to rank 0.
    checkpoint::ExportOptions exportOptions;
    exportOptions.what = "generator_ema";
    checkpoint::exportOnline(ema.stateEntries("ema/"), "ema/generator_ema/", runtime->cpuComm().get(), out,
                             exportOptions);
    if (rank == 0) {
      std::printf("train_with_tessera: %d rank(s), zero3, loss %.4f -> %.4f, EMA exported to %s\n", world, first, last,
                  out.c_str());
    }
    return last < first * 0.5 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_with_tessera: error: %s\n", e.what());
    return 1;
  }
}
