// Exports' model metadata and loading a model from an export (see model_metadata.h).
#include "trainer/model_metadata.h"

#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <functional>

#include "checkpoint/exporter.h"
#include "checkpoint/reader.h"
#include "checkpoint/safetensors.h"
#include "common/config.h"
#include "common/errors.h"
#include "common/limits.h"
#include "dtensor/param_init.h"
#include "trainer/checkpoint_layout.h"
#include "trainer/train_counters.h"

namespace tessera::trainer {
namespace {

using nlohmann::json;

// Keys of the model section that describe the run rather than the model.
bool isRunKey(const std::string& key) { return key == "init_from" || key == "samples"; }

// An inline YAML value of the config schema ("64", "0.0001", "[256, 256]", "gelu",
// "true") as JSON.
json yamlToJson(const YAML::Node& node) {
  if (node.IsSequence()) {
    json out = json::array();
    for (const auto& item : node) out.push_back(yamlToJson(item));
    return out;
  }
  if (node.IsNull()) return nullptr;
  const std::string text = node.Scalar();
  int64_t i = 0;
  double d = 0;
  bool b = false;
  if (node.Tag() != "!" && YAML::convert<int64_t>::decode(node, i)) return i;
  if (node.Tag() != "!" && YAML::convert<double>::decode(node, d)) return d;
  if (node.Tag() != "!" && YAML::convert<bool>::decode(node, b)) return b;
  return text;
}

std::vector<int64_t> shapeOf(const json& j, const std::string& key, const std::string& source) {
  TESSERA_CHECK(j.is_array(), source, ": metadata data.", key, " must be a list of sizes, got ", j.dump());
  std::vector<int64_t> shape;
  for (const json& d : j) {
    TESSERA_CHECK(d.is_number_integer() && d.get<int64_t>() >= 1 && d.get<int64_t>() <= (int64_t{1} << 24), source,
                  ": metadata data.", key, " holds ", d.dump(), ", not a size in [1, 2^24]");
    shape.push_back(d.get<int64_t>());
  }
  TESSERA_CHECK(shape.size() <= 8, source, ": metadata data.", key, " has ", shape.size(), " dimensions");
  return shape;
}

// The "dataset" object: each key of the right type.
datasets::DataOptions parseDataset(const json& j, const std::string& source) {
  TESSERA_CHECK(j.is_object(), source, ": metadata dataset must be an object");
  datasets::DataOptions d;
  const auto text = [&](const char* key, std::string& to) {
    TESSERA_CHECK(j.contains(key) && j.at(key).is_string(), source, ": metadata dataset.", key, " must be a string");
    to = j.at(key).get<std::string>();
  };
  const auto integer = [&](const char* key, int64_t& to) {
    TESSERA_CHECK(j.contains(key) && j.at(key).is_number_integer() && j.at(key).get<int64_t>() >= 0 &&
                      j.at(key).get<int64_t>() <= (1 << 14),
                  source, ": metadata dataset.", key, " must be an integer in [0, 16384]");
    to = j.at(key).get<int64_t>();
  };
  text("kind", d.kind);
  text("path", d.path);
  text("labels", d.labels);
  text("eval_path", d.eval_path);
  text("eval_labels", d.eval_labels);
  text("token_dtype", d.token_dtype);
  integer("image_size", d.image_size);
  integer("channels", d.channels);
  TESSERA_CHECK(j.contains("eval_fraction") && j.at("eval_fraction").is_number() &&
                    j.at("eval_fraction").get<double>() >= 0 && j.at("eval_fraction").get<double>() < 1,
                source, ": metadata dataset.eval_fraction must be a number in [0, 1)");
  d.eval_fraction = j.at("eval_fraction").get<double>();
  return d;
}

}  // namespace

std::string modelMetadataJson(const models::ModelOptions& options, const datasets::DataSpec& data, const datasets::DataOptions* dataset) {
  models::ModelOptions resolved = options;
  if (resolved.arch == "dit") resolved.classes = models::conditioningClasses(options, data);
  config::ConfigSchema schema;
  models::bindModelKeys(schema, "", resolved);
  json out = json::object();
  for (const auto& [key, value] : schema.values()) {
    if (!isRunKey(key)) out[key] = yamlToJson(YAML::Load(value));
  }
  out["data"] = {{"tokens", data.tokens},
                 {"input_shape", data.inputShape},
                 {"classes", data.classes},
                 {"target_shape", data.targetShape}};
  if (dataset != nullptr) {
    const auto absolute = [](const std::string& path) {
      return path.empty() ? path : std::filesystem::absolute(path).lexically_normal().string();
    };
    out["dataset"] = {{"kind", dataset->kind},
                      {"path", absolute(dataset->path)},
                      {"labels", absolute(dataset->labels)},
                      {"eval_path", absolute(dataset->eval_path)},
                      {"eval_labels", absolute(dataset->eval_labels)},
                      {"eval_fraction", dataset->eval_fraction},
                      {"image_size", dataset->image_size},
                      {"channels", dataset->channels},
                      {"token_dtype", dataset->token_dtype}};
  }
  return out.dump();
}

ModelDescription parseModelMetadata(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(strCat(source, ": metadata '", kModelMetadataKey, "' is not valid JSON: ", e.what()));
  }
  TESSERA_CHECK(j.is_object() && j.contains("data") && j.at("data").is_object(), source, ": metadata '",
                kModelMetadataKey, "' must be an object with a \"data\" object");
  ModelDescription d;
  const json data = j.at("data");
  j.erase("data");
  if (j.contains("dataset")) {
    d.dataset = parseDataset(j.at("dataset"), source);
    j.erase("dataset");
  }
  // The model keys through the config schema: types, ranges and unknown keys checked
  // as in a run config (JSON is YAML).
  config::ConfigSchema schema;
  models::bindModelKeys(schema, "", d.model);
  try {
    schema.loadString(j.dump(), strCat(source, " metadata '", kModelMetadataKey, "'"));
  } catch (const std::exception& e) {
    throw Error(e.what());
  }
  for (const char* key : {"tokens", "input_shape", "classes", "target_shape"}) {
    TESSERA_CHECK(data.contains(key), source, ": metadata data lacks '", key, "'");
  }
  TESSERA_CHECK(data.at("tokens").is_boolean(), source, ": metadata data.tokens must be true or false");
  d.data.tokens = data.at("tokens").get<bool>();
  d.data.inputShape = shapeOf(data.at("input_shape"), "input_shape", source);
  d.data.targetShape = shapeOf(data.at("target_shape"), "target_shape", source);
  const json& classes = data.at("classes");
  TESSERA_CHECK(classes.is_number_integer() && classes.get<int64_t>() >= 0 && classes.get<int64_t>() <= (1 << 20),
                source, ": metadata data.classes must be an integer in [0, 2^20], got ", classes.dump());
  d.data.classes = classes.get<int64_t>();
  d.data.hasTargets = d.data.classes > 0 || !d.data.targetShape.empty();
  return d;
}

std::string modelMetadataForPrefix(const std::map<std::string, std::string>& byStateName, const std::string& prefix) {
  // Weights under "<weights>/", EMA profiles under "ema/<ema name>[_<decay>]/": the
  // longest state name the prefix starts with.
  std::string best, found;
  for (const auto& [name, metadata] : byStateName) {
    if (prefix.rfind(name, 0) == 0 && name.size() > best.size()) {
      best = name;
      found = metadata;
    }
  }
  return found;
}

namespace {

// Builds the model `metadataJson` describes and fills its parameters with `read(name)`:
// strict on names (`found`: what the source holds, by name) and shapes.
// Metadata is input like any other: before a model is built from it, its sizes must be
// ones the file's tensors could hold. Every block has at least one tensor, every width is
// some tensor's dimension, and the inputs fit in memory. (The schema has already bounded
// each key on its own: kMaxLayers, kMaxWidth.)
void checkSizesAgainstFile(const ModelDescription& d, const std::string& source,
                           const std::map<std::string, std::vector<int64_t>>& found) {
  int64_t largestDim = 0;
  for (const auto& [name, shape] : found) {
    for (int64_t dim : shape) largestDim = std::max(largestDim, dim);
  }
  const models::ModelOptions& m = d.model;
  const bool blocks = m.arch == "gpt" || m.arch == "dit" || m.arch == "diffusion";
  TESSERA_CHECK(!blocks || m.layers <= static_cast<int64_t>(found.size()), source, ": metadata '", kModelMetadataKey,
                "' says layers ", m.layers, ", but the file holds only ", found.size(), " tensors");
  if (m.arch == "gpt" || m.arch == "dit") {
    TESSERA_CHECK(m.embed_dim <= largestDim, source, ": metadata '", kModelMetadataKey, "' says embed_dim ", m.embed_dim,
                  ", wider than any tensor of the file (largest dimension ", largestDim, ")");
  }
  if (m.arch == "mlp") {
    for (int64_t width : m.hidden) {
      TESSERA_CHECK(width <= largestDim, source, ": metadata '", kModelMetadataKey, "' has a hidden width ", width,
                    ", wider than any tensor of the file (largest dimension ", largestDim, ")");
    }
  }
  // dit builds its positional table (tokens x embed_dim) at once; the file holds it too.
  int64_t fileElements = 0;
  for (const auto& [name, shape] : found) {
    int64_t n = 1;
    for (int64_t dim : shape) n = boundedProduct(n, dim, kMaxCounter);
    fileElements = n < 0 ? kMaxCounter : std::min(kMaxCounter, fileElements + n);
  }
  const std::vector<int64_t>& in = d.data.inputShape;
  if (m.arch == "dit" && in.size() == 3 && m.patch_size > 0) {
    const int64_t grid = in[1] / m.patch_size;
    const int64_t table = boundedProduct(boundedProduct(grid, grid, kMaxCounter), m.embed_dim, kMaxCounter);
    TESSERA_CHECK(table >= 0 && table <= fileElements, source, ": metadata says ", grid, " x ", grid,
                  " patches of width ", m.embed_dim, " (data.input_shape ", at::IntArrayRef(in), ", model.patch_size ",
                  m.patch_size, "), more than the ", fileElements, " values the file holds");
  }
  constexpr int64_t kMaxSampleElements = int64_t{1} << 28;  // one input or target: 1 GiB of fp32
  for (const auto& [key, shape] : {std::pair{"input_shape", d.data.inputShape}, std::pair{"target_shape", d.data.targetShape}}) {
    int64_t elements = 1;
    for (int64_t dim : shape) elements = boundedProduct(elements, dim, kMaxSampleElements);
    TESSERA_CHECK(elements >= 0, source, ": metadata data.", key, " ", at::IntArrayRef(shape), " holds more than ",
                  kMaxSampleElements, " elements per sample");
  }
}

LoadedModel buildAndLoad(const std::string& metadataJson, const std::string& source,
                         const std::map<std::string, std::vector<int64_t>>& found,
                         const std::function<at::Tensor(const std::string&)>& read, at::Device device) {
  LoadedModel out;
  out.description = checkedModelMetadata(metadataJson, source, found);
  // Built without storage: the shapes are matched against the file before any is allocated.
  out.model = models::makeModel(out.description.model, out.description.data, device);
  // Parameters and buffers: what a state_dict holds.
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& p : out.model->named_parameters()) tensors.emplace_back(p.key(), p.value());
  for (const auto& b : out.model->named_buffers()) tensors.emplace_back(b.key(), b.value());
  std::map<std::string, std::vector<int64_t>> expected;
  for (const auto& [name, tensor] : tensors) expected[name] = tensor.sizes().vec();
  const checkpoint::MatchReport report = checkpoint::matchTensors(found, expected);
  TESSERA_CHECK(report.ok(/*strict=*/true), source, ": does not fit the ", out.description.model.arch,
                " its metadata describes:\n", report.str());
  dtensor::materializeAll(*out.model, [](const std::string&, int64_t, const at::Tensor& rows) { rows.zero_(); });
  c10::NoGradGuard noGrad;
  for (const auto& [name, tensor] : tensors) {
    const at::Tensor value = read(name);
    TESSERA_CHECK(value.is_floating_point(), source, ": tensor '", name, "' is ", value.scalar_type(),
                  ", not floating point");
    TESSERA_CHECK(value.isfinite().all().item<bool>(), source, ": tensor '", name, "' holds NaN or Inf");
    tensor.copy_(value);
  }
  for (auto& p : out.model->parameters()) p.set_requires_grad(false);
  out.model->eval();
  return out;
}

}  // namespace

ModelDescription checkedModelMetadata(const std::string& json, const std::string& source,
                                      const std::map<std::string, std::vector<int64_t>>& found) {
  ModelDescription d = parseModelMetadata(json, source);
  checkSizesAgainstFile(d, source, found);
  return d;
}

std::map<std::string, std::vector<int64_t>> shapesUnder(const checkpoint::CheckpointMetadata& metadata,
                                                        const std::string& prefix) {
  std::map<std::string, std::vector<int64_t>> found;
  for (const auto& t : metadata.tensors) {
    if (t.name.rfind(prefix, 0) == 0) found[t.name.substr(prefix.size())] = t.shape;
  }
  return found;
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
  const std::string prefix = checkpoint::resolveExportPrefix(reader.metadata(), what, checkpointExportNames(reader.metadata()));
  const std::string stateFile = (std::filesystem::path(stepDir) / "trainer_state.json").string();
  const std::string metadata = modelMetadataForPrefix(modelMetadataFromJson(reader.trainerState(), stateFile), prefix);
  TESSERA_CHECK(!metadata.empty(), stepDir, ": its trainer_state.json does not describe the model under '", prefix,
                "' (a checkpoint written before Tessera recorded its models): export it and pass --weights");
  return buildAndLoad(metadata, strCat(stepDir, " (", what, ")"), shapesUnder(reader.metadata(), prefix),
                      [&](const std::string& name) { return reader.readFull(prefix + name); }, device);
}

}  // namespace tessera::trainer
