// Checkpoints of formats 1 and 2 (see formats_1_2.h).
#include "checkpoint/formats_1_2.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <set>

#include "checkpoint/format.h"
#include "common/errors.h"
#include "dtensor/stateful.h"

namespace tessera::checkpoint {

namespace {

// The n-th '/'-separated component of `name`, or "" when it has fewer.
std::string nameComponent(const std::string& name, int n) {
  size_t begin = 0;
  for (int i = 0; i < n; ++i) {
    begin = name.find('/', begin);
    if (begin == std::string::npos) return "";
    ++begin;
  }
  const size_t end = name.find('/', begin);
  return end == std::string::npos ? "" : name.substr(begin, end - begin);
}

// The model an EMA profile follows: the single model, else the one whose name begins
// the profile's ("generator" for "generator_ema"), else unknown ("").
std::string profileOwner(const std::string& profile, const std::set<std::string>& models) {
  if (models.count(dtensor::kModelKey)) return dtensor::kModelKey;
  for (const std::string& m : models) {
    if (profile.compare(0, m.size() + 1, m + "_") == 0) return m;
  }
  return "";
}

std::vector<ComponentRecord> legacyComponents(const CheckpointMetadata& md) {
  const std::string optimKey = dtensor::kOptimizerKey, emaKey = dtensor::kEmaKey;
  std::set<std::string> models, optimizerOf, profiles;
  bool singleOptimizer = false;
  for (const auto& t : md.tensors) {
    const std::string head = nameComponent(t.name, 0);
    if (head.empty()) continue;
    if (head == emaKey) {
      const std::string profile = nameComponent(t.name, 1);
      if (!profile.empty()) profiles.insert(profile);
    } else if (head != optimKey) {
      models.insert(head);
    }
  }
  for (const auto& t : md.tensors) {
    if (nameComponent(t.name, 0) != optimKey) continue;
    const std::string owner = nameComponent(t.name, 1);
    if (models.count(owner) && owner != dtensor::kModelKey) {
      optimizerOf.insert(owner);  // optim/<model>/<state>/<param>
    } else {
      singleOptimizer = true;  // the single-model form: optim/<state>/<param>
    }
  }
  std::vector<ComponentRecord> out;
  for (const std::string& m : models) {
    out.push_back({m, "model", "", {}, {{m, m + "/"}}});
  }
  if (singleOptimizer) out.push_back({optimKey, "optimizer", models.count(dtensor::kModelKey) ? dtensor::kModelKey : "", {}, {}});
  for (const std::string& m : optimizerOf) out.push_back({optimKey + "/" + m, "optimizer", m, {}, {}});
  if (!profiles.empty()) {
    ComponentRecord ema{emaKey, "ema", "", {}, {}};
    std::set<std::string> owners;
    for (const std::string& p : profiles) {
      ema.parts[p] = emaKey + "/" + p + "/";
      ema.exports[p] = ema.parts[p];
      owners.insert(profileOwner(p, models));
    }
    if (owners.size() == 1) ema.of = *owners.begin();
    out.push_back(std::move(ema));
  }
  // The aliases (checked by the reader: each a prefix holding tensors), to the component
  // whose tensors they name; one that names a profile of its own may not point elsewhere.
  for (const auto& [alias, prefix] : md.aliases) {
    const std::string own = emaKey + "/" + alias + "/";
    if (profiles.count(alias) && own != prefix) {
      throw CheckpointError(strCat("metadata.json: alias '", alias, "' points to '", prefix, "', but '", own,
                                               "' holds tensors of that name"));
    }
    for (ComponentRecord& c : out) {
      if (prefix.compare(0, c.prefix().size(), c.prefix()) == 0) {
        c.exports[alias] = prefix;
        break;
      }
    }
  }
  return out;
}

}  // namespace

std::vector<ComponentRecord> checkpointComponents(const CheckpointMetadata& metadata) {
  return metadata.version >= 3 ? metadata.components : legacyComponents(metadata);
}

std::map<std::string, std::string> checkpointExportNames(const CheckpointMetadata& metadata) {
  return exportNamesOf(checkpointComponents(metadata));
}

FormerEmaCounts formerEmaCounts(const std::string& trainerStateJson, const std::string& source, int64_t maxCount) {
  FormerEmaCounts out;
  const nlohmann::json j = nlohmann::json::parse(trainerStateJson, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return out;  // the trainer state's own reader says what is wrong with it
  const auto count = [&](const nlohmann::json& value, const std::string& key) {
    if (!value.is_number_integer()) throw Error(strCat(source, ": '", key, "' must be an integer, got ", value.dump()));
    if (value.is_number_unsigned() ? value.get<uint64_t>() > static_cast<uint64_t>(maxCount)
                                   : (value.get<int64_t>() < 0 || value.get<int64_t>() > maxCount)) {
      throw Error(strCat(source, ": '", key, "' is ", value.dump(), ", outside [0, ", maxCount, "]"));
    }
    return value.get<int64_t>();
  };
  if (j.contains("ema_updates")) out.single = count(j.at("ema_updates"), "ema_updates");
  if (j.contains("ema_updates_of")) {
    const nlohmann::json& of = j.at("ema_updates_of");
    if (!of.is_object()) throw Error(strCat(source, ": 'ema_updates_of' must be an object, got ", of.type_name()));
    for (const auto& [name, value] : of.items()) out.byName[name] = count(value, "ema_updates_of." + name);
  }
  return out;
}

void checkFormerEmaCountsHeld(const FormerEmaCounts& counts, const CheckpointMetadata& metadata,
                              const std::string& source) {
  for (const auto& [name, count] : counts.byName) {
    const std::string prefix = dtensor::statePrefix(dtensor::kEmaKey) + name + "/";
    const bool held = std::any_of(metadata.tensors.begin(), metadata.tensors.end(),
                                  [&](const TensorInfo& t) { return t.name.rfind(prefix, 0) == 0; });
    TESSERA_CHECK(held, source, ": 'ema_updates_of.", name, "' counts updates of an EMA the checkpoint does not hold (no ",
                  prefix, " tensors)");
  }
}

}  // namespace tessera::checkpoint
