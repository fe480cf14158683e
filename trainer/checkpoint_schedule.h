// CheckpointSchedule: which steps of a run are checkpointed, and after which step it
// stops early. Four things can ask for a save: checkpoint.every_steps (periodic), a stop
// signal agreed by the ranks (SIGTERM/SIGINT), run.stop_after_steps, and
// checkpoint.at_end. Any of them may fall on the same step; that step is saved once.
#pragma once

#include <cstdint>

namespace tessera::trainer {

class CheckpointSchedule {
 public:
  // totalSteps: run.steps; startStep: steps done before this invocation (resume);
  // everySteps, stopAfterSteps: 0 = off.
  CheckpointSchedule(int64_t totalSteps, int64_t startStep, int64_t everySteps, int64_t stopAfterSteps, bool atEnd);

  // After `done` steps: whether the run stops here, with a checkpoint. A stop signal or
  // stop_after_steps ends the run early; after the last step the run ends normally
  // (exports, samples) whatever was asked.
  bool stopsAfter(int64_t done, bool stopSignalled) const;
  // After `done` steps, not the last: whether a periodic save is due (the last step is
  // the end's to save, or not, per at_end).
  bool periodicSaveDue(int64_t done) const;
  // When the run ends after `done` steps (`stopped` early or not): whether the final save
  // is due (at_end, or a stop; nothing when no step ran in this invocation).
  bool finalSaveDue(int64_t done, bool stopped) const;

  // After `done` steps: whether a save to the node-local tier is due (every `localEvery`
  // steps, 0 = never), unless a persistent save covers the step or it is the last one.
  bool localSaveDue(int64_t done, int64_t localEvery) const;

  // Whether step `done` still needs a save; records that it gets one. A second call for
  // the same step returns false, so a step is never saved twice.
  bool claimSave(int64_t done);

 private:
  int64_t totalSteps_, startStep_, everySteps_, stopAfterSteps_;
  bool atEnd_;
  int64_t lastSaved_ = -1;
};

}  // namespace tessera::trainer
