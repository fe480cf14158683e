// CheckpointSchedule: one save per step whatever falls on it — a periodic save with a
// stop signal, with run.stop_after_steps, with the end (at_end) — and the stop rules
// (never after the last step; stop_after_steps counts from the resumed step).
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "trainer/checkpoint_schedule.h"
#include "trainer/train_config.h"

namespace tessera::trainer {
namespace {

// The keys a schedule reads: run.steps = total, checkpoint.every_steps = every,
// run.stop_after_steps = stopAfter, checkpoint.at_end, checkpoint.local.every_steps = local;
// a schedule for a run resumed at `start`. The keys live as long as the test.
struct Keys {
  RunOptions run;
  CheckpointSection checkpoint;
};
CheckpointSchedule scheduleOf(int64_t total, int64_t start, int64_t every, int64_t stopAfter, bool atEnd,
                                        int64_t local = 0) {
  static std::vector<std::unique_ptr<Keys>> held;
  held.push_back(std::make_unique<Keys>());
  Keys& k = *held.back();
  k.run.steps = total;
  k.run.stop_after_steps = stopAfter;
  k.checkpoint.every_steps = every;
  k.checkpoint.at_end = atEnd;
  k.checkpoint.local.every_steps = local;
  return CheckpointSchedule(k.run, k.checkpoint, start);
}

// Runs the trainer's decision sequence over steps startStep+1..: after each step the
// periodic save, then the stop check; at the end the final save. Returns the steps
// saved, in order. `signalAt`: the step after which a stop signal is agreed (0: none).
std::vector<int64_t> savedSteps(CheckpointSchedule schedule, int64_t totalSteps, int64_t startStep, int64_t signalAt) {
  std::vector<int64_t> saved;
  auto save = [&](int64_t done) {
    if (schedule.claimSave(done)) saved.push_back(done);
  };
  int64_t done = startStep;
  bool stopped = false;
  while (done < totalSteps && !stopped) {
    ++done;
    if (schedule.periodicSaveDue(done)) save(done);
    stopped = schedule.stopsAfter(done, done == signalAt);
  }
  if (schedule.finalSaveDue(done, stopped)) save(done);
  return saved;
}

TEST(CheckpointScheduleTest, PeriodicSaveAndStopAfterStepsOnTheSameStep) {
  // every 50, stop after 150 (the main job's first part): 50, 100, 150 once.
  EXPECT_EQ(savedSteps(scheduleOf(300, 0, 50, 150, true), 300, 0, 0), (std::vector<int64_t>{50, 100, 150}));
  // Resumed at 150, stop after 100 more: counted from the resumed step.
  EXPECT_EQ(savedSteps(scheduleOf(300, 150, 50, 100, true), 300, 150, 0), (std::vector<int64_t>{200, 250}));
}

TEST(CheckpointScheduleTest, PeriodicSaveAndStopSignalOnTheSameStep) {
  EXPECT_EQ(savedSteps(scheduleOf(20, 0, 5, 0, true), 20, 0, 10), (std::vector<int64_t>{5, 10}));
  // A signal between periodic saves: the stop saves its own step.
  EXPECT_EQ(savedSteps(scheduleOf(20, 0, 5, 0, false), 20, 0, 7), (std::vector<int64_t>{5, 7}));
}

TEST(CheckpointScheduleTest, PeriodicSaveAndTheEndOnTheSameStep) {
  EXPECT_EQ(savedSteps(scheduleOf(20, 0, 5, 0, true), 20, 0, 0), (std::vector<int64_t>{5, 10, 15, 20}));
  // Without at_end the last step is not saved, not even when it is a multiple.
  EXPECT_EQ(savedSteps(scheduleOf(20, 0, 5, 0, false), 20, 0, 0), (std::vector<int64_t>{5, 10, 15}));
}

TEST(CheckpointScheduleTest, StopSignalStopAfterStepsAndTheEndOnTheLastStep) {
  // Everything on step 20, the last: the run ends normally and saves 20 once.
  EXPECT_EQ(savedSteps(scheduleOf(20, 0, 5, 20, true), 20, 0, 20), (std::vector<int64_t>{5, 10, 15, 20}));
  CheckpointSchedule schedule = scheduleOf(20, 0, 5, 20, true);
  EXPECT_FALSE(schedule.stopsAfter(20, true)) << "the last step ends the run, it does not stop it";
  EXPECT_TRUE(schedule.stopsAfter(19, true));
  // A stop signal and stop_after_steps on the same step, no periodic saves.
  EXPECT_EQ(savedSteps(scheduleOf(20, 0, 0, 8, false), 20, 0, 8), (std::vector<int64_t>{8}));
}

TEST(CheckpointScheduleTest, LocalSavesFallBetweenPersistentOnesAndNotOnTheLastStep) {
  CheckpointSchedule schedule = scheduleOf(30, 0, 10, 0, true, 5);
  std::vector<int64_t> local;
  for (int64_t done = 1; done <= 30; ++done) {
    if (schedule.periodicSaveDue(done)) schedule.claimSave(done);
    if (schedule.localSaveDue(done)) local.push_back(done);
  }
  // 10 and 20 are persistent saves, 30 is the end's.
  EXPECT_EQ(local, (std::vector<int64_t>{5, 15, 25}));
  EXPECT_FALSE(scheduleOf(30, 0, 0, 0, true).localSaveDue(5)) << "0: no local tier";
}

TEST(CheckpointScheduleTest, NothingToSaveWhenNoStepRan) {
  CheckpointSchedule schedule = scheduleOf(20, 20, 5, 0, true);
  EXPECT_FALSE(schedule.finalSaveDue(20, false)) << "resumed at the last step: nothing new";
  EXPECT_TRUE(schedule.claimSave(20));
  EXPECT_FALSE(schedule.claimSave(20));
}

}  // namespace
}  // namespace tessera::trainer
