// Async saves: staging decouples the saved values from training, a writer failure (an
// injected fault, or a real ENOSPC) surfaces at the next save or finish() on every rank,
// at most one save is in flight, and the stall is measured.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>

#include <filesystem>
#include <fstream>
#include <thread>

#include "checkpoint/metadata.h"
#include "tests/checkpoint/checkpoint_test_util.h"

namespace tessera::checkpoint {
namespace {

using namespace testing;  // NOLINT
namespace fs = std::filesystem;

// Resident set size of this process now, in bytes (/proc/self/statm's second field).
int64_t residentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t sizePages = 0, residentPages = 0;
  statm >> sizePages >> residentPages;
  return residentPages * ::sysconf(_SC_PAGESIZE);
}

TEST(AsyncSaveTest, SavesTheValuesAtSaveTimeWhileTrainingGoesOn) {
  TempDir tmp;
  const auto model = sampleModel();
  CheckpointOptions options;
  options.async = true;
  test::runOnRanks(2, [&](test::RankContext& ctx) {
    Checkpointer ckpt(tmp.path(), ctx.comm(), options);
    SaveRequest req;
    req.step = 1;
    req.entries = entriesFor(model, ctx.world, ctx.rank);
    const SaveStats stats = ckpt.save(req);
    EXPECT_TRUE(stats.async);
    EXPECT_GE(stats.stallSeconds, stats.stagingSeconds);
    // "Training" overwrites the live tensors at once; the checkpoint must not see it.
    for (auto& e : req.entries) e.local.fill_(e.local.is_floating_point() ? -1.0 : -1);
    ckpt.finish();
  });
  for (int rank = 0; rank < 3; ++rank) {
    auto got = junkEntriesFor(model, 3, rank);
    loadCheckpoint(tmp / "step_00000001", got);
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(bitwiseEqual(got[i].local, got[i].spec.shardOf(model[i].full)));
  }
}

TEST(AsyncSaveTest, WriterFailureSurfacesAtTheNextSaveOnEveryRank) {
  TempDir tmp;
  const auto model = sampleModel();
  CheckpointOptions options;
  options.async = true;
  options.commitTimeout = std::chrono::seconds(10);
  options.faultHook = [](SavePoint p, int rank) {
    if (p == SavePoint::kAfterData && rank == 1) throw Error("injected writer failure");
  };
  std::vector<std::string> messages(2);
  test::runOnRanks(2, [&](test::RankContext& ctx) {
    Checkpointer ckpt(tmp.path(), ctx.comm(), options);
    SaveRequest req;
    req.step = 1;
    req.entries = entriesFor(model, ctx.world, ctx.rank);
    EXPECT_NO_THROW(ckpt.save(req));  // returns after staging
    req.step = 2;
    try {
      ckpt.save(req);
      ADD_FAILURE() << "the failure of step 1 was not reported on rank " << ctx.rank;
    } catch (const Error& e) {
      messages[static_cast<size_t>(ctx.rank)] = e.what();
    }
  });
  EXPECT_NE(messages[1].find("injected writer failure"), std::string::npos) << messages[1];
  EXPECT_NE(messages[0].find("previous save (step 1)"), std::string::npos) << messages[0];
  EXPECT_TRUE(listCheckpoints(tmp.path()).empty());
  EXPECT_EQ(readLatest(tmp.path()), "");
}

// A real write error (not an injected one) in the background writer surfaces at
// finish(). The file size limit stands in for a full disk: writes past it fail with EFBIG
// (SIGXFSZ ignored). Not /dev/full behind a link: the writer never writes through a link.
TEST(AsyncSaveTest, RealWriteErrorSurfacesAtFinish) {
  TempDir tmp;
  const auto model = sampleModel();
  CheckpointOptions options;
  options.async = true;
  struct rlimit saved {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  const auto previousHandler = std::signal(SIGXFSZ, SIG_IGN);
  options.faultHook = [&](SavePoint p, int) {
    if (p != SavePoint::kBeforeData) return;
    struct rlimit small = saved;
    small.rlim_cur = 64;
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  };
  Checkpointer ckpt(tmp.path(), nullptr, options);
  SaveRequest req;
  req.step = 1;
  req.entries = entriesFor(model, 1, 0);
  ckpt.save(req);
  std::string error;
  try {
    ckpt.finish();
  } catch (const Error& e) {
    error = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, previousHandler);
  EXPECT_NE(error.find("File too large"), std::string::npos) << "finish() said: '" << error << "'";
  EXPECT_NE(error.find("rank_00000.bin"), std::string::npos) << error;
  EXPECT_TRUE(listCheckpoints(tmp.path()).empty());
}

TEST(AsyncSaveTest, AtMostOneSaveInFlight) {
  TempDir tmp;
  const auto model = sampleModel();
  CheckpointOptions options;
  options.async = true;
  std::atomic<int> active{0}, maxActive{0};
  options.faultHook = [&](SavePoint p, int) {
    if (p == SavePoint::kBeforeData) {
      maxActive = std::max(maxActive.load(), ++active);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    } else if (p == SavePoint::kBeforeRetention) {
      --active;
    }
  };
  Checkpointer ckpt(tmp.path(), nullptr, options);
  SaveRequest req;
  req.entries = entriesFor(model, 1, 0);
  req.step = 1;
  ckpt.save(req);
  req.step = 2;
  const SaveStats second = ckpt.save(req);
  EXPECT_GE(second.waitSeconds, 0.1);  // waited for step 1's writer
  EXPECT_GE(second.stallSeconds, second.waitSeconds);
  ckpt.finish();
  EXPECT_EQ(maxActive.load(), 1);
  EXPECT_EQ(listCheckpoints(tmp.path()).size(), 2u);
  EXPECT_EQ(readLatest(tmp.path()), "step_00000002");
}

// A writer starts only once every rank has staged (a writer hashing beside a copy still
// running slows it when ranks share cores): rank 1 is slow to stage; rank 0's writer
// reaches its data file only after rank 1's copy began, although rank 0's own save()
// returned long before.
TEST(AsyncSaveTest, WritersStartOnceEveryRankHasStaged) {
  TempDir tmp;
  const auto model = sampleModel();
  CheckpointOptions options;
  options.async = true;
  using Clock = std::chrono::steady_clock;
  std::atomic<int64_t> rank1StagedAt{0}, rank0WriterAt{0};
  const auto now = [] { return Clock::now().time_since_epoch().count(); };
  options.faultHook = [&](SavePoint p, int rank) {
    if (p == SavePoint::kStaging && rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      rank1StagedAt = now();  // its copy starts now
    } else if (p == SavePoint::kBeforeData && rank == 0) {
      rank0WriterAt = now();
    }
  };
  test::runOnRanks(2, [&](test::RankContext& ctx) {
    Checkpointer ckpt(tmp.path(), ctx.comm(), options);
    SaveRequest req;
    req.step = 1;
    req.entries = entriesFor(model, ctx.world, ctx.rank);
    ckpt.save(req);
    ckpt.finish();
  });
  ASSERT_GT(rank1StagedAt.load(), 0);
  ASSERT_GT(rank0WriterAt.load(), 0);
  EXPECT_GT(rank0WriterAt.load(), rank1StagedAt.load()) << "rank 0's writer started before rank 1 had staged";
  EXPECT_EQ(readLatest(tmp.path()), "step_00000001");
}

TEST(AsyncSaveTest, DestructorWaitsForTheWriter) {
  TempDir tmp;
  const auto model = sampleModel();
  {
    CheckpointOptions options;
    options.async = true;
    options.faultHook = [](SavePoint p, int) {
      if (p == SavePoint::kBeforeData) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    };
    Checkpointer ckpt(tmp.path(), nullptr, options);
    SaveRequest req;
    req.step = 9;
    req.entries = entriesFor(model, 1, 0);
    ckpt.save(req);
  }
  EXPECT_EQ(readLatest(tmp.path()), "step_00000009");
}

TEST(AsyncSaveTest, StagingBuffersAreAllocatedOnceAndReused) {
  TempDir tmp;
  // 24 MiB of state: a staging copy allocated per save (or leaked) would show in the RSS.
  GlobalTensor big{"model/big", at::randint(0, 1000, {1536, 4096}).to(at::kFloat)};  // integers: exact sums
  CheckpointOptions options;
  options.async = true;
  options.keepLast = 1;
  Checkpointer ckpt(tmp.path(), nullptr, options);
  SaveRequest req;
  req.entries = {{big.name, specFor(big, 1, 0), big.full.clone()}};
  req.step = 1;
  EXPECT_EQ(ckpt.save(req).stagingAllocatedBytes, big.full.nbytes());
  ckpt.finish();
  const int64_t before = residentBytes();
  for (int64_t step = 2; step <= 11; ++step) {
    req.entries[0].local.add_(1.0);  // "training" between saves
    req.step = step;
    EXPECT_EQ(ckpt.save(req).stagingAllocatedBytes, 0) << "step " << step;
  }
  ckpt.finish();
  const int64_t growth = residentBytes() - before;
  EXPECT_LT(growth, int64_t{8} << 20) << "RSS grew by " << growth << " bytes over 10 saves of 24 MiB";
  // The reused buffers held each save's values: the last checkpoint has the last ones.
  auto got = std::vector<StateEntry>{{big.name, specFor(big, 1, 0), at::zeros_like(big.full)}};
  loadCheckpoint(tmp / "step_00000011", got);
  EXPECT_TRUE(bitwiseEqual(got[0].local, big.full + 10.0));
}

// A rank whose staging copy fails (here: an injected throw; for real, pinned memory that
// cannot be allocated) fails the save on every rank — sync: in save(), async: at
// finish() like a writer failure — at once rather than after the commit timeout.
class StagingFailureTest : public ::testing::TestWithParam<bool> {};

TEST_P(StagingFailureTest, FailsTheSaveOnEveryRankWithoutWaitingForTheTimeout) {
  TempDir tmp;
  const auto model = sampleModel();
  CheckpointOptions options;
  options.async = GetParam();
  options.commitTimeout = std::chrono::seconds(60);
  options.faultHook = [](SavePoint p, int rank) {
    if (p == SavePoint::kStaging && rank == 1) throw Error("injected staging failure");
  };
  std::vector<std::string> messages(2);
  const auto start = std::chrono::steady_clock::now();
  test::runOnRanks(2, [&](test::RankContext& ctx) {
    Checkpointer ckpt(tmp.path(), ctx.comm(), options);
    SaveRequest req;
    req.step = 1;
    req.entries = entriesFor(model, ctx.world, ctx.rank);
    try {
      ckpt.save(req);
      ckpt.finish();  // async: the failure arrives here on the ranks whose save() returned
      ADD_FAILURE() << "rank " << ctx.rank << " did not see the failed staging";
    } catch (const Error& e) {
      messages[static_cast<size_t>(ctx.rank)] = e.what();
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 30.0);
  EXPECT_NE(messages[1].find("injected staging failure"), std::string::npos) << messages[1];
  EXPECT_NE(messages[0].find("rank 1"), std::string::npos) << messages[0];
  EXPECT_TRUE(listCheckpoints(tmp.path()).empty());
  EXPECT_EQ(readLatest(tmp.path()), "");
}

INSTANTIATE_TEST_SUITE_P(SyncAndAsync, StagingFailureTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "Async" : "Sync"; });

}  // namespace
}  // namespace tessera::checkpoint
