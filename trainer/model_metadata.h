// What an export carries so that a reader needs no config: safetensors
// __metadata__["tessera.model"] is a JSON object of the model's resolved keys (arch, sizes,
// the noise schedule; dit's classes resolved from the data) plus "data": {"tokens",
// "input_shape", "classes", "target_shape"} — the shapes the model was built for.
// python/tessera_models.py builds the same model from it. The keys are the config's own
// (bindModelKeys): one schema checks a run config and an export's metadata alike.
//
// A run records each model's description in trainer_state.json (by state name), so an
// offline export of a checkpoint writes the same metadata as the run's own export.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "datasets/data_options.h"
#include "datasets/dataset.h"
#include "models/model_options.h"

namespace tessera::checkpoint {
struct CheckpointMetadata;
}

namespace tessera::trainer {

constexpr const char* kModelMetadataKey = "tessera.model";

struct ModelDescription {
  models::ModelOptions model;
  datasets::DataSpec data;
  // The data it was trained on ("dataset": data.kind and its files, absolute paths): what
  // a judge compares samples with. Absent in exports that do not record it.
  std::optional<datasets::DataOptions> dataset;
};

// The metadata JSON of a model built from `options` for `data` (model.classes resolved
// for a class-conditional model; model.init_from and model.samples left out: they are
// the run's, not the model's), trained on `dataset` (nullptr: not recorded).
std::string modelMetadataJson(const models::ModelOptions& options, const datasets::DataSpec& data, const datasets::DataOptions* dataset = nullptr);

// Parses metadata JSON; tessera::Error naming `source` (the file) and the key for a value
// that is missing, of the wrong type or out of range.
ModelDescription parseModelMetadata(const std::string& json, const std::string& source);
// parseModelMetadata, then its sizes against `found` (the tensors the file or checkpoint
// holds, by name): blocks no more than its tensors, widths no wider than its largest
// dimension, inputs of a bounded size, DiT's positional table no larger than the file.
// What every reader runs before building a model from metadata (and tessera-export before
// copying a run's description into an export).
ModelDescription checkedModelMetadata(const std::string& json, const std::string& source,
                                      const std::map<std::string, std::vector<int64_t>>& found);
// The shapes of a checkpoint's tensors under `prefix`, by name without it: what
// checkedModelMetadata checks a checkpoint's model description against.
std::map<std::string, std::vector<int64_t>> shapesUnder(const checkpoint::CheckpointMetadata& metadata,
                                                        const std::string& prefix);

// The model an export describes (`path`: a safetensors file or a sharded export's
// *.index.json, its first file's metadata), or nothing for a file without Tessera's
// metadata (a file from elsewhere). tessera::Error naming the file for metadata that does
// not parse.
std::optional<ModelDescription> exportedModelDescription(const std::string& path);

// The keys that say how a denoiser's output is read (timesteps, beta_start, beta_end,
// noise_schedule, zero_terminal_snr, prediction) whose values differ from `from` to `to`,
// each as "key: <from> in the file, <to> here". A start from another denoiser's weights
// (init_from) that differs in them reads its outputs otherwise than it was trained.
std::vector<std::string> diffusionDifferences(const models::ModelOptions& from, const models::ModelOptions& to);

// The model keys (those modelMetadataJson writes, the data's shape left out) whose values
// differ between an export's description `file` and a model of `options` for `data`, each
// as "key: <file's> in the file, <this> here": the likely cause when its tensors do not fit.
std::vector<std::string> modelDifferences(const ModelDescription& file, const models::ModelOptions& options,
                                          const datasets::DataSpec& data);

// The metadata of the export of tensor prefix `prefix` ("model/", "ema/generator_ema/",
// "critic/") from a run's descriptions by state name (TrainerCounters::modelMetadata):
// the model whose weights or EMA the prefix holds; "" when none does.
std::string modelMetadataForPrefix(const std::map<std::string, std::string>& byStateName, const std::string& prefix);

}  // namespace tessera::trainer
