// run.deterministic: the canonical tree over micro-batches (sharding/canonical_reduce.h) and
// the strategies that reduce through it. The bits of every parameter and optimizer state
// after training must not depend on the world size (1-4, micro-batch counts that do not
// divide), the strategy (no_shard, zero1, zero2, zero3, hybrid) or the rank that computed
// which micro-batch: each case is compared with torch::equal, not a tolerance.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "distributed/communicator.h"
#include "sharding/canonical_reduce.h"
#include "sharding/fully_shard.h"
#include "sharding/strategy.h"
#include "tests/sharding/test_models.h"
#include "tests/support/multi_rank.h"

namespace tessera::sharding {
namespace deterministic_test {

using test::RankContext;
using test::runOnRanks;
using namespace tessera::sharding::testing;

// Micro-batch `index`'s stand-in gradient: the same on whichever rank computes it.
at::Tensor leaf(int64_t index, int64_t numel) {
  return (at::arange(numel, at::kFloat) * 0.731f + static_cast<float>(index) * 1.37f).sin() *
         std::pow(10.0f, static_cast<float>(index % 5) - 2.0f);
}

// The tree's sum of every leaf on one rank: the reference every split must reproduce.
at::Tensor singleRankSum(int64_t count, int64_t numel) {
  TreeStack stack(count);
  for (int64_t m = 0; m < count; ++m) stack.push({m, m + 1}, leaf(m, numel));
  EXPECT_EQ(stack.nodes().size(), 1u);
  return stack.nodes().front().second;
}

TEST(CanonicalTreeTest, EverySplitOverRanksAddsTheSameBits) {
  for (int64_t count = 1; count <= 13; ++count) {
    const at::Tensor whole = singleRankSum(count, 9);
    at::Tensor naive = at::zeros({9});
    for (int64_t m = 0; m < count; ++m) naive += leaf(m, 9);
    EXPECT_TRUE(at::allclose(whole, naive, 1e-5, 1e-6)) << count << " micro-batches: the tree sums the leaves";
    for (int world = 1; world <= std::min<int64_t>(count, 5); ++world) {
      const MicroBatchPlan plan{count, world};
      TreeStack merged(count);
      int64_t covered = 0;
      for (int r = 0; r < world; ++r) {
        TreeStack mine(count);
        for (int64_t m = plan.begin(r); m < plan.end(r); ++m) mine.push({m, m + 1}, leaf(m, 9));
        const std::vector<TreeNode> expected = frontier(count, plan.begin(r), plan.end(r));
        ASSERT_EQ(mine.nodes().size(), expected.size()) << count << " over " << world << ", rank " << r;
        for (size_t i = 0; i < expected.size(); ++i) {
          EXPECT_EQ(mine.nodes()[i].first, expected[i]);
          covered += expected[i].hi - expected[i].lo;
          merged.push(mine.nodes()[i].first, mine.nodes()[i].second);
        }
        // A rank's frontier is at most two nodes per level of the tree.
        int64_t levels = 1;
        while ((int64_t{1} << (levels - 1)) < count) ++levels;
        EXPECT_LE(static_cast<int64_t>(expected.size()), 2 * levels);
      }
      EXPECT_EQ(covered, count);
      ASSERT_EQ(merged.nodes().size(), 1u) << count << " over " << world;
      EXPECT_TRUE(torch::equal(merged.nodes().front().second, whole)) << count << " micro-batches over " << world;
    }
  }
  // Power-of-two shares are nodes of the tree: one sum per rank, a reduce-scatter's bytes.
  EXPECT_EQ(frontier(8, 2, 4).size(), 1u);
  EXPECT_EQ(frontier(8, 0, 8).size(), 1u);
  EXPECT_EQ(frontier(7, 2, 5).size(), 2u);
}

// canonicalReduceScatter on W ranks equals the single-rank tree, slice by slice: sharded
// (zero2/zero3: one chunk a rank), replicated (no_shard/zero1: one chunk), hybrid-like (2
// chunks over 4 ranks).
TEST(CanonicalTreeTest, ReduceScatterGivesEachRankItsSliceOfTheOneSum) {
  useOneThread();
  const int64_t count = 7, chunkNumel = 5;
  for (int world : {1, 2, 3, 4}) {
    for (int chunks : {1, world, world == 4 ? 2 : world}) {
      const int64_t numel = chunks * chunkNumel;
      const at::Tensor whole = singleRankSum(count, numel);
      runOnRanks(world, [&](RankContext& ctx) {
        const MicroBatchPlan plan{count, world};
        CanonicalGradients sums(plan);
        for (int64_t m = plan.begin(ctx.rank); m < plan.end(ctx.rank); ++m) sums.add(0, m, leaf(m, numel));
        sums.add(0, -1, at::full({numel}, 1e9f));  // a padding pass: dropped
        const SliceLayout slices = SliceLayout::ofChunks(chunks, chunkNumel, world);
        const at::Tensor mine = sums.reduce(0, *ctx.comm(), slices, numel, at::kFloat);
        ASSERT_EQ(mine.numel(), slices.sliceNumel);
        const int64_t offset = slices.offsets[static_cast<size_t>(ctx.rank)];
        const int64_t length = slices.lengths[static_cast<size_t>(ctx.rank)];
        EXPECT_TRUE(torch::equal(mine.narrow(0, 0, length), whole.narrow(0, offset, length)))
            << "rank " << ctx.rank << " of " << world << ", " << chunks << " chunks";
        EXPECT_TRUE(mine.narrow(0, length, slices.sliceNumel - length).eq(0).all().item<bool>()) << "padding is zero";
      });
    }
  }
}

TEST(CanonicalTreeTest, ValuesAreSummedInIndexOrderOnEveryWorldSize) {
  const int64_t count = 6;
  const std::vector<double> values = {1e16, 1.0, -1e16, 1.0, 0.1, 3.0};
  double expected = 0;
  for (const double v : values) expected += v;  // index order: 1e16 + 1 loses the 1
  for (int world : {1, 2, 3, 4}) {
    runOnRanks(world, [&](RankContext& ctx) {
      const MicroBatchPlan plan{count, world};
      std::map<int64_t, double> mine;
      for (int64_t m = plan.begin(ctx.rank); m < plan.end(ctx.rank); ++m) mine[m] = values[static_cast<size_t>(m)];
      EXPECT_EQ(canonicalValueSum(*ctx.comm(), count, mine), expected) << "world " << world;
    });
  }
}

// ---- the strategies ---------------------------------------------------------------------

struct DetCase {
  std::string strategy;
  int world = 1;
  int shardSize = 0;  // hybrid's shard groups; no_shard/zero1/zero2's state groups
  std::string name() const {
    return strCat(strategy, "_world", world, shardSize ? strCat("_shard", shardSize) : std::string());
  }
};

// What a run ends with: every master and optimizer state, full, by name.
using Finals = std::map<std::string, at::Tensor>;

constexpr int kSteps = 6;
constexpr int64_t kMicroBatches = 5;  // uneven over 2, 3 and 4 ranks
constexpr int64_t kMicroBatch = 3;    // samples

Finals trainDeterministic(const DetCase& c) {
  seedCpu(5);
  std::vector<at::Tensor> xs, ys;
  for (int t = 0; t < kSteps; ++t) {
    xs.push_back(torch::randn({kMicroBatches * kMicroBatch, 5}) * 3);
    ys.push_back(torch::randn({kMicroBatches * kMicroBatch, 1}));
  }
  seedCpu(7);
  const auto init = paramValues(*UnevenMlp());
  Finals finals;
  runOnRanks(c.world, [&](RankContext& ctx) {
    useOneThread();
    UnevenMlp model;
    loadParamValues(*model, init);
    StrategyOptions o;
    o.strategy = parseStrategyKind(c.strategy);
    o.wrap = UnevenMlpImpl::units();
    o.optimizer.kind = optim::OptimizerKind::kAdamW;
    o.optimizer.weightDecay = 0.1;
    o.gradClip = 0.5;  // clips in most steps: the exact norm is used
    o.bucketBytes = 64;  // several gradient buckets under no_shard/zero1/zero2
    if (c.strategy == "hybrid") {
      o.fullyShard.shardSize = c.shardSize;
    } else {
      o.stateGroupSize = c.shardSize;
    }
    auto strategy = makeStrategy(*model, ctx.comm(), o);
    const MicroBatchPlan plan{kMicroBatches, ctx.world};
    strategy->setDeterministic(plan);
    for (int t = 0; t < kSteps; ++t) {
      strategy->zeroGrad();
      for (int64_t pass = 0; pass < plan.passes(); ++pass) {
        const int64_t index = plan.begin(ctx.rank) + pass;
        const bool padding = index >= plan.end(ctx.rank);
        const int64_t m = padding ? plan.end(ctx.rank) - 1 : index;
        const at::Tensor x = xs[static_cast<size_t>(t)].narrow(0, m * kMicroBatch, kMicroBatch);
        const at::Tensor y = ys[static_cast<size_t>(t)].narrow(0, m * kMicroBatch, kMicroBatch);
        (torch::mse_loss(model->forward(x), y) / static_cast<double>(kMicroBatches)).backward();
        strategy->addMicroBatchGradients(padding ? -1 : index);
      }
      ASSERT_FALSE(strategy->step(1e-2).skipped);
    }
    Finals mine;
    for (const dtensor::ShardedParam& p : strategy->params()) {
      mine["master/" + p.name] = p.spec.fullTensor(p.master, strategy->stateComm()).clone();
      for (const std::string& key : strategy->optimizer().stateNames()) {
        mine[key + "/" + p.name] = p.spec.fullTensor(strategy->optimizer().state(p, key), strategy->stateComm()).clone();
      }
    }
    if (ctx.rank == ctx.world - 1) finals = mine;  // the last rank: under hybrid another replica than rank 0
  });
  return finals;
}

TEST(DeterministicStrategyTest, EveryStrategyAndWorldSizeTrainsTheSameBits) {
  const Finals reference = trainDeterministic({"no_shard", 1});
  ASSERT_FALSE(reference.empty());
  // Training moved the parameters.
  seedCpu(7);
  const auto init = paramValues(*UnevenMlp());
  EXPECT_FALSE(torch::equal(reference.at("master/fc1.weight"), init.at("fc1.weight")));

  const std::vector<DetCase> cases = {
      {"zero3", 1},    {"no_shard", 2}, {"zero1", 2},    {"zero2", 2}, {"zero3", 2},
      {"no_shard", 3}, {"zero1", 3},    {"zero2", 3},    {"zero3", 3}, {"no_shard", 4},
      {"zero2", 4},    {"zero3", 4},    {"hybrid", 4, 2}, {"zero1", 4, 2}, {"zero2", 4, 2}, {"no_shard", 4, 2}};
  for (const DetCase& c : cases) {
    const Finals got = trainDeterministic(c);
    ASSERT_EQ(got.size(), reference.size()) << c.name();
    for (const auto& [name, want] : reference) {
      EXPECT_TRUE(torch::equal(got.at(name), want))
          << c.name() << ": " << name << " differs by " << (got.at(name) - want).abs().max().item<double>();
    }
  }
}

// Without run.deterministic, 1 and 3 ranks agree only to rounding: the mode is what makes
// the bits equal (a guard against a test that would pass anyway).
TEST(DeterministicStrategyTest, WithoutTheModeThreeRanksDifferFromOneInTheLastBits) {
  const auto trainPlain = [](int world) {
    seedCpu(5);
    std::vector<at::Tensor> xs, ys;
    for (int t = 0; t < kSteps; ++t) {
      xs.push_back(torch::randn({6 * kMicroBatch, 5}) * 3);
      ys.push_back(torch::randn({6 * kMicroBatch, 1}));
    }
    seedCpu(7);
    const auto init = paramValues(*UnevenMlp());
    at::Tensor out;
    runOnRanks(world, [&](RankContext& ctx) {
      useOneThread();
      UnevenMlp model;
      loadParamValues(*model, init);
      StrategyOptions o;
      o.strategy = StrategyKind::kNoShard;
      o.optimizer.kind = optim::OptimizerKind::kAdamW;
      auto strategy = makeStrategy(*model, ctx.comm(), o);
      for (int t = 0; t < kSteps; ++t) {
        strategy->zeroGrad();
        const int64_t rows = xs[0].size(0) / ctx.world;
        torch::mse_loss(model->forward(xs[static_cast<size_t>(t)].narrow(0, ctx.rank * rows, rows)),
                        ys[static_cast<size_t>(t)].narrow(0, ctx.rank * rows, rows))
            .backward();
        strategy->step(1e-2);
      }
      if (ctx.rank == 0) out = strategy->param("fc1.weight").master.clone();
    });
    return out;
  };
  const at::Tensor one = trainPlain(1), three = trainPlain(3);
  EXPECT_TRUE(at::allclose(one, three, 1e-4, 1e-6));
  EXPECT_FALSE(torch::equal(one, three));
}

}  // namespace deterministic_test
}  // namespace tessera::sharding
