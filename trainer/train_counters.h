// The trainer's counters — where the run is, what it was started with — and their JSON
// form, trainer_state.json in every checkpoint. Apart from the tensor state so that the
// reader, which takes a file from anyone, builds and is fuzzed without LibTorch.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "checkpoint/formats_1_2.h"

namespace tessera::trainer {

// Counters that are not tensors: where the run is and what it was started with.
struct TrainerCounters {
  int64_t step = 0;               // optimizer steps completed
  int64_t globalBatch = 0;        // the data position is step x globalBatch samples
  int64_t seed = 0;
  int64_t skippedSteps = 0;
  std::string strategy;
  int worldSize = 1;
  std::string resolvedConfig;     // YAML text of the run that saved
  // What the data order depends on beyond the config, for data that orders itself
  // (Dataset::fingerprint(): a shard set's names and counts); empty for other data and in
  // checkpoints written before it was kept.
  std::string dataFingerprint;
  // Each model's export metadata (model_metadata.h) by the state name its tensors go by:
  // "model/", "generator/" (weights) and "ema/generator_ema" (its EMA profiles' names
  // start so). Absent from checkpoints written before exports carried it.
  std::map<std::string, std::string> modelMetadata;
  // Checkpoints written before each EMA saved its own update count held it here
  // (checkpoint/formats_1_2.h). Read when present (and checked), never written.
  checkpoint::FormerEmaCounts formerEmaCounts;
};

std::string countersToJson(const TrainerCounters& c);
// Throws tessera::Error naming `source` (the file) and the key when the JSON lacks one,
// has the wrong type (a fraction where an integer belongs) or a value out of range (a
// negative step, more EMA updates or skipped steps than steps, a world size of 0).
TrainerCounters countersFromJson(const std::string& json, const std::string& source);
// Only the models' export metadata of a trainer_state.json (empty when it has none, as a
// checkpoint written by a library user's own loop): what an offline export needs.
std::map<std::string, std::string> modelMetadataFromJson(const std::string& json, const std::string& source);

}  // namespace tessera::trainer
