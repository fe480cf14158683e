// Tessera as a library: a user-defined model sharded by fullyShard (its blocks are units
// by declaration; forward is plain code), trained by torch::optim::AdamW over two
// parameter groups, a sharded EMA, a checkpoint of all of it that a rerun resumes from,
// and a consolidated safetensors export of the EMA. One process, or several under
// tessera-run / torchrun (docs/api.md sets it beside FSDP2 + DCP):
//
//   train_with_tessera --dir runs/example --steps 60
//   tessera-run --standalone --nproc-per-node 2 train_with_tessera --dir runs/example --steps 80
//
// Exits 0 when the loss fell, 1 otherwise (the test that builds this against the
// installed package checks that).
#include <torch/torch.h>

#include <cstdio>
#include <string>

#include "tessera/checkpoint/checkpointer.h"
#include "tessera/checkpoint/exporter.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/checkpoint/state.h"
#include "tessera/distributed/rank_env.h"
#include "tessera/distributed/runtime.h"
#include "tessera/ema/ema_manager.h"
#include "tessera/ema/strategy_ema.h"
#include "tessera/sharding/fully_shard.h"
#include "tessera/sharding/torch_optimizer.h"

namespace {

using namespace tessera;

// Residual MLP blocks and a head; parameter names as PyTorch would give them.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t width) : fc(register_module("fc", torch::nn::Linear(width, width))) {}
  at::Tensor forward(const at::Tensor& x) { return x + torch::tanh(fc(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

struct RegressorImpl : torch::nn::Module {
  explicit RegressorImpl(int64_t width) : head(register_module("head", torch::nn::Linear(width, 1))) {
    blocks = register_module("blocks", sharding::UnitList<Block>());  // each block an FSDP unit
    for (int i = 0; i < 2; ++i) blocks->emplace_back(width);
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (auto& block : *blocks) h = block->forward(h);
    return head(h);
  }
  sharding::UnitList<Block> blocks{nullptr};
  torch::nn::Linear head;
};
TORCH_MODULE(Regressor);

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "runs/example";
  int64_t steps = 60;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--dir") dir = argv[i + 1];
    if (std::string(argv[i]) == "--steps") steps = std::stoll(argv[i + 1]);
  }
  try {
    auto runtime = distributed::Runtime::init(distributed::RankEnv::fromEnvironment());
    auto comm = runtime->comm();
    const int rank = comm->rank(), world = comm->worldSize();
    constexpr int64_t kWidth = 16;

    torch::manual_seed(0);
    sharding::Unit<Regressor> model(kWidth);            // the root is a unit too
    auto fsdp = sharding::fullyShard(*model, comm);     // collective: every rank keeps 1/N

    // Weight decay for the matrices only, and another learning rate for the rest.
    const sharding::ShardGroups shards = sharding::splitByDecay(*fsdp);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(shards.decay, std::make_unique<torch::optim::AdamWOptions>(
                                          torch::optim::AdamWOptions(1e-2).weight_decay(0.01)));
    groups.emplace_back(shards.noDecay, std::make_unique<torch::optim::AdamWOptions>(
                                            torch::optim::AdamWOptions(2e-2).weight_decay(0.0)));
    torch::optim::AdamW adamw(std::move(groups));

    ema::EmaOptions emaOptions;
    emaOptions.decays = {0.99};
    emaOptions.prefix = "regressor_ema";
    ema::ShardedModelEMAManager ema(emaOptions);
    ema::followStrategy(ema, *fsdp);

    // Everything a checkpoint holds, and the save and resume of it.
    sharding::TorchOptimizerState adamwState(adamw, *fsdp);
    checkpoint::Counters counters;
    counters["step"] = 0;
    const checkpoint::StateMap states = {{"model", *fsdp}, {"optim", adamwState}, {"ema", ema}, {"train", counters}};
    checkpoint::Checkpointer checkpointer(dir + "/checkpoints", comm);
    checkpoint::resumeLatest(dir + "/checkpoints", states, comm.get());  // from the newest one, if any
    const int64_t start = counters["step"];
    if (start >= steps) {
      if (rank == 0) {
        std::printf("train_with_tessera: %s is at step %lld already: nothing to train (raise --steps)\n", dir.c_str(),
                    static_cast<long long>(start));
      }
      return 0;
    }

    // y = sum(x) / 4: every rank draws the same global batch and trains on its slice.
    double first = 0, last = 0;
    for (int64_t step = start; step < steps; ++step) {
      torch::manual_seed(100 + step);
      const at::Tensor x = torch::randn({8 * world, kWidth});
      const at::Tensor y = x.sum(1, /*keepdim=*/true) / 4;
      fsdp->zeroGrad();
      at::Tensor loss = torch::mse_loss(model->forward(x.narrow(0, 8 * rank, 8)), y.narrow(0, 8 * rank, 8));
      loss.backward();
      sharding::StepSums sums;
      sums.add("loss", loss.item<double>());
      fsdp->step(adamw, &sums);
      ema.update(step + 1);
      (step == start ? first : last) = sums["loss"] / world;
      counters["step"] = step + 1;
      if ((step + 1) % 20 == 0 || step + 1 == steps) checkpointer.save(step + 1, states);
    }
    checkpointer.finish();

    // The EMA as one safetensors file, gathered one tensor at a time to rank 0.
    checkpoint::ExportOptions exportOptions;
    exportOptions.what = "regressor_ema";
    checkpoint::exportOnline({{"ema", ema}}, runtime->cpuComm().get(), dir + "/regressor_ema.safetensors", exportOptions);
    if (rank == 0) {
      std::printf("train_with_tessera: %d rank(s), zero3 + torch AdamW, steps %lld -> %lld, loss %.4f -> %.4f, EMA "
                  "exported to %s/regressor_ema.safetensors\n",
                  world, static_cast<long long>(start), static_cast<long long>(counters["step"]), first, last,
                  dir.c_str());
    }
    return last < first ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_with_tessera: error: %s\n", e.what());
    return 1;
  }
}
