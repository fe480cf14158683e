// Sharded save/load: round trips, resharding between every pair of world sizes 1-4 with
// uneven shapes, placement changes, minimal reads, latest/retention/stale-tmp handling,
// and failures on one rank surfacing on all of them.
#include <gtest/gtest.h>

#include <filesystem>

#include "checkpoint/exporter.h"
#include "checkpoint/file_io.h"
#include "checkpoint/metadata.h"
#include "tests/checkpoint/checkpoint_test_util.h"

namespace tessera::checkpoint {
namespace {

using namespace testing;  // NOLINT
namespace fs = std::filesystem;

TEST(CheckpointTest, RoundTripSameWorldSizeIsBitwise) {
  TempDir tmp;
  const auto model = sampleModel();
  saveOnRanks(2, tmp.path(), model, 5);
  EXPECT_EQ(readLatest(tmp.path()), "step_00000005");
  const std::string dir = tmp / "step_00000005";
  for (const char* f : {"metadata.json", "trainer_state.json", "rank_00000.bin", "rank_00001.bin"}) {
    EXPECT_TRUE(fs::exists(fs::path(dir) / f)) << f;
  }
  // Chunk tables are merged into metadata.json and removed; no .tmp left behind.
  EXPECT_FALSE(fs::exists(fs::path(dir) / "rank_00000.json"));
  EXPECT_FALSE(fs::exists(tmp / "step_00000005.tmp"));
  for (int rank = 0; rank < 2; ++rank) {
    auto expected = entriesFor(model, 2, rank);
    auto got = junkEntriesFor(model, 2, rank);
    const LoadResult r = loadCheckpoint(dir, got);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(bitwiseEqual(got[i].local, expected[i].local)) << got[i].name << " rank " << rank;
    }
    EXPECT_EQ(r.step, 5);
    EXPECT_EQ(r.savedWorldSize, 2);
    EXPECT_EQ(r.strategy, "zero3");
    EXPECT_EQ(r.trainerState, "{\"step\":5,\"world_size\":2}");
    ASSERT_EQ(r.rankStates.size(), 2u);
    EXPECT_EQ(r.rankStates[1], "{\"rng\":1001}");
  }
}

TEST(CheckpointTest, ReshardsBetweenAllWorldSizesOneToFour) {
  TempDir tmp;
  const auto model = sampleModel();
  CheckpointOptions options;
  options.blockBytes = 16;  // many blocks per chunk: exercises partial-block reads
  for (int saved = 1; saved <= 4; ++saved) {
    const std::string root = tmp / strCat("w", saved);
    saveOnRanks(saved, root, model, 1, options);
    for (int world = 1; world <= 4; ++world) {
      for (int rank = 0; rank < world; ++rank) {
        auto got = junkEntriesFor(model, world, rank);
        const LoadResult r = loadCheckpoint(root + "/step_00000001", got);
        EXPECT_EQ(r.savedWorldSize, saved);
        for (size_t i = 0; i < got.size(); ++i) {
          const at::Tensor want = got[i].spec.shardOf(model[i].full);  // padding rows zero
          EXPECT_TRUE(bitwiseEqual(got[i].local, want))
              << model[i].name << ": saved on " << saved << ", loaded on rank " << rank << " of " << world;
        }
      }
    }
  }
}

TEST(CheckpointTest, ShardedSaveLoadsReplicatedAndReplicatedLoadsSharded) {
  // zero3 on 4 ranks -> no_shard on 1 (everything replicated), and back to Shard(0) on 3.
  TempDir tmp;
  const auto model = sampleModel();
  saveOnRanks(4, tmp.path(), model, 3);
  auto full = junkEntriesFor(model, 1, 0, /*allReplicated=*/true);
  loadCheckpoint(tmp / "step_00000003", full);
  for (size_t i = 0; i < full.size(); ++i) {
    EXPECT_TRUE(bitwiseEqual(full[i].local.view(model[i].full.sizes()), model[i].full)) << model[i].name;
  }
  // Save that replicated layout on 2 ranks; load it sharded on 3.
  const std::string root2 = tmp / "replicated";
  test::runOnRanks(2, [&](test::RankContext& ctx) {
    std::vector<StateEntry> entries;
    for (const auto& g : model) {
      auto spec = specFor(g, ctx.world, ctx.rank, /*forceReplicate=*/true);
      entries.push_back({g.name, spec, g.full.clone()});
    }
    Checkpointer ckpt(root2, ctx.comm());
    SaveRequest req;
    req.step = 4;
    req.entries = entries;
    ckpt.save(req);
  });
  for (int rank = 0; rank < 3; ++rank) {
    auto got = junkEntriesFor(model, 3, rank);
    loadCheckpoint(root2 + "/step_00000004", got);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(bitwiseEqual(got[i].local, got[i].spec.shardOf(model[i].full))) << model[i].name;
    }
  }
}

TEST(CheckpointTest, ResumeReadsOnlyTheIntersectingBytes) {
  TempDir tmp;
  std::vector<GlobalTensor> model{{"model/big", at::arange(64 * 16, at::kFloat).view({64, 16})}};
  CheckpointOptions options;
  options.blockBytes = 256;  // 4 rows of 64 bytes
  saveSingle(tmp.path(), model, 1, options);
  // Rank 1 of 4 needs rows [16, 32): 1024 bytes, block aligned.
  auto got = junkEntriesFor(model, 4, 1);
  auto r = loadCheckpoint(tmp / "step_00000001", got);
  EXPECT_EQ(r.bytesRead, 16 * 64);
  // Rank 1 of 3 needs rows [22, 44): 1408 bytes; the blocks touched add at most 2 x 256.
  got = junkEntriesFor(model, 3, 1);
  r = loadCheckpoint(tmp / "step_00000001", got);
  EXPECT_GE(r.bytesRead, 22 * 64);
  EXPECT_LE(r.bytesRead, 22 * 64 + 2 * 256);
  EXPECT_TRUE(bitwiseEqual(got[0].local, got[0].spec.shardOf(model[0].full)));
}

// Chunks of several MiB, rows of an odd size: a read crosses several 1 MiB reads (blocks
// of 96 KiB, ten to a read, and a block size that does not divide 1 MiB) or reads one
// block larger than 1 MiB at a time (1.5 MiB), verified and not, on 1 to 4 ranks.
TEST(CheckpointTest, LargeChunksLoadOnEveryWorldSizeWithLargeAndSmallBlocks) {
  TempDir tmp;
  std::vector<GlobalTensor> model{
      {"model/big", (at::arange(5003 * 193, at::kFloat) * 0.001).sin().view({5003, 193})}};  // 772-byte rows
  const int64_t rowBytes = 193 * 4;
  for (const int64_t blockBytes : {int64_t{96} << 10, int64_t{3} << 19}) {
    CheckpointOptions options;
    options.blockBytes = blockBytes;
    const std::string root = tmp / strCat("b", blockBytes);
    saveOnRanks(2, root, model, 1, options);  // chunks of 2502 and 2501 rows (~1.9 MiB)
    for (int world = 1; world <= 4; ++world) {
      for (int rank = 0; rank < world; ++rank) {
        for (const bool verify : {true, false}) {
          auto got = junkEntriesFor(model, world, rank);
          LoadOptions load;
          load.verify = verify;
          const LoadResult r = loadCheckpoint(root + "/step_00000001", got, load);
          const std::string where = strCat("block ", blockBytes, ", rank ", rank, " of ", world, ", verify ", verify);
          EXPECT_TRUE(bitwiseEqual(got[0].local, got[0].spec.shardOf(model[0].full))) << where;
          auto [rb, re] = got[0].spec.localRowRange();
          const int64_t needed = (re - rb) * rowBytes;
          EXPECT_GE(r.bytesRead, needed) << where;
          // At most the rest of one block at each end of each of the 2 chunks read.
          EXPECT_LE(r.bytesRead, needed + (verify ? 2 * 2 * blockBytes : 0)) << where;
        }
      }
    }
  }
}

// A state whose metadata.json would be larger than maxMetadataBytes is saved with a
// larger checksum block size (doubled until it fits), recorded in metadata.json and in
// SaveStats, and loads resharded as any other.
TEST(CheckpointTest, BlockSizeGrowsSoThatMetadataStaysUnderItsBudget) {
  const int64_t MiB = int64_t{1} << 20, TiB = int64_t{1} << 40;
  EXPECT_EQ(checksumBlockBytes(MiB, 128 * MiB, TiB, 100), MiB);           // ~30 MB of metadata
  EXPECT_EQ(checksumBlockBytes(MiB, 128 * MiB, 10 * TiB, 100), 4 * MiB);  // 2 MiB: ~147 MB
  EXPECT_EQ(checksumBlockBytes(MiB, 1, int64_t{1} << 62, 1), kMaxBlockBytes);  // at most the largest
  // Chunks alone over the budget: doubling stops once it no longer helps.
  EXPECT_EQ(checksumBlockBytes(64, 1000, 64, 100), 128);
  EXPECT_GT(estimateMetadataBytes(kMaxBlockBytes, 0, 2 << 20), kMaxJsonBytes);  // 2M chunks: refused

  TempDir tmp;
  std::vector<GlobalTensor> model{{"model/w", at::arange(256 * 64, at::kFloat).view({256, 64})}};  // 64 KiB
  CheckpointOptions options;
  options.blockBytes = 64;
  // 1024-byte blocks: 28 x (64 + 2) + 256 x 2 + 64 KiB = 67,896 bytes; 512-byte: 69,688.
  options.maxMetadataBytes = 68000;
  EXPECT_EQ(saveSingle(tmp / "one", model, 1, options).blockBytes, 1024);
  saveOnRanks(2, tmp / "two", model, 1, options);
  const CheckpointMetadata md = CheckpointReader(tmp / "two/step_00000001").metadata();
  EXPECT_EQ(md.blockBytes, 1024);
  size_t checksums = 0;
  for (const auto& c : md.tensors.at(0).chunks) checksums += c.checksums.size();
  EXPECT_EQ(checksums, 64u);
  for (int rank = 0; rank < 3; ++rank) {
    auto got = junkEntriesFor(model, 3, rank);
    loadCheckpoint(tmp / "two/step_00000001", got);
    EXPECT_TRUE(bitwiseEqual(got[0].local, got[0].spec.shardOf(model[0].full))) << "rank " << rank << " of 3";
  }
}

TEST(CheckpointTest, KeepLastDeletesOnlyOlderCheckpoints) {
  TempDir tmp;
  const auto model = sampleModel();
  CheckpointOptions options;
  options.keepLast = 2;
  test::runOnRanks(2, [&](test::RankContext& ctx) {
    Checkpointer ckpt(tmp.path(), ctx.comm(), options);
    for (int64_t step = 10; step <= 40; step += 10) {
      SaveRequest req;
      req.step = step;
      req.entries = entriesFor(sampleModel(step), ctx.world, ctx.rank);
      ckpt.save(req);
    }
  });
  const auto list = listCheckpoints(tmp.path());
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].step, 30);
  EXPECT_EQ(list[1].step, 40);
  EXPECT_EQ(readLatest(tmp.path()), "step_00000040");
  for (const auto& e : fs::directory_iterator(tmp.path())) {
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  }
  auto got = junkEntriesFor(model, 1, 0);
  loadCheckpoint(list[0].dir, got);
  EXPECT_TRUE(bitwiseEqual(got[0].local, sampleModel(30)[0].full));
}

TEST(CheckpointTest, StaleTmpAndIncompleteDirectoriesAreIgnoredThenCleaned) {
  TempDir tmp;
  const auto model = sampleModel();
  saveSingle(tmp.path(), model, 1);
  // Debris of crashed saves: a .tmp with data, and a step dir without metadata.
  fs::create_directories(tmp / "step_00000002.tmp");
  writeText(tmp / "step_00000002.tmp/rank_00000.bin", "junk");
  fs::create_directories(tmp / "step_00000003");
  writeText(tmp / "step_00000003/rank_00000.bin", "junk");
  const auto list = listCheckpoints(tmp.path());
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].step, 1);
  EXPECT_THROW(CheckpointReader(tmp / "step_00000003"), CheckpointError);
  auto got = junkEntriesFor(model, 1, 0);
  auto r = resumeAuto(tmp.path(), got, nullptr);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, 1);
  saveSingle(tmp.path(), model, 4);
  EXPECT_FALSE(fs::exists(tmp / "step_00000002.tmp"));
}

TEST(CheckpointTest, SavingAnExistingStepReplacesIt) {
  TempDir tmp;
  saveSingle(tmp.path(), sampleModel(1), 7);
  saveSingle(tmp.path(), sampleModel(2), 7);
  const auto model = sampleModel(2);
  auto got = junkEntriesFor(model, 1, 0);
  loadCheckpoint(tmp / "step_00000007", got);
  EXPECT_TRUE(bitwiseEqual(got[0].local, model[0].full));
  EXPECT_EQ(listCheckpoints(tmp.path()).size(), 1u);
  EXPECT_FALSE(fs::exists(tmp / "step_00000007.replaced.tmp"));
}

TEST(CheckpointTest, ResumeAutoWithoutCheckpointsStartsFresh) {
  TempDir tmp;
  auto got = junkEntriesFor(sampleModel(), 1, 0);
  EXPECT_FALSE(resumeAuto(tmp / "nothing_here", got, nullptr).has_value());
}

TEST(CheckpointTest, AFailureOnOneRankFailsTheSaveOnEveryRankAndKeepsThePrevious) {
  TempDir tmp;
  const auto model = sampleModel();
  CheckpointOptions options;
  options.commitTimeout = std::chrono::seconds(10);
  std::atomic<bool> fail{false};
  options.faultHook = [&fail](SavePoint p, int rank) {
    if (fail && p == SavePoint::kAfterData && rank == 1) throw Error("injected disk failure on rank 1");
  };
  std::vector<std::string> messages(3);
  test::runOnRanks(3, [&](test::RankContext& ctx) {
    Checkpointer ckpt(tmp.path(), ctx.comm(), options);
    SaveRequest req;
    req.step = 1;
    req.entries = entriesFor(model, ctx.world, ctx.rank);
    ckpt.save(req);
    ctx.comm()->barrier();
    if (ctx.rank == 0) fail = true;
    ctx.comm()->barrier();
    req.step = 2;
    try {
      ckpt.save(req);
      ADD_FAILURE() << "save of step 2 did not throw on rank " << ctx.rank;
    } catch (const Error& e) {
      messages[static_cast<size_t>(ctx.rank)] = e.what();
    }
    ctx.comm()->barrier();
    if (ctx.rank == 0) fail = false;
    ctx.comm()->barrier();
    req.step = 3;
    ckpt.save(req);  // the checkpointer is usable again
  });
  EXPECT_NE(messages[1].find("injected disk failure on rank 1"), std::string::npos) << messages[1];
  EXPECT_NE(messages[0].find("rank 1"), std::string::npos) << messages[0];
  EXPECT_NE(messages[2].find("rank"), std::string::npos) << messages[2];
  const auto list = listCheckpoints(tmp.path());
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].step, 1);
  EXPECT_EQ(list[1].step, 3);
  EXPECT_FALSE(fs::exists(tmp / "step_00000002.tmp"));  // cleaned by the save of step 3
}

TEST(CheckpointTest, RanksSavingDifferentEntriesIsAnError) {
  TempDir tmp;
  const auto model = sampleModel();
  std::vector<std::string> messages(2);
  test::runOnRanks(2, [&](test::RankContext& ctx) {
    Checkpointer ckpt(tmp.path(), ctx.comm());
    SaveRequest req;
    req.step = 1;
    req.entries = entriesFor(model, ctx.world, ctx.rank);
    if (ctx.rank == 1) req.entries.pop_back();
    try {
      ckpt.save(req);
    } catch (const Error& e) {
      messages[static_cast<size_t>(ctx.rank)] = e.what();
    }
  });
  EXPECT_NE(messages[0].find("every rank must save the same entries"), std::string::npos) << messages[0];
  EXPECT_FALSE(messages[1].empty());
  EXPECT_TRUE(listCheckpoints(tmp.path()).empty());
}

TEST(CheckpointTest, InvalidRequestsAreRejected) {
  TempDir tmp;
  Checkpointer ckpt(tmp.path(), nullptr);
  SaveRequest req;
  req.entries = entriesFor(sampleModel(), 1, 0);
  req.trainerState = "[1, 2]";
  EXPECT_THROW(ckpt.save(req), CheckpointError);  // trainer state must be an object
  req.trainerState = "{}";
  req.entries.push_back(req.entries[0]);
  EXPECT_THROW(ckpt.save(req), Error);  // duplicate name
  req.entries = entriesFor(sampleModel(), 2, 1);
  EXPECT_THROW(ckpt.save(req), Error);  // spec of another world size
}

}  // namespace
}  // namespace tessera::checkpoint

namespace tessera::checkpoint {
namespace {

// A component with its own kind, two named parts and export names.
class TwoPartState final : public Stateful {
 public:
  std::vector<StateEntry> stateEntries() override {
    return {{"left/w", dtensor::ShardSpec({4, 2}, at::kFloat, 1, 0), left_},
            {"right/w", dtensor::ShardSpec({3}, at::kFloat, 1, 0), right_}};
  }
  std::string componentKind() const override { return "pair"; }
  std::map<std::string, std::string> componentParts() const override { return {{"l", "left/"}, {"r", "right/"}}; }
  std::map<std::string, std::string> exportNames() const override { return {{"", ""}, {"lefty", "left/"}}; }

 private:
  at::Tensor left_ = at::ones({4, 2}), right_ = at::zeros({3});
};

// metadata.json's component table is written by the components: each one's key, kind,
// parts and export names as whole tensor-name prefixes, and the key it serves; export by
// name reads it (a key names its own tensors).
TEST(CheckpointTest, TheComponentTableIsWrittenByTheComponents) {
  TempDir tmp;
  TwoPartState pair;
  Counters counters;
  counters["step"] = 7;
  {
    Checkpointer ckpt(tmp.path(), nullptr);
    ckpt.save(3, {{"pair", pair}, {"count", counters, "pair"}});
    ckpt.finish();
  }
  const CheckpointMetadata md = CheckpointReader(tmp / "step_00000003").metadata();
  EXPECT_EQ(md.version, kFormatVersion);
  ASSERT_EQ(md.components.size(), 2u);
  const ComponentRecord& p = md.components[0];
  EXPECT_EQ(p.key, "pair");
  EXPECT_EQ(p.kind, "pair");
  EXPECT_EQ(p.of, "");
  EXPECT_EQ(p.parts, (std::map<std::string, std::string>{{"l", "pair/left/"}, {"r", "pair/right/"}}));
  EXPECT_EQ(p.exports, (std::map<std::string, std::string>{{"pair", "pair/"}, {"lefty", "pair/left/"}}));
  const ComponentRecord& c = md.components[1];
  EXPECT_EQ(c.key, "count");
  EXPECT_EQ(c.kind, "counters");
  EXPECT_EQ(c.of, "pair");
  EXPECT_TRUE(c.parts.empty());
  EXPECT_EQ(resolveExportPrefix(md, "lefty"), "pair/left/");
  EXPECT_EQ(resolveExportPrefix(md, "pair"), "pair/");
  EXPECT_EQ(resolveExportPrefix(md, "count"), "count/");  // a key names its own tensors
  EXPECT_THROW(resolveExportPrefix(md, "righty"), CheckpointError);
}

}  // namespace
}  // namespace tessera::checkpoint
