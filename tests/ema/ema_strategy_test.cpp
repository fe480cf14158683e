// The EMA of a real sharded run: for no_shard, zero1, zero2 and zero3 at world sizes 1-4
// and hybrid at 2 (1 x 2) and 4 (2 x 2) (ranks as threads over gloo), the EMA shards
// gathered after 30 steps equal a dense fp32 EMA of the same run's full parameters
// (1e-6 relative), and each rank holds 1/N of the EMA bytes (within padding; N = the
// shard group for hybrid).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "distributed/communicator.h"
#include "ema/ema_manager.h"
#include "ema/strategy_ema.h"
#include "sharding/fully_shard.h"
#include "sharding/strategy.h"
#include "tests/support/multi_rank.h"

namespace tessera::ema {
namespace {

// Uneven shapes: rows 7, 3 and 1 over 2-4 ranks, a 1-element bias.
struct SmallNetImpl : torch::nn::Module {
  SmallNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(5, 7));
    fc2 = register_module("fc2", torch::nn::Linear(7, 3));
    head = register_module("head", torch::nn::Linear(3, 1));
  }
  // fc1 and fc2 are zero3/hybrid units (entered through unitForward); head is the root's.
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = sharding::unitForward(*fc1, x, [this](const at::Tensor& in) { return fc1(in); });
    h = sharding::unitForward(*fc2, torch::tanh(h), [this](const at::Tensor& in) { return fc2(in); });
    return head(torch::tanh(h));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, head{nullptr};
};
TORCH_MODULE(SmallNet);

void runCase(const std::string& strategyName, int world, int shardSize = 0) {
  test::runOnRanks(world, [&](test::RankContext& ctx) {
    at::set_num_threads(1);
    torch::manual_seed(7);
    SmallNet net;
    sharding::StrategyOptions options;
    options.strategy = strategyName;
    options.optimizer.lr = 0.05;
    options.wrap = {"fc1", "fc2"};  // zero3 / hybrid only
    options.fullyShard.shardSize = shardSize;
    auto strategy = sharding::makeStrategy(*net, ctx.comm(), options);
    distributed::Communicator& stateComm = strategy->stateComm();
    // The full parameters of the run: gathered fp32 masters (zero3 holds no full ones).
    auto fullParam = [&](const std::string& name) {
      return strategy->spec(name).fullTensor(strategy->masterShard(name), stateComm).clone();
    };
    EmaOptions emaOptions;
    emaOptions.decays = {0.9, 0.75};
    ShardedModelEMAManager manager(emaOptions);
    followStrategy(manager, *strategy);

    // Dense reference EMA of the same run's full parameters (replicated in these strategies).
    std::map<std::string, std::vector<at::Tensor>> dense;
    for (const auto& name : strategy->paramNames()) {
      for (double d : emaOptions.decays) {
        (void)d;
        dense[name].push_back(fullParam(name));
      }
    }
    const int64_t globalBatch = 24, perRank = globalBatch / world;
    for (int step = 1; step <= 30; ++step) {
      torch::manual_seed(1000 + step);
      at::Tensor x = torch::randn({globalBatch, 5}), y = torch::randn({globalBatch, 1});
      strategy->zeroGrad();
      at::Tensor local = sharding::unitForward(*net, x.narrow(0, ctx.rank * perRank, perRank),
                                               [&](const at::Tensor& in) { return net->forward(in); });
      torch::mse_loss(local, y.narrow(0, ctx.rank * perRank, perRank)).backward();
      strategy->step(0.05);
      manager.update(step);
      for (const auto& name : strategy->paramNames()) {
        const at::Tensor full = fullParam(name);
        for (size_t i = 0; i < emaOptions.decays.size(); ++i) {
          const double d = emaOptions.decays[i];
          dense[name][i] = dense[name][i] * static_cast<float>(d) + full * static_cast<float>(1.0 - d);
        }
      }
    }
    int64_t emaBytes = 0, fullBytes = 0;
    for (const auto& name : strategy->paramNames()) {
      for (size_t i = 0; i < emaOptions.decays.size(); ++i) {
        at::Tensor gathered = manager.spec(name).fullTensor(manager.emaShard(i, name), stateComm);
        const at::Tensor& want = dense[name][i];
        EXPECT_TRUE(at::allclose(gathered, want.view(gathered.sizes()), 1e-6, 1e-7))
            << strategyName << " world " << world << " rank " << ctx.rank << " " << name << " decay "
            << emaOptions.decays[i] << " max diff " << (gathered - want.view(gathered.sizes())).abs().max().item<float>();
        fullBytes += want.numel() * 4;
      }
      const auto& spec = manager.spec(name);
      EXPECT_EQ(spec.worldSize(), stateComm.worldSize());
      EXPECT_EQ(spec.placement(), sharding::Placement::kShard0);
    }
    emaBytes = manager.bytes();
    // 1/N of the model per rank, within padding (at most one row per tensor and decay).
    const int n = stateComm.worldSize();
    EXPECT_EQ(n, shardSize > 0 ? shardSize : world);
    EXPECT_LE(emaBytes * n, fullBytes + n * 2 * (7 * 5 + 7 + 3 * 7 + 3 + 3 + 1) * 4) << strategyName;
    EXPECT_GE(emaBytes * n, fullBytes) << strategyName;
  });
}

TEST(EmaStrategyTest, NoShardMatchesDenseEmaAtWorldSizes1To4) {
  for (int world : {1, 2, 3, 4}) runCase("no_shard", world);
}
TEST(EmaStrategyTest, Zero1MatchesDenseEmaAtWorldSizes1To4) {
  for (int world : {1, 2, 3, 4}) runCase("zero1", world);
}
TEST(EmaStrategyTest, Zero2MatchesDenseEmaAtWorldSizes1To4) {
  for (int world : {1, 2, 3, 4}) runCase("zero2", world);
}
TEST(EmaStrategyTest, Zero3MatchesDenseEmaAtWorldSizes1To4) {
  for (int world : {1, 2, 3, 4}) runCase("zero3", world);
}
TEST(EmaStrategyTest, HybridMatchesDenseEmaOneByTwoAndTwoByTwo) {
  runCase("hybrid", 2, /*shardSize=*/1);
  runCase("hybrid", 4, /*shardSize=*/2);
}

}  // namespace
}  // namespace tessera::ema
