// One run per run.dir: what a start does with the files an earlier run left there, decided
// before anything is written, so two runs never share metrics, loss curve, TensorBoard
// events, exports or checkpoints (and resume never loads another run's checkpoint).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "trainer/train_config.h"

namespace tessera::trainer {

// The outputs of an earlier run found in `runDir` (names relative to it: "checkpoints/
// (step_00000300 newest)", "metrics.jsonl", "export/", ...); logs/ is not one (each
// attempt's rank logs live there by design).
struct EarlierRun {
  std::vector<std::string> outputs;      // what is there, for messages
  std::vector<std::string> movable;      // the entries of runDir that hold them
  std::string newestCheckpoint;          // the newest checkpoints/step_* ("" when none)
  bool empty() const { return outputs.empty(); }
};
EarlierRun findEarlierRun(const std::filesystem::path& runDir);

// Rank 0's decision, before the run writes anything:
//  - checkpoint.resume none (--resume none) where an earlier run left checkpoints or
//    outputs: refused (ConfigError naming run.dir and what it holds): another run.dir
//    starts afresh, --resume auto continues the run;
//  - checkpoint.resume auto where an earlier run stopped before its first checkpoint (its
//    outputs, nothing to resume): they are moved aside into <run.dir>/replaced-<UTC time>/
//    and the log says so, and the run starts afresh;
//  - otherwise (a checkpoint to resume, a checkpoint directory named, a new run.dir):
//    nothing to do.
void claimRunDir(const TrainConfig& cfg);

// Creates <runDir>/logs and checks that a file can be written there (each rank with a
// file of its own name, removed again); a run.dir that cannot be created or written (a path
// through a file, a read-only file system, no permission) is a ConfigError naming run.dir,
// the path and the system's reason, before anything else of the run starts.
void makeWritableRunDir(const std::filesystem::path& runDir);

}  // namespace tessera::trainer
