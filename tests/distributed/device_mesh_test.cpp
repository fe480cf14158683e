// DeviceMesh: row-major layout, shard and replicate groups of a 2 x 2 mesh (threads and
// processes), the 1-D mesh, degenerate shapes and shape errors.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "common/errors.h"
#include "distributed/device_mesh.h"
#include "tests/support/multi_rank.h"

namespace tessera::distributed {
namespace {

using test::HarnessMode;
using test::HarnessOptions;
using test::RankContext;
using test::runOnRanks;

// Checks membership by collectives: the all-gather of world ranks over each group must
// list exactly the ranks the mesh says belong to it.
void expectGroupRanks(Communicator& group, int worldRank, const std::vector<int>& want) {
  ASSERT_EQ(group.worldSize(), static_cast<int>(want.size()));
  at::Tensor ranks = at::zeros({group.worldSize()}, at::kLong);
  group.allGatherInto(ranks, at::full({1}, int64_t{worldRank}, at::kLong));
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(ranks[static_cast<int64_t>(i)].item<int64_t>(), want[i]) << i;
}

void twoByTwo(HarnessMode mode) {
  HarnessOptions options;
  options.mode = mode;
  runOnRanks(4, [](RankContext& ctx) {
    const DeviceMesh mesh = DeviceMesh::twoD(ctx.comm(), 2, 2);
    EXPECT_EQ(mesh.ndim(), 2);
    EXPECT_EQ(mesh.shape(), (std::vector<int>{2, 2}));
    EXPECT_EQ(mesh.replicaIndex(), ctx.rank / 2);
    EXPECT_EQ(mesh.shardIndex(), ctx.rank % 2);
    const std::vector<int> shardRanks = ctx.rank < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
    const std::vector<int> replicateRanks = ctx.rank % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3};
    EXPECT_EQ(mesh.shardGroupRanks(), shardRanks);
    EXPECT_EQ(mesh.replicateGroupRanks(), replicateRanks);
    EXPECT_EQ(mesh.shardGroup()->rank(), mesh.shardIndex());
    EXPECT_EQ(mesh.replicateGroup()->rank(), mesh.replicaIndex());
    expectGroupRanks(*mesh.shardGroup(), ctx.rank, shardRanks);
    expectGroupRanks(*mesh.replicateGroup(), ctx.rank, replicateRanks);

    // Hybrid sharding's gradient path: reduce-scatter inside the shard group, then
    // all-reduce of the shard across replicas = the full sum over all 4 ranks.
    at::Tensor grad = at::arange(4, at::kFloat) * static_cast<float>(ctx.rank + 1);
    at::Tensor shard = at::zeros({2});
    mesh.shardGroup()->reduceScatter(shard, grad);
    mesh.replicateGroup()->allReduce(shard);
    EXPECT_TRUE(shard.equal(at::arange(4, at::kFloat).narrow(0, 2 * mesh.shardIndex(), 2) * 10.0f)) << shard;
    EXPECT_NE(mesh.describe().find("2x2"), std::string::npos) << mesh.describe();
    mesh.world()->barrier();
  }, options);
}

TEST(DeviceMeshTest, TwoByTwoThreads) { twoByTwo(HarnessMode::kThreads); }
TEST(DeviceMeshTest, TwoByTwoProcesses) { twoByTwo(HarnessMode::kProcesses); }

TEST(DeviceMeshTest, OneDimensional) {
  runOnRanks(3, [](RankContext& ctx) {
    const DeviceMesh mesh = DeviceMesh::oneD(ctx.comm());
    EXPECT_EQ(mesh.ndim(), 1);
    EXPECT_EQ(mesh.shape(), (std::vector<int>{3}));
    EXPECT_EQ(mesh.shardGroup(), ctx.comm());
    EXPECT_EQ(mesh.replicateGroup()->worldSize(), 1);
    EXPECT_EQ(mesh.shardIndex(), ctx.rank);
    EXPECT_EQ(mesh.replicaIndex(), 0);
    at::Tensor t = at::ones({2});
    mesh.replicateGroup()->allReduce(t);  // a group of one: unchanged
    EXPECT_TRUE(t.equal(at::ones({2})));
    expectGroupRanks(*mesh.shardGroup(), ctx.rank, {0, 1, 2});
  });
}

TEST(DeviceMeshTest, DegenerateShapesAndErrors) {
  runOnRanks(4, [](RankContext& ctx) {
    const DeviceMesh flat = DeviceMesh::twoD(ctx.comm(), 1, 4);  // pure sharding
    EXPECT_EQ(flat.shardGroup(), ctx.comm());
    EXPECT_EQ(flat.replicateGroup()->worldSize(), 1);
    const DeviceMesh replicated = DeviceMesh::twoD(ctx.comm(), 4, 1);  // pure replication (DDP)
    EXPECT_EQ(replicated.replicateGroup(), ctx.comm());
    EXPECT_EQ(replicated.shardGroup()->worldSize(), 1);
    EXPECT_EQ(replicated.replicaIndex(), ctx.rank);
    try {
      DeviceMesh::twoD(ctx.comm(), 3, 2);
      ADD_FAILURE() << "3 x 2 mesh over 4 ranks";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("world size 4"), std::string::npos) << e.what();
    }
    EXPECT_THROW(DeviceMesh::twoD(ctx.comm(), 0, 4), UsageError);
    EXPECT_THROW(DeviceMesh::oneD(nullptr), UsageError);
  });
}

}  // namespace
}  // namespace tessera::distributed
