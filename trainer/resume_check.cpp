// Comparing a run's settings with its checkpoint's (see resume_check.h).
#include "trainer/resume_check.h"

#include <algorithm>
#include <map>
#include <set>

#include "common/config.h"
#include "common/errors.h"
#include "trainer/train_config.h"

namespace tessera::trainer {
namespace {

// Every key of a resolved config, by dotted path.
std::map<std::string, std::string> valuesOf(const std::string& yaml, const std::string& source) {
  TrainConfig config;
  config::ConfigSchema schema;
  bindTrainConfig(schema, config);
  schema.loadString(yaml, source);
  return schema.values();
}

// The part of `key` after its model prefix ("model.", "models.<name>.", or none).
std::string withinModel(const std::string& key) {
  if (key.rfind("model.", 0) == 0) return key.substr(6);
  if (key.rfind("models.", 0) == 0) {
    const size_t dot = key.find('.', 7);
    return dot == std::string::npos ? key : key.substr(dot + 1);
  }
  return key;
}

bool isModelsKey(const std::string& key) { return key.rfind("models.", 0) == 0; }

bool isModelDefault(const std::string& key) {
  for (const char* section : {"model.", "optim.", "sharding.", "ema."}) {
    if (key.rfind(section, 0) == 0) return true;
  }
  return false;
}

bool steersThisInvocationOnly(const std::string& key) {
  return key == "run.dir" || key == "run.stop_after_steps" || key == "checkpoint.resume" || key == "checkpoint.local.dir" || key.rfind("log.", 0) == 0;
}

// The prefix of a models.<name>. key ("models.teacher."), "" for any other key.
std::string modelPrefix(const std::string& key) {
  if (!isModelsKey(key)) return "";
  const size_t dot = key.find('.', 7);
  return dot == std::string::npos ? "" : key.substr(0, dot + 1);
}

std::string valueOr(const std::map<std::string, std::string>& values, const std::string& key, const std::string& absent) {
  auto it = values.find(key);
  return it == values.end() ? absent : it->second;
}

// The two resolved configs, and what a change of one key means for the saved state.
struct Sides {
  const std::map<std::string, std::string>& saved;
  const std::map<std::string, std::string>& now;

  // A frozen model (trainable: false on both sides) has no optimizer or EMA state: its
  // optim. and ema. keys steer nothing a checkpoint holds.
  bool frozenOnBothSides(const std::string& key) const {
    const std::string prefix = modelPrefix(key);
    if (prefix.empty()) return false;
    const std::string trainable = prefix + "trainable";
    return valueOr(saved, trainable, "true") == "false" && valueOr(now, trainable, "true") == "false";
  }

  bool steersNothingSaved(const std::string& key) const {
    const std::string inner = withinModel(key);
    return frozenOnBothSides(key) && (inner.rfind("optim.", 0) == 0 || inner.rfind("ema.", 0) == 0);
  }
};

}  // namespace

ResumeCheck compareWithSaved(const std::string& savedYaml, const std::string& currentYaml) {
  ResumeCheck check;
  std::map<std::string, std::string> saved, now;
  try {
    saved = valuesOf(savedYaml, "the checkpoint's resolved config");
    now = valuesOf(currentYaml, "this run's resolved config");
  } catch (const Error& e) {
    check.uncomparable = e.what();
    return check;
  }
  // In a models: run the top-level model, optim, sharding and ema keys are only the
  // defaults its entries inherit, and the entries' resolved values are compared instead.
  const bool severalModels = std::any_of(now.begin(), now.end(), [](const auto& kv) { return isModelsKey(kv.first); }) ||
                             std::any_of(saved.begin(), saved.end(), [](const auto& kv) { return isModelsKey(kv.first); });
  const Sides sides{saved, now};
  std::set<std::string> entriesNoted;  // a model only one side has is one change, not one per key
  auto note = [&](const std::string& key, const std::string& before, const std::string& after) {
    if (steersThisInvocationOnly(key) || (severalModels && isModelDefault(key)) || sides.steersNothingSaved(key)) return;
    if (isModelsKey(key) && (before.empty() || after.empty())) {
      const std::string entry = key.substr(0, key.find('.', 7));
      if (entriesNoted.insert(entry).second) {
        check.changed.push_back({entry, before.empty() ? "(absent)" : "(a model)", after.empty() ? "(absent)" : "(a model)"});
      }
      return;
    }
    check.changed.push_back({key, before.empty() ? "(absent)" : before, after.empty() ? "(absent)" : after});
  };
  for (const auto& [key, value] : now) {
    auto it = saved.find(key);
    if (it == saved.end()) {
      note(key, "", value);
    } else if (it->second != value) {
      note(key, it->second, value);
    }
  }
  for (const auto& [key, value] : saved) {
    if (!now.count(key)) note(key, value, "");
  }
  return check;
}

std::string describeChanges(const std::vector<SettingChange>& changes) {
  std::string out;
  for (const SettingChange& c : changes) out += strCat(out.empty() ? "" : ", ", c.key, " ", c.saved, " -> ", c.now);
  return out;
}

}  // namespace tessera::trainer
