// CheckpointSchedule: which steps of a run are checkpointed, and after which step it
// stops early. Four things can ask for a save: checkpoint.every_steps (periodic), a stop
// signal agreed by the ranks (SIGTERM/SIGINT), run.stop_after_steps, and
// checkpoint.at_end. Any of them may fall on the same step; that step is saved once.
// Saves to the node-local tier (checkpoint.local.every_steps) fall between them.
#pragma once

#include <cstdint>

namespace tessera::trainer {

struct RunOptions;
struct CheckpointSection;

class CheckpointSchedule {
 public:
  // The keys of run.* and checkpoint.* it reads (run.steps, run.stop_after_steps,
  // checkpoint.every_steps, at_end, local.every_steps: 0 = off), held by reference: they
  // must outlive it. startStep: steps done before this invocation (resume).
  CheckpointSchedule(const RunOptions& run, const CheckpointSection& checkpoint, int64_t startStep);

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

  // After `done` steps: whether a save to the node-local tier is due (every
  // checkpoint.local.every_steps steps), unless a persistent save covers the step or it is
  // the last one.
  bool localSaveDue(int64_t done) const;

  // Whether step `done` still needs a save; records that it gets one. A second call for
  // the same step returns false, so a step is never saved twice.
  bool claimSave(int64_t done);

 private:
  const RunOptions& run_;
  const CheckpointSection& checkpoint_;
  int64_t startStep_;
  int64_t lastSaved_ = -1;
};

}  // namespace tessera::trainer
