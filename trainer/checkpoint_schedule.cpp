// Save and stop decisions of a run (see checkpoint_schedule.h).
#include "trainer/checkpoint_schedule.h"

namespace tessera::trainer {

CheckpointSchedule::CheckpointSchedule(int64_t totalSteps, int64_t startStep, int64_t everySteps,
                                       int64_t stopAfterSteps, bool atEnd)
    : totalSteps_(totalSteps),
      startStep_(startStep),
      everySteps_(everySteps),
      stopAfterSteps_(stopAfterSteps),
      atEnd_(atEnd) {}

bool CheckpointSchedule::stopsAfter(int64_t done, bool stopSignalled) const {
  if (done >= totalSteps_) return false;
  return stopSignalled || (stopAfterSteps_ > 0 && done - startStep_ >= stopAfterSteps_);
}

bool CheckpointSchedule::periodicSaveDue(int64_t done) const {
  return everySteps_ > 0 && done % everySteps_ == 0 && done < totalSteps_;
}

bool CheckpointSchedule::finalSaveDue(int64_t done, bool stopped) const {
  return (atEnd_ || stopped) && done > startStep_;
}

bool CheckpointSchedule::claimSave(int64_t done) {
  if (done == lastSaved_) return false;
  lastSaved_ = done;
  return true;
}

bool CheckpointSchedule::localSaveDue(int64_t done, int64_t localEvery) const {
  return localEvery > 0 && done % localEvery == 0 && done < totalSteps_ && lastSaved_ != done;
}

}  // namespace tessera::trainer
