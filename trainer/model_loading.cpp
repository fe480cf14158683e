// Building a model from an export or a checkpoint and loading its weights (see
// model_loading.h).
#include "trainer/model_loading.h"

#include <c10/core/GradMode.h>

#include <filesystem>
#include <functional>
#include <map>
#include <utility>
#include <vector>

#include "checkpoint/exporter.h"
#include "checkpoint/reader.h"
#include "checkpoint/safetensors.h"
#include "common/errors.h"
#include "dtensor/param_init.h"
#include "checkpoint/formats_1_2.h"
#include "trainer/train_counters.h"

namespace tessera::trainer {
namespace {

// A model of `description`, built without storage (its shapes can be matched against a file
// before any is allocated).
LoadedModel unmaterialised(ModelDescription description, at::Device device) {
  LoadedModel out;
  out.description = std::move(description);
  out.model = models::makeModel(out.description.model, out.description.data, device);
  return out;
}

// Storage for every parameter and buffer, zeros until they are filled.
void materialiseZeros(models::TrainModel& model) {
  dtensor::materializeAll(model, [](const std::string&, int64_t, const at::Tensor& rows) { rows.zero_(); });
}

// Loaded models sample: no gradients, eval mode.
void freeze(models::TrainModel& model) {
  for (auto& p : model.parameters()) p.set_requires_grad(false);
  model.eval();
}

// Builds the model `metadataJson` describes and fills its parameters with `read(name)`:
// strict on names (`found`: what the source holds, by name) and shapes.
LoadedModel buildAndLoad(const std::string& metadataJson, const std::string& source,
                         const std::map<std::string, std::vector<int64_t>>& found,
                         const std::function<at::Tensor(const std::string&)>& read, at::Device device) {
  LoadedModel out = unmaterialised(checkedModelMetadata(metadataJson, source, found), device);
  // Parameters and buffers: what a state_dict holds.
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& p : out.model->named_parameters()) tensors.emplace_back(p.key(), p.value());
  for (const auto& b : out.model->named_buffers()) tensors.emplace_back(b.key(), b.value());
  std::map<std::string, std::vector<int64_t>> expected;
  for (const auto& [name, tensor] : tensors) expected[name] = tensor.sizes().vec();
  const checkpoint::MatchReport report = checkpoint::matchTensors(found, expected);
  TESSERA_CHECK(report.ok(/*strict=*/true), source, ": does not fit the ", out.description.model.arch,
                " its metadata describes:\n", report.str());
  materialiseZeros(*out.model);
  c10::NoGradGuard noGrad;
  for (const auto& [name, tensor] : tensors) {
    const at::Tensor value = read(name);
    TESSERA_CHECK(value.is_floating_point(), source, ": tensor '", name, "' is ", value.scalar_type(),
                  ", not floating point");
    TESSERA_CHECK(value.isfinite().all().item<bool>(), source, ": tensor '", name, "' holds NaN or Inf");
    tensor.copy_(value);
  }
  freeze(*out.model);
  return out;
}

}  // namespace

LoadedModel buildDescribedModel(const std::string& metadataJson, const std::string& source, at::Device device) {
  LoadedModel out = unmaterialised(parseModelMetadata(metadataJson, source), device);
  materialiseZeros(*out.model);
  freeze(*out.model);
  return out;
}

LoadedModel loadExportedModel(const std::string& path, at::Device device) {
  const checkpoint::SafetensorsSet files(path);
  TESSERA_CHECK(!files.byName().empty(), path, ": holds no tensors");
  const auto& metadata = files.byName().begin()->second.reader->header().metadata;
  const auto it = metadata.find(kModelMetadataKey);
  TESSERA_CHECK(it != metadata.end(), path, ": no '", kModelMetadataKey,
                "' metadata (an export written before Tessera recorded its model, or not Tessera's): "
                "its model is unknown");
  std::map<std::string, std::vector<int64_t>> found;
  for (const auto& [name, located] : files.byName()) found[name] = located.entry->shape;
  return buildAndLoad(it->second, path, found,
                      [&](const std::string& name) { return files.byName().at(name).reader->read(name); }, device);
}

LoadedModel loadCheckpointModel(const std::string& dir, const std::string& what, at::Device device) {
  const std::string stepDir = checkpoint::checkpointOrNewestIn(dir);
  TESSERA_CHECK(!stepDir.empty(), dir, " is neither a complete checkpoint (no ", checkpoint::kMetadataFile,
                ") nor a directory holding one");
  checkpoint::CheckpointReader reader(stepDir);
  const std::string prefix = checkpoint::resolveExportPrefix(reader.metadata(), what, checkpoint::checkpointExportNames(reader.metadata()));
  const std::string stateFile = (std::filesystem::path(stepDir) / "trainer_state.json").string();
  const std::string metadata = modelMetadataForPrefix(modelMetadataFromJson(reader.trainerState(), stateFile), prefix);
  TESSERA_CHECK(!metadata.empty(), stepDir, ": its trainer_state.json does not describe the model under '", prefix,
                "' (a checkpoint written before Tessera recorded its models): export it and pass --weights");
  return buildAndLoad(metadata, strCat(stepDir, " (", what, ")"), shapesUnder(reader.metadata(), prefix),
                      [&](const std::string& name) { return reader.readFull(prefix + name); }, device);
}

}  // namespace tessera::trainer
