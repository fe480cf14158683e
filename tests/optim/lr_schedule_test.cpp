// LR schedules against hand-computed values.
#include <gtest/gtest.h>

#include <cmath>

#include "common/errors.h"
#include "optim/lr_schedule.h"

namespace tessera::optim {
namespace {

TEST(LrScheduleTest, Constant) {
  LrSchedule s({ScheduleKind::kConstant, 0.1});
  EXPECT_DOUBLE_EQ(s.lrAt(0), 0.1);
  EXPECT_DOUBLE_EQ(s.lrAt(1000), 0.1);
}

TEST(LrScheduleTest, WarmupThenCosine) {
  LrScheduleOptions o;
  o.kind = optim::ScheduleKind::kCosine;
  o.baseLr = 1.0;
  o.warmupSteps = 4;
  o.totalSteps = 14;
  o.minLr = 0.1;
  LrSchedule s(o);
  EXPECT_DOUBLE_EQ(s.lrAt(0), 0.25);
  EXPECT_DOUBLE_EQ(s.lrAt(3), 1.0);
  EXPECT_DOUBLE_EQ(s.lrAt(4), 1.0);                                  // t = 0
  EXPECT_NEAR(s.lrAt(9), 0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * 0.5)), 1e-15);  // t = 0.5
  EXPECT_DOUBLE_EQ(s.lrAt(14), 0.1);
  EXPECT_DOUBLE_EQ(s.lrAt(100), 0.1);                                // stays at the floor
}

TEST(LrScheduleTest, WarmupThenLinear) {
  LrScheduleOptions o;
  o.kind = optim::ScheduleKind::kLinear;
  o.baseLr = 2.0;
  o.warmupSteps = 2;
  o.totalSteps = 6;
  o.minLr = 0.0;
  LrSchedule s(o);
  EXPECT_DOUBLE_EQ(s.lrAt(0), 1.0);
  EXPECT_DOUBLE_EQ(s.lrAt(2), 2.0);
  EXPECT_DOUBLE_EQ(s.lrAt(3), 1.5);
  EXPECT_DOUBLE_EQ(s.lrAt(6), 0.0);
}

TEST(LrScheduleTest, StepDecay) {
  LrScheduleOptions o;
  o.kind = optim::ScheduleKind::kStep;
  o.baseLr = 1.0;
  o.stepSize = 3;
  o.gamma = 0.5;
  LrSchedule s(o);
  EXPECT_DOUBLE_EQ(s.lrAt(2), 1.0);
  EXPECT_DOUBLE_EQ(s.lrAt(3), 0.5);
  EXPECT_DOUBLE_EQ(s.lrAt(7), 0.25);
}

TEST(LrScheduleTest, BadOptionsAreConfigErrors) {
  EXPECT_THROW(parseEnum(kScheduleKindNames, "exponential", "optim.schedule.kind"), ConfigError);
  LrScheduleOptions o;
  o.kind = optim::ScheduleKind::kCosine;
  o.warmupSteps = 10;
  o.totalSteps = 10;
  EXPECT_THROW(LrSchedule{o}, ConfigError);
  o = {};
  o.minLr = 1.0;
  o.baseLr = 0.1;
  EXPECT_THROW(LrSchedule{o}, ConfigError);
}

}  // namespace
}  // namespace tessera::optim
