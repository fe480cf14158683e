// Building a model from an export or a checkpoint and loading its weights: the metadata
// (model_metadata.h) says what to build, checked against the file's tensors first.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>

#include "models/models.h"
#include "trainer/model_metadata.h"

namespace tessera::trainer {

struct LoadedModel {
  ModelDescription description;
  std::shared_ptr<models::TrainModel> model;  // every parameter materialised, in eval mode, no gradients
};

// Builds the model an export's metadata describes and loads its weights, strictly: every
// parameter present with its shape, nothing else in the file (tessera::Error listing what
// does not fit). `path`: a safetensors file or a sharded export's *.index.json. A
// reduced-precision export is loaded into fp32.
LoadedModel loadExportedModel(const std::string& path, at::Device device = at::kCPU);

// The model `metadataJson` describes (`source` names where it came from, for errors), every
// parameter and buffer materialised as zeros, in eval mode, no gradients: a model whose values
// come from elsewhere (another rank's broadcast).
LoadedModel buildDescribedModel(const std::string& metadataJson, const std::string& source,
                                at::Device device = at::kCPU);

// The same from a checkpoint: `what` (model, generator_ema, an export name; see
// checkpoint::resolveExportPrefix and checkpointExportNames) of checkpoint directory `dir` (a step directory, or a
// run's checkpoints directory: its newest complete checkpoint), described by the
// run's trainer_state.json.
LoadedModel loadCheckpointModel(const std::string& dir, const std::string& what, at::Device device = at::kCPU);

}  // namespace tessera::trainer
