// Checkpoints of formats 1 and 2, as they read today: the one place that knows what the
// trainer wrote before format 3 and the names things had then. Their component table
// (format 3 records its own; formats 1 and 2 recorded only export aliases, so their table
// is read from the layout the trainer always used), the name the single-model form's EMA
// had before it followed its model, and the EMA update counts trainer_state.json held
// before each EMA saved its own. Tools that read checkpoints offline (tessera-ckpt info,
// tessera-export) ask here, so that old checkpoints list, load and export as new ones do.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/metadata.h"

namespace tessera::checkpoint {

// The recorded table (format 3), or for formats 1 and 2 the one their layout implies:
//   <model>/...                 each model's weights (kind "model", exported as <model>)
//   optim/...                   the single model "model"'s optimizer state, or
//   optim/<model>/...           a named model's (kind "optimizer", of <model>)
//   ema/<profile>/...           EMA profiles (kind "ema", a part and an export name each),
//   ema/<profile>.updates       and their update counts
// plus the checkpoint's aliases as export names. CheckpointError naming the alias when an
// alias points away from the profile of its own name (ema/<alias>/).
std::vector<ComponentRecord> checkpointComponents(const CheckpointMetadata& metadata);
// The export names of that table (resolveExportPrefix's third argument).
std::map<std::string, std::string> checkpointExportNames(const CheckpointMetadata& metadata);

// The name the single-model form's EMA had when the model was not a denoiser, before it
// was named after its model ("model_ema"): read from older checkpoints and kept as an
// export alias.
inline constexpr char kFormerSingleModelEma[] = "generator_ema";

// The EMA update counts of a trainer_state.json written before each EMA saved its own
// (the tensor ema/<name>.updates): the single-model form's ("ema_updates"), a models:
// run's by EMA name ("ema_updates_of"). Read when present, never written.
struct FormerEmaCounts {
  std::optional<int64_t> single;
  std::map<std::string, int64_t> byName;
};
// Error naming `source` and the key when one has the wrong type or is outside [0, maxCount].
FormerEmaCounts formerEmaCounts(const std::string& trainerStateJson, const std::string& source, int64_t maxCount);
// Error naming `source` when a count by name is of an EMA `metadata` holds no tensors of.
void checkFormerEmaCountsHeld(const FormerEmaCounts& counts, const CheckpointMetadata& metadata,
                              const std::string& source);

}  // namespace tessera::checkpoint
