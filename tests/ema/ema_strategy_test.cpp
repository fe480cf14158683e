// The EMA of a real sharded run: for no_shard, zero1, zero2 and zero3 at world sizes 1-4
// and hybrid at 2 (1 x 2) and 4 (2 x 2) (ranks as threads over gloo), the EMA shards
// (two decays and two power-function profiles) gathered after 30 steps equal a dense
// fp32 EMA of the same run's full parameters
// (1e-6 relative), and each rank holds 1/N of the EMA bytes (within padding; N = the
// shard group for hybrid). Evaluation with the EMA swapped in (withEmaWeights) computes
// with the EMA and restores the live weights exactly, also on exceptions; BatchNorm
// buffers are followed (copied or averaged), checkpointed and swapped too.
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <stdexcept>

#include "distributed/communicator.h"
#include "ema/ema_manager.h"
#include "ema/power_ema.h"
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
    options.strategy = sharding::parseStrategyKind(strategyName);
    options.wrap = {"fc1", "fc2"};  // zero3 / hybrid only
    options.fullyShard.shardSize = shardSize;
    auto strategy = sharding::makeStrategy(*net, ctx.comm(), options);
    distributed::Communicator& stateComm = strategy->stateComm();
    // The full parameters of the run: gathered fp32 masters (zero3 holds no full ones).
    auto fullParam = [&](const std::string& name) {
      const dtensor::ShardedParam& p = strategy->param(name);
      return p.spec.fullTensor(p.master, stateComm).clone();
    };
    EmaOptions emaOptions;
    emaOptions.decays = {0.9, 0.75};
    emaOptions.powerStds = {0.05, 0.10};  // post-hoc profiles: a blend that changes every step
    ShardedModelEMAManager manager(emaOptions);
    const size_t profiles = manager.numProfiles();
    followStrategy(manager, *strategy);

    // Dense reference EMA of the same run's full parameters (replicated in these strategies).
    std::map<std::string, std::vector<at::Tensor>> dense;
    for (const dtensor::ShardedParam& p : strategy->params()) {
      for (size_t i = 0; i < profiles; ++i) dense[p.name].push_back(fullParam(p.name));
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
      for (const dtensor::ShardedParam& p : strategy->params()) {
        const std::string& name = p.name;
        const at::Tensor full = fullParam(name);
        for (size_t i = 0; i < profiles; ++i) {
          const double d =
              manager.isPowerProfile(i) ? powerEmaBeta(manager.powerGamma(i), step) : emaOptions.decays[i];
          dense[name][i] = dense[name][i] * static_cast<float>(d) + full * static_cast<float>(1.0 - d);
        }
      }
    }
    int64_t emaBytes = 0, fullBytes = 0;
    for (const dtensor::ShardedParam& p : strategy->params()) {
      const std::string& name = p.name;
      for (size_t i = 0; i < profiles; ++i) {
        at::Tensor gathered = manager.spec(name).fullTensor(manager.emaShard(i, name), stateComm);
        const at::Tensor& want = dense[name][i];
        EXPECT_TRUE(at::allclose(gathered, want.view(gathered.sizes()), 1e-6, 1e-7))
            << strategyName << " world " << world << " rank " << ctx.rank << " " << name << " "
            << manager.stateName(i) << " max diff " << (gathered - want.view(gathered.sizes())).abs().max().item<float>();
        fullBytes += want.numel() * 4;
      }
      const auto& spec = manager.spec(name);
      EXPECT_EQ(spec.worldSize(), stateComm.worldSize());
      EXPECT_EQ(spec.placement(), dtensor::Placement::kShard0);
    }
    emaBytes = manager.bytes();
    // 1/N of the model per rank, within padding (at most one row per tensor and profile).
    const int n = stateComm.worldSize();
    EXPECT_EQ(n, shardSize > 0 ? shardSize : world);
    EXPECT_LE(emaBytes * n, fullBytes + n * static_cast<int64_t>(profiles) * (7 * 5 + 7 + 3 * 7 + 3 + 3 + 1) * 4)
        << strategyName;
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

// withEmaWeights: inside, the module computes with the EMA (its full parameters, gathered
// where the strategy shards them, equal the gathered EMA shards); afterwards the live
// parameters and masters are bitwise what they were, also when the evaluation throws.
TEST(EmaSwapTest, SwapRestoresExactlyAlsoOnException) {
  for (const std::string strategyName : {"no_shard", "zero1", "zero3"}) {
    test::runOnRanks(2, [&](test::RankContext& ctx) {
      at::set_num_threads(1);
      torch::manual_seed(7);
      SmallNet net;
      sharding::StrategyOptions options;
      options.strategy = sharding::parseStrategyKind(strategyName);
      options.wrap = {"fc1", "fc2"};
      auto strategy = sharding::makeStrategy(*net, ctx.comm(), options);
      EmaOptions emaOptions;
      emaOptions.decays = {0.5};
      ShardedModelEMAManager manager(emaOptions);
      followStrategy(manager, *strategy);
      const at::Tensor x = torch::ones({4, 5});
      for (int step = 1; step <= 3; ++step) {
        strategy->zeroGrad();
        sharding::unitForward(*net, x, [&](const at::Tensor& in) { return net->forward(in); }).pow(2).mean().backward();
        strategy->step(0.1);
        manager.update(step);
      }
      auto output = [&] {
        c10::NoGradGuard noGrad;
        return sharding::unitForward(*net, x, [&](const at::Tensor& in) { return net->forward(in); });
      };
      std::map<std::string, at::Tensor> masters, emaFull;
      for (const dtensor::ShardedParam& p : strategy->params()) {
        masters[p.name] = p.master.clone();
        emaFull[p.name] = manager.spec(p.name).fullTensor(manager.emaShard(0, p.name), strategy->stateComm());
      }
      const at::Tensor live = output();
      // The EMA model's output, computed densely from the gathered EMA.
      SmallNet dense;
      {
        c10::NoGradGuard noGrad;
        for (auto& item : dense->named_parameters()) item.value().copy_(emaFull.at(item.key()).view(item.value().sizes()));
      }
      const at::Tensor want = dense->forward(x).detach();
      EXPECT_FALSE(live.equal(want)) << "the EMA differs from the live weights";
      withEmaWeights(manager, *strategy, 0, [&] { EXPECT_TRUE(at::allclose(output(), want, 1e-6, 1e-7)); });
      EXPECT_TRUE(output().equal(live)) << strategyName;
      EXPECT_THROW(withEmaWeights(manager, *strategy, 0,
                                  [&] {
                                    EXPECT_TRUE(at::allclose(output(), want, 1e-6, 1e-7));
                                    throw std::runtime_error("sampling failed");
                                  }),
                   std::runtime_error);
      EXPECT_TRUE(output().equal(live)) << strategyName;
      for (const dtensor::ShardedParam& p : strategy->params()) EXPECT_TRUE(p.master.equal(masters.at(p.name))) << p.name;
    });
  }
}

// ema.buffers: a BatchNorm model's running statistics are followed by the EMA — copied
// from the model, or averaged like the parameters (num_batches_tracked always copied) —
// listed among the EMA's checkpoint entries, and swapped in for an EMA evaluation.
TEST(EmaBufferTest, BatchNormStatisticsCopiedOrAveraged) {
  for (const std::string mode : {"copy", "average"}) {
    test::runOnRanks(2, [&](test::RankContext& ctx) {
      at::set_num_threads(1);
      torch::manual_seed(3);
      torch::nn::Sequential net(torch::nn::Linear(4, 6), torch::nn::BatchNorm1d(6), torch::nn::Linear(6, 1));
      sharding::StrategyOptions options;
      options.strategy = sharding::StrategyKind::kZero2;
      options.bufferSync = sharding::BufferSync::kAverage;
      auto strategy = sharding::makeStrategy(*net, ctx.comm(), options);
      EmaOptions emaOptions;
      emaOptions.prefix = "generator_ema";
      emaOptions.decays = {0.5};
      emaOptions.buffers = parseEnum(kEmaBuffersNames, mode, "ema.buffers");
      ShardedModelEMAManager manager(emaOptions);
      followStrategy(manager, *strategy);
      auto bn = net[1]->as<torch::nn::BatchNorm1d>();
      at::Tensor denseMean = bn->running_mean.clone();
      for (int step = 1; step <= 4; ++step) {
        strategy->zeroGrad();
        const at::Tensor x = (torch::arange(32, at::kFloat).view({8, 4}) * step / 7.0).narrow(0, ctx.rank * 4, 4);
        net->forward(x).sum().backward();
        strategy->step(0.01);
        manager.update(step);
        denseMean = mode == "copy" ? bn->running_mean.clone() : denseMean * 0.5f + bn->running_mean * 0.5f;
      }
      EXPECT_TRUE(at::allclose(manager.emaBuffer(0, "1.running_mean"), denseMean, 1e-6, 1e-7)) << mode;
      EXPECT_TRUE(manager.emaBuffer(0, "1.num_batches_tracked").equal(bn->num_batches_tracked)) << mode;
      bool listed = false;
      for (const auto& e : manager.stateEntries("ema/")) {
        if (e.name != "ema/generator_ema/1.running_mean") continue;
        listed = true;
        EXPECT_EQ(e.spec.placement(), dtensor::Placement::kReplicate);
        EXPECT_TRUE(e.local.equal(manager.emaBuffer(0, "1.running_mean")));
      }
      EXPECT_TRUE(listed);
      const at::Tensor live = bn->running_mean.clone();
      withEmaWeights(manager, *strategy, 0, [&] { EXPECT_TRUE(bn->running_mean.equal(manager.emaBuffer(0, "1.running_mean"))); });
      EXPECT_TRUE(bn->running_mean.equal(live));
      if (mode == "average") {
        EXPECT_FALSE(live.equal(denseMean)) << "averaging differs from copying";
      }
    });
  }
}

}  // namespace
}  // namespace tessera::ema
