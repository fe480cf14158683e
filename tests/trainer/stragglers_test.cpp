// findStraggler: the rank busy longest is the slowest, compared with the median of the
// others; slow only above the ratio and by at least 1 ms and 5% of the step; one rank has
// no straggler.
#include <gtest/gtest.h>

#include "trainer/stragglers.h"

namespace tessera::trainer {
namespace {

TEST(StragglersTest, TheRankBusyLongestIsNamedAgainstTheOthersMedian) {
  // Rank 2 computes 80 ms a step, the others about 45 and wait for it.
  const StragglerReport r = findStraggler({{45, 36}, {44, 37}, {80, 1}, {46, 35}}, 1.3, 81);
  EXPECT_EQ(r.slowestRank, 2);
  EXPECT_DOUBLE_EQ(r.busyMs, 80);
  EXPECT_DOUBLE_EQ(r.othersBusyMs, 45);
  EXPECT_DOUBLE_EQ(r.lagMs, 35);
  EXPECT_DOUBLE_EQ(r.othersWaitMs, 36);
  EXPECT_TRUE(r.slow);
  EXPECT_EQ(describeStraggler(r),
            "rank 2 is slow: 35 ms per step behind the others (busy 80 ms per step, the others' median 45 ms; they "
            "wait for it in collectives, 36 ms per step)");
}

TEST(StragglersTest, EvenRanksAndSmallLagsAreNotSlow) {
  EXPECT_FALSE(findStraggler({{50, 5}, {52, 3}}, 1.3, 55).slow);        // 4% apart
  EXPECT_FALSE(findStraggler({{0.5, 0}, {1.2, 0}}, 1.3, 1.2).slow);     // 2.4x, but 0.7 ms: noise
  EXPECT_FALSE(findStraggler({{2.6, 3}, {3.7, 2}}, 1.3, 30).slow);      // 1.4x, 1.1 ms: under 5% of the step
  EXPECT_TRUE(findStraggler({{2.6, 3}, {3.7, 2}}, 1.3, 6).slow);        // the same in a 6 ms step
  EXPECT_TRUE(findStraggler({{10, 8}, {20, 0}}, 1.3, 20).slow);         // two ranks: the other's time is the median
  EXPECT_FALSE(findStraggler({{10, 8}, {20, 0}}, 0, 20).slow);          // 0: never
  EXPECT_FALSE(findStraggler({{10, 8}, {20, 0}}, 2.5, 20).slow);        // below a higher ratio
  EXPECT_EQ(findStraggler({{10, 8}, {20, 0}}, 2.5, 20).slowestRank, 1); // still the slowest, for the metrics
}

TEST(StragglersTest, OneRankHasNoStraggler) {
  const StragglerReport r = findStraggler({{30, 0}}, 1.3, 30);
  EXPECT_EQ(r.slowestRank, -1);
  EXPECT_FALSE(r.slow);
}

// The watch decides over spans of at least 5 s of steps: one slow window among even ones
// is diluted; a rank slow throughout is named once its first span completes, then every
// 10th span in a row.
TEST(StragglersTest, TheWatchNamesARankSlowOverASpanNotOneWindow) {
  StragglerWatch watch(1.3);
  StragglerReport report;
  const std::vector<RankPace> even = {{4, 6}, {4, 6}}, blip = {{6, 4}, {4, 6}}, slow = {{4, 60}, {60, 4}};
  // 10 ms steps in windows of 5: 100 windows make 5 s.
  int named = 0;
  for (int w = 0; w < 100; ++w) named += watch.add(w == 50 ? blip : even, 5, 10, report) ? 1 : 0;
  EXPECT_EQ(named, 0);
  EXPECT_EQ(report.slowestRank, 0);  // the span's report: rank 0 by a hair, not slow
  EXPECT_FALSE(report.slow);
  // 64 ms steps: a span is 16 windows; 30 spans in a row name rank 1 three times (1st, 11th, 21st).
  std::vector<int> when;
  for (int w = 0; w < 16 * 30; ++w) {
    if (watch.add(slow, 5, 64, report)) when.push_back(w);
  }
  EXPECT_EQ(when, (std::vector<int>{15, 16 * 11 - 1, 16 * 21 - 1}));
  EXPECT_EQ(report.slowestRank, 1);
  EXPECT_TRUE(report.slow);
  EXPECT_DOUBLE_EQ(report.lagMs, 56);
}

}  // namespace
}  // namespace tessera::trainer
