// Checkpoint entries and trainer-state JSON of a training run (see train_state.h).
#include "trainer/train_state.h"

#include <nlohmann/json.hpp>

#include "common/errors.h"
#include "ema/ema_manager.h"
#include "sharding/strategy.h"

namespace tessera::trainer {

std::vector<checkpoint::StateEntry> collectStateEntries(sharding::ShardingStrategy& strategy,
                                                        ema::ShardedModelEMAManager* ema) {
  std::vector<checkpoint::StateEntry> entries;
  auto& optimizer = strategy.optimizer();
  for (const auto& name : strategy.paramNames()) {
    entries.push_back({"model/" + name, strategy.spec(name), strategy.masterShard(name)});
  }
  for (const auto& key : optimizer.stateNames()) {
    for (const auto& name : strategy.paramNames()) {
      const size_t i = strategy.paramIndex(name);
      if (!optimizer.state(i, key).defined()) {
        optimizer.setState(i, key, at::zeros_like(strategy.masterShard(name)));
      }
      entries.push_back({"optim/" + key + "/" + name, strategy.spec(name), optimizer.state(i, key)});
    }
  }
  if (ema) {
    for (size_t d = 0; d < ema->numDecays(); ++d) {
      for (const auto& name : ema->paramNames()) {
        entries.push_back({"ema/" + ema->stateName(d) + "/" + name, ema->spec(name), ema->emaShard(d, name)});
      }
    }
  }
  return entries;
}

std::map<std::string, std::string> emaAliases(const ema::ShardedModelEMAManager* ema) {
  std::map<std::string, std::string> aliases;
  if (!ema) return aliases;
  for (size_t d = 0; d < ema->numDecays(); ++d) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%g", ema->options().decays[d]);
    aliases[ema->options().prefix + "_" + buf] = "ema/" + ema->stateName(d) + "/";
  }
  return aliases;
}

std::string countersToJson(const TrainerCounters& c) {
  nlohmann::json j = {{"step", c.step},
                      {"global_batch", c.globalBatch},
                      {"seed", c.seed},
                      {"ema_updates", c.emaUpdates},
                      {"skipped_steps", c.skippedSteps},
                      {"optimizer_steps", c.optimizerSteps},
                      {"strategy", c.strategy},
                      {"world_size", c.worldSize},
                      {"resolved_config", c.resolvedConfig}};
  return j.dump(2);
}

TrainerCounters countersFromJson(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(strCat("trainer state: not valid JSON: ", e.what()));
  }
  auto get = [&](const char* key) -> const nlohmann::json& {
    if (!j.is_object() || !j.contains(key)) throw Error(strCat("trainer state: missing key '", key, "'"));
    return j.at(key);
  };
  TrainerCounters c;
  try {
    c.step = get("step").get<int64_t>();
    c.globalBatch = get("global_batch").get<int64_t>();
    c.seed = get("seed").get<int64_t>();
    c.emaUpdates = get("ema_updates").get<int64_t>();
    c.skippedSteps = get("skipped_steps").get<int64_t>();
    c.optimizerSteps = get("optimizer_steps").get<std::map<std::string, int64_t>>();
    c.strategy = get("strategy").get<std::string>();
    c.worldSize = get("world_size").get<int>();
    c.resolvedConfig = get("resolved_config").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    throw Error(strCat("trainer state: wrong type: ", e.what()));
  }
  return c;
}

}  // namespace tessera::trainer
