// Crash safety of the commit protocol: a save killed (SIGKILL) at each point of the
// protocol leaves the previous checkpoint loadable and the partial one ignored; a
// checkpoint whose rename happened before the kill is complete and is the one resumed.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>

#include "checkpoint/metadata.h"
#include "tests/checkpoint/checkpoint_test_util.h"

namespace tessera::checkpoint {
namespace {

using namespace testing;  // NOLINT
namespace fs = std::filesystem;

struct CrashCase {
  SavePoint point;
  bool newIsComplete;  // the killed save had already renamed step_2 into place
};

class SaveKilledTest : public ::testing::TestWithParam<CrashCase> {};

TEST_P(SaveKilledTest, PreviousCheckpointSurvivesAndPartialIsIgnored) {
  const CrashCase c = GetParam();
  TempDir tmp;
  const auto oldModel = sampleModel(1);
  const auto newModel = sampleModel(2);
  saveSingle(tmp.path(), oldModel, 1);

  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Child: save step 2 and die at the chosen point, as a preempted job would.
    try {
      CheckpointOptions options;
      options.blockBytes = 64;
      options.faultHook = [&c](SavePoint p, int) {
        if (p == c.point) ::raise(SIGKILL);
      };
      saveSingle(tmp.path(), newModel, 2, options);
    } catch (...) {
    }
    ::_exit(3);  // not reached when the hook fired
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;

  const auto list = listCheckpoints(tmp.path());
  ASSERT_EQ(list.size(), c.newIsComplete ? 2u : 1u);
  EXPECT_EQ(list[0].step, 1);
  // `latest` moves only after the rename, so it never names an incomplete checkpoint.
  const std::string latest = readLatest(tmp.path());
  EXPECT_TRUE(latest == "step_00000001" || (c.newIsComplete && latest == "step_00000002")) << latest;
  if (!c.newIsComplete) {
    EXPECT_THROW(CheckpointReader(tmp / "step_00000002"), CheckpointError);
  }

  auto got = junkEntriesFor(oldModel, 1, 0);
  auto r = resumeAuto(tmp.path(), got, nullptr);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->step, c.newIsComplete ? 2 : 1);
  const auto& want = c.newIsComplete ? newModel : oldModel;
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(bitwiseEqual(got[i].local, got[i].spec.shardOf(want[i].full)));
  // The previous checkpoint is intact in every case.
  auto old = junkEntriesFor(oldModel, 1, 0);
  loadCheckpoint(tmp / "step_00000001", old);
  EXPECT_TRUE(bitwiseEqual(old[0].local, oldModel[0].full));

  // The next save cleans the debris and commits normally.
  saveSingle(tmp.path(), newModel, 3);
  for (const auto& e : fs::directory_iterator(tmp.path())) {
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  }
  EXPECT_EQ(readLatest(tmp.path()), "step_00000003");
}

INSTANTIATE_TEST_SUITE_P(AllPoints, SaveKilledTest,
                         ::testing::Values(CrashCase{SavePoint::kBeforeData, false}, CrashCase{SavePoint::kAfterData, false},
                                           CrashCase{SavePoint::kAfterRankIndex, false},
                                           CrashCase{SavePoint::kBeforeMetadata, false},
                                           CrashCase{SavePoint::kBeforeRename, false},
                                           CrashCase{SavePoint::kBeforeLatest, true},
                                           CrashCase{SavePoint::kBeforeRetention, true}),
                         [](const ::testing::TestParamInfo<CrashCase>& info) {
                           std::string name = savePointName(info.param.point);
                           for (auto& ch : name) {
                             if (ch == '-') ch = '_';
                           }
                           return name;
                         });

TEST(SaveKilledTest, RankKilledWhileWritingFailsTheSaveOnTheOthers) {
  // Ranks as processes: rank 1 is SIGKILLed after writing its data, before publishing its
  // chunk table. Rank 0 gives up after the commit timeout; step 2 never becomes complete.
  TempDir tmp;
  const auto model = sampleModel();
  saveOnRanks(2, tmp.path(), model, 1);
  test::HarnessOptions h;
  h.mode = test::HarnessMode::kProcesses;
  h.timeout = std::chrono::seconds(40);
  h.commTimeout = std::chrono::seconds(5);
  const auto result = test::runRanks(2, [&](test::RankContext& ctx) {
    CheckpointOptions options;
    options.commitTimeout = std::chrono::seconds(1);
    options.faultHook = [](SavePoint p, int rank) {
      if (p == SavePoint::kAfterData && rank == 1) ::raise(SIGKILL);
    };
    Checkpointer ckpt(tmp.path(), ctx.comm(), options);
    SaveRequest req;
    req.step = 2;
    req.entries = entriesFor(model, ctx.world, ctx.rank);
    ckpt.save(req);
  }, h);
  ASSERT_FALSE(result.ok());
  EXPECT_FALSE(result.ranks[0].ok);
  // Rank 0's writer times out waiting for rank 1's chunk table (its log says so); what
  // it throws may be that, or the all-reduce with the dead rank failing first.
  const auto list = listCheckpoints(tmp.path());
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].step, 1);
  EXPECT_EQ(readLatest(tmp.path()), "step_00000001");
}

}  // namespace
}  // namespace tessera::checkpoint
