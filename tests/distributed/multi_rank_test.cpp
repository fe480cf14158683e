// The multi-rank harness itself: it reports the failing rank and its message, captures
// GoogleTest failures of forked ranks, and fails (never hangs) on a rank that hangs or
// dies.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "common/errors.h"
#include "tests/support/multi_rank.h"

namespace tessera::test {
namespace {

using Clock = std::chrono::steady_clock;

class MultiRankHarnessTest : public ::testing::TestWithParam<HarnessMode> {
 protected:
  HarnessOptions options(std::chrono::milliseconds timeout = std::chrono::seconds(30)) const {
    HarnessOptions o;
    o.mode = GetParam();
    o.timeout = timeout;
    o.commTimeout = std::chrono::seconds(1);
    return o;
  }
};

TEST_P(MultiRankHarnessTest, AllRanksRunWithTheirOwnRank) {
  std::atomic<int> sum{0};
  const auto result = runRanks(4, [&sum](RankContext& ctx) {
    EXPECT_EQ(ctx.world, 4);
    ctx.store->set("rank/" + std::to_string(ctx.rank), "x");
    ctx.store->wait({"rank/0", "rank/1", "rank/2", "rank/3"}, std::chrono::seconds(10));
    sum += ctx.rank;
  }, options());
  EXPECT_TRUE(result.ok()) << result.summary(GetParam());
  EXPECT_EQ(result.firstFailure(), nullptr);
  if (GetParam() == HarnessMode::kThreads) {
    EXPECT_EQ(sum.load(), 6);  // processes have their own copy
  }
}

TEST_P(MultiRankHarnessTest, ExceptionNamesTheRank) {
  const auto result = runRanks(3, [](RankContext& ctx) {
    if (ctx.rank == 2) throw Error("boom on purpose");
  }, options());
  ASSERT_FALSE(result.ok());
  ASSERT_NE(result.firstFailure(), nullptr);
  EXPECT_EQ(result.firstFailure()->rank, 2);
  EXPECT_NE(result.firstFailure()->message.find("tessera::Error: boom on purpose"), std::string::npos)
      << result.firstFailure()->message;
  EXPECT_TRUE(result.ranks[0].ok);
  EXPECT_TRUE(result.ranks[1].ok);
  try {
    runOnRanks(3, [](RankContext& ctx) {
      if (ctx.rank == 1) throw std::runtime_error("bad rank");
    }, options());
    ADD_FAILURE() << "runOnRanks did not throw";
  } catch (const RankFailure& e) {
    EXPECT_EQ(e.rank(), 1);
    EXPECT_NE(std::string(e.what()).find("rank 1 of 3"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bad rank"), std::string::npos) << e.what();
  }
}

TEST_P(MultiRankHarnessTest, FirstFailureInTimeIsReported) {
  // Rank 0 fails at once; rank 3 fails later "because of it".
  const auto result = runRanks(4, [](RankContext& ctx) {
    if (ctx.rank == 0) throw Error("root cause");
    if (ctx.rank == 3) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      throw Error("consequence");
    }
  }, options());
  ASSERT_NE(result.firstFailure(), nullptr);
  EXPECT_EQ(result.firstFailure()->rank, 0);
  EXPECT_NE(result.summary(GetParam()).find("then rank 3: tessera::Error: consequence"), std::string::npos)
      << result.summary(GetParam());
}

TEST_P(MultiRankHarnessTest, HangingRankFailsInsteadOfHanging) {
  const auto start = Clock::now();
  const auto result = runRanks(2, [](RankContext& ctx) {
    if (ctx.rank != 1) return;
    // Processes: blocked for good (the harness kills it). Threads cannot be killed, so
    // the body watches cancelled(), as a collective's timeout would end it.
    const auto until = Clock::now() + std::chrono::seconds(20);
    while (Clock::now() < until && !ctx.cancelled()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }, options(std::chrono::milliseconds(800)));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_LT(seconds, 5.0);
  ASSERT_FALSE(result.ok());
  EXPECT_TRUE(result.ranks[0].ok);
  EXPECT_TRUE(result.ranks[1].timedOut);
  EXPECT_NE(result.ranks[1].message.find("still running after the harness timeout of 800 ms"), std::string::npos)
      << result.ranks[1].message;
}

INSTANTIATE_TEST_SUITE_P(Modes, MultiRankHarnessTest,
                         ::testing::Values(HarnessMode::kThreads, HarnessMode::kProcesses),
                         [](const ::testing::TestParamInfo<HarnessMode>& info) {
                           return std::string(info.param == HarnessMode::kThreads ? "Threads" : "Processes");
                         });

TEST(MultiRankHarnessProcessTest, GtestFailureInAChildIsReportedWithItsRank) {
  HarnessOptions options;
  options.mode = HarnessMode::kProcesses;
  // In a forked rank the failure is recorded in the child's copy of GoogleTest: the
  // harness must carry it to the parent (here, without failing this test).
  const auto result = runRanks(2, [](RankContext& ctx) {
    if (ctx.rank == 1) {
      EXPECT_EQ(1 + 1, 3) << "arithmetic on rank 1";
    }
  }, options);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.firstFailure()->rank, 1);
  EXPECT_NE(result.firstFailure()->message.find("arithmetic on rank 1"), std::string::npos)
      << result.firstFailure()->message;
  EXPECT_NE(result.firstFailure()->message.find("multi_rank_test.cpp"), std::string::npos)
      << result.firstFailure()->message;
}

TEST(MultiRankHarnessProcessTest, CrashingRankIsReported) {
  HarnessOptions options;
  options.mode = HarnessMode::kProcesses;
  const auto result = runRanks(2, [](RankContext& ctx) {
    if (ctx.rank == 0) ::raise(SIGKILL);
    if (ctx.rank == 1) std::_Exit(7);
  }, options);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.ranks[0].message.find("killed by signal 9"), std::string::npos) << result.ranks[0].message;
  EXPECT_NE(result.ranks[1].message.find("exited with status 7"), std::string::npos) << result.ranks[1].message;
}

}  // namespace
}  // namespace tessera::test
