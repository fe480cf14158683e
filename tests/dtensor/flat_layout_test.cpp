// FlatLayout packs every rank's ShardSpec slice at fixed offsets of a rank-major flat
// buffer (so one reduce-scatter yields every parameter's gradient shard and one
// all-gather every full parameter), round-trips full tensors exactly, and the bucket
// planner groups parameters by bytes. Also checked with a real reduce-scatter.
#include <gtest/gtest.h>

#include "common/errors.h"
#include "distributed/communicator.h"
#include "dtensor/flat_layout.h"
#include "tests/sharding/test_models.h"
#include "tests/support/multi_rank.h"

namespace tessera::dtensor {
namespace {

using test::RankContext;
using test::runOnRanks;

// Rows that do not divide by 2-4, fewer rows than ranks, 0-d, empty.
const std::vector<std::vector<int64_t>> kShapes = {{7, 5}, {3}, {1, 3}, {}, {0, 4}, {10}, {2, 3, 2}};

std::vector<at::Tensor> fullTensors(float base) {
  std::vector<at::Tensor> out;
  float next = base;
  for (const auto& s : kShapes) {
    at::Tensor t = at::empty(s);
    t.copy_(at::arange(t.numel(), at::kFloat).add(next).view(s));
    next += 100;
    out.push_back(t);
  }
  return out;
}

std::vector<ShardSpec> specsFor(int world, int rank, Placement placement = Placement::kShard0) {
  std::vector<ShardSpec> specs;
  for (const auto& s : kShapes) specs.emplace_back(s, at::kFloat, world, rank, placement);
  return specs;
}

TEST(FlatLayoutTest, ChunkRHoldsEveryParamsShardR) {
  const auto full = fullTensors(1);
  for (int world : {1, 2, 3, 4}) {
    const FlatLayout layout(specsFor(world, 0));
    EXPECT_EQ(layout.chunks(), world);
    at::Tensor flat = at::full({layout.flatNumel()}, -1.0f);  // garbage that packing must overwrite
    for (size_t i = 0; i < full.size(); ++i) layout.packFull(flat, i, full[i]);
    for (int r = 0; r < world; ++r) {
      const auto rankSpecs = specsFor(world, r);
      const FlatLayout rankLayout(rankSpecs);
      EXPECT_EQ(rankLayout.chunkNumel(), layout.chunkNumel());
      for (size_t i = 0; i < full.size(); ++i) {
        EXPECT_EQ(rankLayout.offset(i), layout.offset(i));
        EXPECT_TRUE(layout.slot(layout.chunk(flat, r), i).equal(rankSpecs[i].shardOf(full[i])))
            << "world " << world << " rank " << r << " tensor " << i;
      }
    }
    // Round trip.
    for (size_t i = 0; i < full.size(); ++i) {
      at::Tensor back = at::zeros(kShapes[i]);
      layout.unpackFull(flat, i, back);
      EXPECT_TRUE(back.equal(full[i])) << "world " << world << " tensor " << i;
    }
  }
}

TEST(FlatLayoutTest, ReplicatedIsFullTensorsBackToBackAndUndefinedPacksZeros) {
  const auto full = fullTensors(1);
  const FlatLayout layout(specsFor(3, 1, Placement::kReplicate));
  EXPECT_EQ(layout.chunks(), 1);
  at::Tensor flat = at::full({layout.flatNumel()}, -1.0f);
  for (size_t i = 0; i < full.size(); ++i) layout.packFull(flat, i, i == 1 ? at::Tensor() : full[i]);
  std::vector<at::Tensor> parts;
  for (size_t i = 0; i < full.size(); ++i) parts.push_back(i == 1 ? at::zeros({3}) : full[i].reshape({-1}));
  EXPECT_TRUE(flat.equal(at::cat(parts)));
  EXPECT_TRUE(layout.slot(layout.chunk(flat, 0), 0).equal(full[0]));
}

TEST(FlatLayoutTest, CastsAndChecksShapes) {
  const FlatLayout layout(specsFor(2, 0));
  at::Tensor flat = at::zeros({layout.flatNumel()}, at::kBFloat16);
  const auto full = fullTensors(0);
  layout.packFull(flat, 0, full[0]);
  at::Tensor back = at::zeros({7, 5}, at::kDouble);
  layout.unpackFull(flat, 0, back);
  EXPECT_TRUE(back.equal(full[0].to(at::kBFloat16).to(at::kDouble)));
  EXPECT_THROW(layout.packFull(flat, 0, at::zeros({5, 7})), Error);
  EXPECT_THROW(layout.chunk(at::zeros({3}), 0), Error);
  EXPECT_THROW(FlatLayout({ShardSpec({4}, at::kFloat, 2, 0), ShardSpec({4}, at::kFloat, 3, 0)}), Error);
}

TEST(FlatLayoutTest, PlanBucketsBySize) {
  EXPECT_EQ(planBuckets({40, 40, 40, 100, 10}, 100),
            (std::vector<std::vector<size_t>>{{0, 1}, {2}, {3}, {4}}));
  EXPECT_EQ(planBuckets({500, 1, 1}, 100), (std::vector<std::vector<size_t>>{{0}, {1, 2}}));
  EXPECT_EQ(planBuckets({1, 2, 3}, 1 << 20), (std::vector<std::vector<size_t>>{{0, 1, 2}}));
  EXPECT_TRUE(planBuckets({}, 10).empty());
  EXPECT_THROW(planBuckets({1}, 0), ConfigError);
}

// One reduce-scatter of the packed full tensors gives each rank the sum's shards.
TEST(FlatLayoutTest, ReduceScatterYieldsShardSpecLayout) {
  sharding::testing::useOneThread();
  for (int world : {2, 3, 4}) {
    runOnRanks(world, [](RankContext& ctx) {
      const auto specs = specsFor(ctx.world, ctx.rank);
      const FlatLayout layout(specs);
      const auto mine = fullTensors(static_cast<float>(ctx.rank));
      at::Tensor flat = at::empty({layout.flatNumel()});
      for (size_t i = 0; i < mine.size(); ++i) layout.packFull(flat, i, mine[i]);
      at::Tensor local = at::empty({layout.chunkNumel()});
      ctx.comm()->reduceScatter(local, flat, distributed::ReduceOp::kSum);
      for (size_t i = 0; i < mine.size(); ++i) {
        at::Tensor sum = at::zeros(kShapes[i]);
        for (int r = 0; r < ctx.world; ++r) sum += fullTensors(static_cast<float>(r))[i];
        EXPECT_TRUE(layout.slot(local, i).equal(specs[i].shardOf(sum))) << "tensor " << i;
      }
    });
  }
}

}  // namespace
}  // namespace tessera::dtensor
