// trainer_state.json: writing, and reading with every value checked (see train_counters.h).
#include "trainer/train_counters.h"

#include <nlohmann/json.hpp>

#include "common/errors.h"
#include "common/limits.h"

namespace tessera::trainer {

std::string countersToJson(const TrainerCounters& c) {
  nlohmann::json j = {{"step", c.step},
                      {"global_batch", c.globalBatch},
                      {"seed", c.seed},
                      {"skipped_steps", c.skippedSteps},
                      {"strategy", c.strategy},
                      {"world_size", c.worldSize},
                      {"resolved_config", c.resolvedConfig}};
  if (!c.dataFingerprint.empty()) j["data_fingerprint"] = c.dataFingerprint;
  if (!c.modelMetadata.empty()) {
    nlohmann::json models = nlohmann::json::object();
    for (const auto& [name, metadata] : c.modelMetadata) models[name] = nlohmann::json::parse(metadata);
    j["model_metadata"] = models;
  }
  return j.dump(2);
}

namespace {

std::map<std::string, std::string> modelMetadataIn(const nlohmann::json& j, const std::string& source) {
  std::map<std::string, std::string> out;
  if (!j.contains("model_metadata")) return out;
  const nlohmann::json& models = j.at("model_metadata");
  if (!models.is_object()) throw Error(strCat(source, ": 'model_metadata' must be an object, got ", models.type_name()));
  for (const auto& [name, metadata] : models.items()) {
    if (!metadata.is_object()) throw Error(strCat(source, ": 'model_metadata.", name, "' must be an object"));
    out[name] = metadata.dump();
  }
  return out;
}

nlohmann::json parseObject(const std::string& text, const std::string& source) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(strCat(source, ": not valid JSON: ", e.what()));
  }
  if (!j.is_object()) throw Error(strCat(source, ": expected a JSON object"));
  return j;
}

}  // namespace

std::map<std::string, std::string> modelMetadataFromJson(const std::string& text, const std::string& source) {
  return modelMetadataIn(parseObject(text, source), source);
}

TrainerCounters countersFromJson(const std::string& text, const std::string& source) {
  const nlohmann::json j = parseObject(text, source);
  auto get = [&](const char* key) -> const nlohmann::json& {
    if (!j.contains(key)) throw Error(strCat(source, ": missing key '", key, "'"));
    return j.at(key);
  };
  // Integers only (1.5 or 1e3 is refused, not truncated), within what the run can hold.
  auto integerValue = [&](const nlohmann::json& v, const std::string& key, int64_t lo, int64_t hi) {
    if (!v.is_number_integer()) throw Error(strCat(source, ": '", key, "' must be an integer, got ", v.dump()));
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      throw Error(strCat(source, ": '", key, "' is ", v.dump(), ", outside [", lo, ", ", hi, "]"));
    }
    const int64_t x = v.get<int64_t>();
    if (x < lo || x > hi) throw Error(strCat(source, ": '", key, "' is ", x, ", outside [", lo, ", ", hi, "]"));
    return x;
  };
  auto integer = [&](const char* key, int64_t lo, int64_t hi) { return integerValue(get(key), key, lo, hi); };
  auto string = [&](const char* key) {
    const nlohmann::json& v = get(key);
    if (!v.is_string()) throw Error(strCat(source, ": '", key, "' must be a string, got ", v.type_name()));
    return v.get<std::string>();
  };
  TrainerCounters c;
  c.globalBatch = integer("global_batch", 1, kMaxCounter);
  // The data position is step x global_batch samples: it must not overflow.
  c.step = integer("step", 0, kMaxCounter / c.globalBatch);
  c.seed = integer("seed", INT64_MIN, INT64_MAX);
  c.skippedSteps = integer("skipped_steps", 0, c.step);
  c.strategy = string("strategy");
  c.worldSize = static_cast<int>(integer("world_size", 1, kMaxWorldSize));
  c.resolvedConfig = string("resolved_config");
  if (j.contains("data_fingerprint")) {
    c.dataFingerprint = string("data_fingerprint");
    if (c.dataFingerprint.size() > 4096) throw Error(strCat(source, ": 'data_fingerprint' is longer than 4096 bytes"));
  }
  c.modelMetadata = modelMetadataIn(j, source);
  c.formerEmaCounts = checkpoint::formerEmaCounts(text, source, c.step);  // older checkpoints' (train_counters.h)
  return c;
}

}  // namespace tessera::trainer
