// Save and stop decisions of a run (see checkpoint_schedule.h).
#include "trainer/checkpoint_schedule.h"

#include "trainer/train_config.h"

namespace tessera::trainer {

CheckpointSchedule::CheckpointSchedule(const RunOptions& run, const CheckpointSection& checkpoint, int64_t startStep)
    : run_(run), checkpoint_(checkpoint), startStep_(startStep) {}

bool CheckpointSchedule::stopsAfter(int64_t done, bool stopSignalled) const {
  if (done >= run_.steps) return false;
  return stopSignalled || (run_.stop_after_steps > 0 && done - startStep_ >= run_.stop_after_steps);
}

bool CheckpointSchedule::periodicSaveDue(int64_t done) const {
  return checkpoint_.every_steps > 0 && done % checkpoint_.every_steps == 0 && done < run_.steps;
}

bool CheckpointSchedule::finalSaveDue(int64_t done, bool stopped) const {
  return (checkpoint_.at_end || stopped) && done > startStep_;
}

bool CheckpointSchedule::claimSave(int64_t done) {
  if (done == lastSaved_) return false;
  lastSaved_ = done;
  return true;
}

bool CheckpointSchedule::localSaveDue(int64_t done) const {
  const int64_t every = checkpoint_.local.every_steps;
  return every > 0 && done % every == 0 && done < run_.steps && lastSaved_ != done;
}

}  // namespace tessera::trainer
