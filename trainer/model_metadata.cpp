// Exports' model metadata: written, parsed and checked against the tensors of a file (see
// model_metadata.h).
#include "trainer/model_metadata.h"

#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <type_traits>

#include "checkpoint/metadata.h"
#include "checkpoint/safetensors.h"
#include "common/config.h"
#include "common/errors.h"
#include "common/limits.h"
#include "models/architecture.h"

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
  if (const models::ArchitectureSpec* spec = models::findArchitecture(resolved.arch); spec && spec->resolve) {
    spec->resolve(resolved, data);
  }
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

// Metadata is input like any other: before a model is built from it, its sizes must be
// ones the file's tensors could hold (its architecture's fileProblem: every block has at
// least one tensor, every width is some tensor's dimension), and the inputs fit in memory.
// (The schema has already bounded each key on its own: kMaxLayers, kMaxWidth.)
void checkSizesAgainstFile(const ModelDescription& d, const std::string& source,
                           const std::map<std::string, std::vector<int64_t>>& found) {
  models::FileShapes file;
  file.tensors = static_cast<int64_t>(found.size());
  for (const auto& [name, shape] : found) {
    int64_t n = 1;
    for (int64_t dim : shape) {
      file.largestDim = std::max(file.largestDim, dim);
      n = boundedProduct(n, dim, kMaxCounter);
    }
    file.elements = n < 0 ? kMaxCounter : std::min(kMaxCounter, file.elements + n);
  }
  const models::ArchitectureSpec& spec = models::architecture(d.model.arch);
  const std::string problem = spec.fileProblem ? spec.fileProblem(d.model, d.data, file) : std::string();
  TESSERA_CHECK(problem.empty(), source, ": metadata '", kModelMetadataKey, "' ", problem);
  constexpr int64_t kMaxSampleElements = int64_t{1} << 28;  // one input or target: 1 GiB of fp32
  for (const auto& [key, shape] : {std::pair{"input_shape", d.data.inputShape}, std::pair{"target_shape", d.data.targetShape}}) {
    int64_t elements = 1;
    for (int64_t dim : shape) elements = boundedProduct(elements, dim, kMaxSampleElements);
    TESSERA_CHECK(elements >= 0, source, ": metadata data.", key, " ", at::IntArrayRef(shape), " holds more than ",
                  kMaxSampleElements, " elements per sample");
  }
}

}  // namespace

ModelDescription checkedModelMetadata(const std::string& json, const std::string& source,
                                      const std::map<std::string, std::vector<int64_t>>& found) {
  ModelDescription d = parseModelMetadata(json, source);
  checkSizesAgainstFile(d, source, found);
  return d;
}

std::optional<ModelDescription> exportedModelDescription(const std::string& path) {
  const std::vector<std::string> files = checkpoint::safetensorsFiles(path);
  if (files.empty()) return std::nullopt;
  const checkpoint::SafetensorsReader reader(files.front());
  const auto it = reader.header().metadata.find(kModelMetadataKey);
  if (it == reader.header().metadata.end()) return std::nullopt;
  return parseModelMetadata(it->second, files.front());
}

std::vector<std::string> diffusionDifferences(const models::ModelOptions& from, const models::ModelOptions& to) {
  std::vector<std::string> out;
  const auto text = [](const auto& value) {
    if constexpr (std::is_same_v<std::decay_t<decltype(value)>, bool>) {
      return std::string(value ? "true" : "false");
    } else {
      return strCat(value);
    }
  };
  const auto compare = [&](const char* key, const auto& a, const auto& b) {
    if (a != b) out.push_back(strCat(key, ": ", text(a), " in the file, ", text(b), " here"));
  };
  compare("prediction", from.prediction, to.prediction);
  compare("noise_schedule", from.noise_schedule, to.noise_schedule);
  compare("zero_terminal_snr", from.zero_terminal_snr, to.zero_terminal_snr);
  compare("timesteps", from.timesteps, to.timesteps);
  if (from.noise_schedule == "linear" || to.noise_schedule == "linear") {
    compare("beta_start", from.beta_start, to.beta_start);
    compare("beta_end", from.beta_end, to.beta_end);
  }
  return out;
}

std::vector<std::string> modelDifferences(const ModelDescription& file, const models::ModelOptions& options,
                                          const datasets::DataSpec& data) {
  const json theirs = json::parse(modelMetadataJson(file.model, file.data));
  const json mine = json::parse(modelMetadataJson(options, data));
  std::vector<std::string> out;
  for (const auto& [key, value] : mine.items()) {
    if (key == "data") continue;
    const json other = theirs.contains(key) ? theirs.at(key) : json();
    if (other != value) out.push_back(strCat(key, ": ", other.dump(), " in the file, ", value.dump(), " here"));
  }
  return out;
}

std::map<std::string, std::vector<int64_t>> shapesUnder(const checkpoint::CheckpointMetadata& metadata,
                                                        const std::string& prefix) {
  std::map<std::string, std::vector<int64_t>> found;
  for (const auto& t : metadata.tensors) {
    if (t.name.rfind(prefix, 0) == 0) found[t.name.substr(prefix.size())] = t.shape;
  }
  return found;
}

}  // namespace tessera::trainer
