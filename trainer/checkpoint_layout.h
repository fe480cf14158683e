// What the tensors of a Tessera training run's checkpoint are: its component table. Since
// format 3 the checkpoint records it (written by the components themselves); formats 1
// and 2 recorded only export aliases, so their table is read from the layout the trainer
// always used. Tools that read checkpoints offline (tessera-ckpt info, tessera-export)
// ask here so that old checkpoints list and export as new ones do.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "checkpoint/metadata.h"

namespace tessera::trainer {

// The recorded table (format 3), or for formats 1 and 2 the one their layout implies:
//   <model>/...                 each model's weights (kind "model", exported as <model>)
//   optim/...                   the single model "model"'s optimizer state, or
//   optim/<model>/...           a named model's (kind "optimizer", of <model>)
//   ema/<profile>/...           EMA profiles (kind "ema", a part and an export name each),
//   ema/<profile>.updates       and their update counts
// plus the checkpoint's aliases as export names. CheckpointError naming the alias when an
// alias points away from the profile of its own name (ema/<alias>/).
std::vector<checkpoint::ComponentRecord> checkpointComponents(const checkpoint::CheckpointMetadata& metadata);
// The export names of that table (checkpoint::resolveExportPrefix's third argument).
std::map<std::string, std::string> checkpointExportNames(const checkpoint::CheckpointMetadata& metadata);

}  // namespace tessera::trainer
