// The node-local checkpoint tier (checkpoint/local_tier.h): ranks on threads over gloo,
// each simulated node a directory of its own; a lost node is its directory deleted.
#include "checkpoint/local_tier.h"

#include <gtest/gtest.h>

#include <sys/stat.h>

#include <fstream>

#include "checkpoint/metadata.h"
#include "checkpoint_test_util.h"

namespace tessera::checkpoint {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

NodeLayout layoutOf(std::vector<std::vector<int>> nodes) {
  NodeLayout layout;
  int world = 0;
  for (const auto& n : nodes) world += static_cast<int>(n.size());
  layout.nodeOf.assign(static_cast<size_t>(world), -1);
  for (size_t i = 0; i < nodes.size(); ++i) {
    for (int r : nodes[i]) layout.nodeOf[static_cast<size_t>(r)] = static_cast<int>(i);
  }
  layout.nodes = std::move(nodes);
  return layout;
}

std::string describe(const std::vector<ReplicaCopy>& plan) {
  std::string out;
  for (const ReplicaCopy& c : plan) out += strCat(out.empty() ? "" : " ", c.from, "->", c.to);
  return out;
}

TEST(LocalTierTest, EachRanksFileGoesToTheRankOfItsPlaceOnTheNextNodes) {
  EXPECT_EQ(describe(replicaPlan(layoutOf({{0, 1}, {2, 3}}), 1)), "0->2 2->0 1->3 3->1");
  // A ring of three nodes, one uneven: every rank sends once per hop, to the next node.
  EXPECT_EQ(describe(replicaPlan(layoutOf({{0, 1}, {2, 3}, {4}}), 1)), "0->2 4->0 1->3 2->4 3->4");
  EXPECT_EQ(describe(replicaPlan(layoutOf({{0}, {1}, {2}}), 2)), "0->1 1->0 0->2 2->0 1->2 2->1");
  EXPECT_EQ(describe(replicaPlan(layoutOf({{0, 1, 2}}), 1)), "");
  EXPECT_EQ(describe(replicaPlan(layoutOf({{0}, {1}}), 0)), "");
}

SaveRequest requestFor(const std::vector<testing::GlobalTensor>& model, int64_t step, int world, int rank) {
  SaveRequest req;
  req.step = step;
  req.strategy = "zero3";
  req.entries = testing::entriesFor(model, world, rank);
  req.components = testing::componentsFor(model);
  req.trainerState = strCat("{\"step\": ", step, "}");
  req.rankState = strCat("{\"rng\": ", 1000 + rank, "}");
  return req;
}

// `world` ranks, rank r on node nodeOf(r) (directory <root>/node<k>), save `steps` (the
// model of step s has seed s).
void saveLocally(int world, const TempDir& root, const std::function<int(int)>& nodeOf, std::vector<int64_t> steps,
                 int replicas, int keepLast = 2, const std::string& owner = "") {
  test::runOnRanks(world, [&](test::RankContext& ctx) {
    LocalTierOptions options;
    options.dir = root / strCat("node", nodeOf(ctx.rank));
    options.replicas = replicas;
    options.keepLast = keepLast;
    options.owner = owner;
    LocalCheckpointer local(options, ctx.comm());
    for (int64_t step : steps) {
      const LocalSaveStats stats = local.save(requestFor(testing::sampleModel(step), step, ctx.world, ctx.rank));
      if (!stats.saved) throw Error(strCat("step ", step, ": ", stats.error));
    }
  });
}

// Promotes on `world` ranks (all on node `node`) and loads the result resharded.
std::optional<PromotedStep> promoteAndCheck(int world, const TempDir& root, int node, const std::string& checkpoints,
                                            int64_t expectStep, const std::string& owner = "") {
  std::optional<PromotedStep> promoted;
  test::runOnRanks(world, [&](test::RankContext& ctx) {
    auto mine = promoteLocalStep(root / strCat("node", node), owner, checkpoints, ctx.comm().get());
    if (ctx.rank == 0) promoted = mine;
    if (!mine) return;
    const auto model = testing::sampleModel(expectStep);
    auto entries = testing::junkEntriesFor(model, ctx.world, ctx.rank);
    const LoadResult r = loadCheckpoint(mine->dir, entries);
    EXPECT_EQ(r.step, expectStep);
    EXPECT_EQ(r.trainerState, strCat("{\"step\":", expectStep, "}"));
    const auto truth = testing::entriesFor(model, ctx.world, ctx.rank);
    for (size_t i = 0; i < entries.size(); ++i) {
      const auto [b, e] = truth[i].spec.localRowRange();
      const int64_t rows = e - b;
      auto real = [&](const at::Tensor& t) {
        return t.dim() == 0 || truth[i].spec.placement() == dtensor::Placement::kReplicate ? t : t.narrow(0, 0, rows);
      };
      EXPECT_TRUE(testing::bitwiseEqual(real(entries[i].local), real(truth[i].local))) << entries[i].name;
    }
  });
  return promoted;
}

TEST(LocalTierTest, ALostNodesFilesComeFromItsReplicasOnTheOthers) {
  TempDir root;
  // 2 nodes x 2 ranks; step 5 falls to retention (keep 2).
  saveLocally(4, root, [](int r) { return r / 2; }, {5, 10, 15}, /*replicas=*/1);
  for (int node : {0, 1}) {
    const std::string dir = root / strCat("node", node);
    EXPECT_FALSE(fs::exists(fs::path(dir) / "step_00000005")) << dir;
    EXPECT_TRUE(fs::exists(fs::path(dir) / "step_00000010" / kMetadataFile)) << dir;
    for (int r = 0; r < 4; ++r) EXPECT_TRUE(fs::exists(fs::path(dir) / "step_00000015" / rankDataFile(r))) << dir << r;
  }
  removeTree(root / "node1");  // the node is lost, and its memory with it
  const auto promoted = promoteAndCheck(2, root, 0, root / "checkpoints", 15);
  ASSERT_TRUE(promoted.has_value());
  EXPECT_EQ(promoted->step, 15);
  EXPECT_EQ(promoted->nodesHolding, 1);
  EXPECT_EQ(testing::readText(root / "checkpoints/latest"), "step_00000015\n");
  // Promoted once: the persistent tier now holds it, so a second promotion finds nothing newer.
  EXPECT_FALSE(promoteAndCheck(2, root, 0, root / "checkpoints", 15).has_value());
}

TEST(LocalTierTest, ThreeRanksResumeOnFourFromTwoSurvivingNodesOfThree) {
  TempDir root;
  saveLocally(3, root, [](int r) { return r; }, {7}, /*replicas=*/1);
  removeTree(root / "node1");
  // The survivors, nodes 0 and 2, as four ranks: the files of all three saved ranks are there.
  std::optional<PromotedStep> promoted;
  test::runOnRanks(4, [&](test::RankContext& ctx) {
    auto mine = promoteLocalStep(root / strCat("node", ctx.rank < 2 ? 0 : 2), "", root / "checkpoints", ctx.comm().get());
    if (ctx.rank == 0) promoted = mine;
  });
  ASSERT_TRUE(promoted.has_value());
  EXPECT_EQ(promoted->nodesHolding, 2);
  test::runOnRanks(4, [&](test::RankContext& ctx) {
    auto entries = testing::junkEntriesFor(testing::sampleModel(7), 4, ctx.rank);
    loadCheckpoint(promoted->dir, entries);
    const auto truth = testing::entriesFor(testing::sampleModel(7), 4, ctx.rank);
    EXPECT_TRUE(testing::bitwiseEqual(entries[0].local.narrow(0, 0, truth[0].spec.localRowRange().second -
                                                                     truth[0].spec.localRowRange().first),
                                      truth[0].local.narrow(0, 0, truth[0].spec.localRowRange().second -
                                                                      truth[0].spec.localRowRange().first)));
  });
}

TEST(LocalTierTest, WithoutReplicasALostNodeLeavesThePersistentTier) {
  TempDir root;
  saveLocally(4, root, [](int r) { return r / 2; }, {10}, /*replicas=*/0);
  EXPECT_FALSE(fs::exists(fs::path(root / "node0") / "step_00000010" / rankDataFile(2)));
  removeTree(root / "node1");
  EXPECT_FALSE(promoteAndCheck(2, root, 0, root / "checkpoints", 10).has_value());
  EXPECT_FALSE(fs::exists(root / "checkpoints/step_00000010"));
}

TEST(LocalTierTest, OnlyStepsNewerThanThePersistentTiersNewestArePromoted) {
  TempDir root;
  saveLocally(2, root, [](int r) { return r; }, {10}, /*replicas=*/1);
  testing::saveOnRanks(2, root / "checkpoints", testing::sampleModel(20), 20);
  EXPECT_FALSE(promoteAndCheck(2, root, 0, root / "checkpoints", 20).has_value());
}

TEST(LocalTierTest, AStepWithoutItsMetadataIsPassedOverForTheOneBefore) {
  TempDir root;
  saveLocally(2, root, [](int r) { return r; }, {10, 20}, /*replicas=*/1);
  // A crash before the leaders wrote step 20's metadata.json, and node 1 lost.
  fs::remove(fs::path(root / "node0") / "step_00000020" / kMetadataFile);
  removeTree(root / "node1");
  const auto promoted = promoteAndCheck(2, root, 0, root / "checkpoints", 10);
  ASSERT_TRUE(promoted.has_value());
  EXPECT_EQ(promoted->step, 10);
}

TEST(LocalTierTest, AReplicaOfAnotherSaveIsNotMixedIn) {
  TempDir root;
  saveLocally(2, root, [](int r) { return r; }, {10}, /*replicas=*/0);
  TempDir other;
  saveLocally(2, other, [](int r) { return r; }, {10}, /*replicas=*/0);
  // Node 0 holds rank 0's file of one save, node 1 rank 1's file of another with other
  // metadata (another run's, in the same directory names): never put together.
  std::ofstream(root / "node1/step_00000010/metadata.json", std::ios::app) << " ";
  EXPECT_FALSE(promoteAndCheck(2, root, 0, root / "checkpoints", 10).has_value());
}

TEST(LocalTierTest, PlantedFifosAndLinksAreNotHeldAndNeverWaitedOn) {
  TempDir root;
  saveLocally(2, root, [](int r) { return r; }, {10, 20}, /*replicas=*/1);
  removeTree(root / "node1");
  // Step 20: metadata.json a FIFO. Step 10: rank 1's replica a link to rank 0's file.
  const fs::path step20 = fs::path(root / "node0") / "step_00000020";
  fs::remove(step20 / kMetadataFile);
  ASSERT_EQ(::mkfifo((step20 / kMetadataFile).c_str(), 0600), 0);
  const fs::path step10 = fs::path(root / "node0") / "step_00000010";
  fs::remove(step10 / rankDataFile(1));
  fs::create_symlink(step10 / rankDataFile(0), step10 / rankDataFile(1));
  EXPECT_FALSE(promoteAndCheck(2, root, 0, root / "checkpoints", 10).has_value());
  EXPECT_FALSE(fs::exists(root / "checkpoints/step_00000010"));
}

TEST(LocalTierTest, AFailedLocalSaveIsReportedOnEveryRankAndTheNextOneWorks) {
  TempDir root;
  test::runOnRanks(4, [&](test::RankContext& ctx) {
    LocalTierOptions options;
    options.dir = root / strCat("node", ctx.rank / 2);
    LocalCheckpointer local(options, ctx.comm());
    if (ctx.rank == 2) testing::writeText(options.dir + "/step_00000005", "a file where the step directory goes");
    ctx.comm()->barrier();
    const LocalSaveStats failed = local.save(requestFor(testing::sampleModel(5), 5, ctx.world, ctx.rank));
    EXPECT_FALSE(failed.saved);
    EXPECT_NE(failed.error.find(ctx.rank / 2 == 1 ? "step_00000005" : "failed on rank 2"), std::string::npos)
        << failed.error;
    const LocalSaveStats next = local.save(requestFor(testing::sampleModel(10), 10, ctx.world, ctx.rank));
    EXPECT_TRUE(next.saved) << next.error;
    EXPECT_GT(next.replicaBytes, 0);
    local.clear();
  });
  EXPECT_FALSE(fs::exists(root / "node0/step_00000010"));
  EXPECT_FALSE(fs::exists(root / "node1/step_00000010"));
}

TEST(LocalTierTest, ADirectoryThatCannotBeMadeIsRefusedOnEveryRank) {
  TempDir root;
  testing::writeText(root / "file", "not a directory");
  const test::MultiRankResult r = test::runRanks(2, [&](test::RankContext& ctx) {
    LocalTierOptions options;
    options.dir = ctx.rank == 1 ? root / "file/local" : root / "fine";
    LocalCheckpointer local(options, ctx.comm());
  });
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.ranks[1].message.find("checkpoint.local.dir '" + root / "file/local" + "': cannot create it"),
            std::string::npos)
      << r.ranks[1].message;
  EXPECT_NE(r.ranks[0].message.find("checkpoint.local.dir failed on rank 1"), std::string::npos) << r.ranks[0].message;
}

TEST(LocalTierTest, ADirectoryAnotherHostAlsoUsesIsRefused) {
  TempDir root;
  // Another host's node mark, as a filesystem the nodes share shows it.
  fs::create_directories(root / "shared");
  testing::writeText(root / "shared/.node-0123456789abcdef", "otherhost:" + root / "shared");
  const test::MultiRankResult r = test::runRanks(2, [&](test::RankContext& ctx) {
    LocalTierOptions options;
    options.dir = root / "shared";
    LocalCheckpointer local(options, ctx.comm());
  });
  ASSERT_FALSE(r.ok());
  for (const auto& rank : r.ranks) {
    EXPECT_NE(rank.message.find("is also the directory of node 'otherhost:" + root / "shared" + "'"), std::string::npos)
        << rank.message;
  }
  // Its own marks are gone once a start passed the check.
  removeTree(root / "shared/.node-0123456789abcdef");
  test::runOnRanks(2, [&](test::RankContext& ctx) {
    LocalTierOptions options;
    options.dir = root / "shared";
    LocalCheckpointer local(options, ctx.comm());
  });
  EXPECT_TRUE(fs::is_empty(root / "shared"));
}

TEST(LocalTierTest, OneNodeHasNoOtherNodeToCopyTo) {
  TempDir root;
  test::runOnRanks(2, [&](test::RankContext& ctx) {
    LocalTierOptions options;
    options.dir = root / "shared";
    LocalCheckpointer local(options, ctx.comm());
    EXPECT_EQ(local.layout().nodes.size(), 1u);
    EXPECT_EQ(local.replicas(), 0);
    EXPECT_TRUE(local.save(requestFor(testing::sampleModel(3), 3, ctx.world, ctx.rank)).saved);
  });
  EXPECT_TRUE(fs::exists(root / "shared/step_00000003/metadata.json"));
}

// Issue "Hostile and mistaken input, round 4", class 1: the tier reads, promotes and
// deletes only the steps it wrote for its owner. Two runs share a directory: each keeps
// its own steps through the other's saves, retention and clearing; a step directory the
// tier did not write (a copied checkpoint) is never touched.
TEST(LocalTierTest, TwoRunsSharingADirectoryLoseNothingOfEachOther) {
  TempDir root;
  saveLocally(1, root, [](int) { return 0; }, {10, 20, 30}, /*replicas=*/0, /*keepLast=*/1, "/runs/a");
  saveLocally(1, root, [](int) { return 0; }, {15, 25}, /*replicas=*/0, /*keepLast=*/1, "/runs/b");
  const fs::path dir = root / "node0";
  EXPECT_TRUE(fs::exists(dir / "step_00000030/metadata.json")) << "b's retention kept a's newest";
  EXPECT_FALSE(fs::exists(dir / "step_00000020")) << "a's own retention";
  EXPECT_TRUE(fs::exists(dir / "step_00000025/metadata.json"));
  // A checkpoint copied in by hand: complete, newer than anything, marked by nobody.
  fs::create_directories(dir / "step_00000040");
  fs::copy(dir / "step_00000030", dir / "step_00000040", fs::copy_options::recursive);
  fs::remove(dir / "step_00000040" / kTierOwnerFile);
  // Run b promotes its own newest (25), not a's 30 nor the unmarked 40.
  const auto promoted = promoteAndCheck(1, root, 0, root / "checkpoints_b", 25, "/runs/b");
  ASSERT_TRUE(promoted.has_value());
  EXPECT_EQ(promoted->step, 25);
  test::runOnRanks(1, [&](test::RankContext& ctx) { clearLocalTier(dir, "/runs/b", ctx.comm().get()); });
  EXPECT_FALSE(fs::exists(dir / "step_00000025"));
  EXPECT_TRUE(fs::exists(dir / "step_00000030/metadata.json")) << "a's step survives b's clearing";
  EXPECT_TRUE(fs::exists(dir / "step_00000040/metadata.json")) << "what the tier did not write is never deleted";
  // A save of a step number another run's directory holds fails without touching it.
  test::runOnRanks(1, [&](test::RankContext& ctx) {
    LocalTierOptions options;
    options.dir = dir;
    options.keepLast = 1;
    options.owner = "/runs/b";
    LocalCheckpointer local(options, ctx.comm());
    const LocalSaveStats stats = local.save(requestFor(testing::sampleModel(30), 30, ctx.world, ctx.rank));
    EXPECT_FALSE(stats.saved);
    EXPECT_NE(stats.error.find("is not this run's (written for '/runs/a')"), std::string::npos) << stats.error;
  });
  EXPECT_TRUE(fs::exists(dir / "step_00000030/metadata.json"));
  const auto a = promoteAndCheck(1, root, 0, root / "checkpoints_a", 30, "/runs/a");
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->step, 30);
}

// Class 1: one flipped byte in the newest local step: its file fails its checksums, so the
// intact step before it is promoted (the damaged one is not copied, and the older one is
// still there because nothing was deleted).
TEST(LocalTierTest, ATamperedFileIsNotPromotedButTheIntactStepBeforeIs) {
  TempDir root;
  saveLocally(2, root, [](int) { return 0; }, {10, 20}, /*replicas=*/0);
  const fs::path file = fs::path(root / "node0") / "step_00000020" / rankDataFile(1);
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(fs::file_size(file) / 2));
    const char byte = static_cast<char>(f.get());
    f.seekp(static_cast<std::streamoff>(fs::file_size(file) / 2));
    f.put(static_cast<char>(byte ^ 0x40));
  }
  const auto promoted = promoteAndCheck(2, root, 0, root / "checkpoints", 10);
  ASSERT_TRUE(promoted.has_value());
  EXPECT_EQ(promoted->step, 10);
  EXPECT_TRUE(fs::exists(fs::path(root / "node0") / "step_00000020")) << "promotion deletes nothing";
}

// Class 1: the tier's directory is never a link (it would delete through it), nor in a
// checkpoints directory or a checkpoint; every rank refuses it before anything is written.
TEST(LocalTierTest, ALinkOrACheckpointsDirectoryIsRefusedAsTheDirectory) {
  TempDir root;
  testing::saveOnRanks(1, root / "run/checkpoints", testing::sampleModel(5), 5);
  fs::create_directories(root / "elsewhere");
  fs::create_directory_symlink(root / "elsewhere", root / "link");
  const auto refused = [&](const std::string& dir, const std::string& says) {
    const test::MultiRankResult r = test::runRanks(2, [&](test::RankContext& ctx) {
      LocalTierOptions options;
      options.dir = dir;
      LocalCheckpointer local(options, ctx.comm());
    });
    ASSERT_FALSE(r.ok()) << dir;
    EXPECT_NE(r.ranks[0].message.find(says), std::string::npos) << r.ranks[0].message;
    EXPECT_THROW(checkLocalTierDirectory(dir, "checkpoint.local.dir"), ConfigError) << dir;
  };
  refused(root / "link", "is a symbolic link");
  refused(root / "run/checkpoints", "is in the checkpoints directory");
  refused(root / "run/checkpoints/local", "is in the checkpoints directory");
  refused(root / "run/checkpoints/step_00000005/local", "is in the checkpoint " + root / "run/checkpoints/step_00000005");
  EXPECT_TRUE(fs::is_empty(root / "elsewhere"));
  EXPECT_EQ(testing::readText(root / "run/checkpoints/latest"), "step_00000005\n");
  EXPECT_NO_THROW(checkLocalTierDirectory(root / "run/local", "checkpoint.local.dir"));
}

}  // namespace
}  // namespace tessera::checkpoint
