// Checkpoint entries and trainer-state JSON of a training run (see train_state.h).
#include "trainer/train_state.h"

#include <nlohmann/json.hpp>

#include "common/errors.h"
#include "ema/ema_manager.h"
#include "sharding/strategy.h"

namespace tessera::trainer {

std::vector<checkpoint::StateEntry> collectStateEntries(sharding::ShardingStrategy& strategy,
                                                        ema::ShardedModelEMAManager* ema) {
  std::vector<checkpoint::StateEntry> entries = strategy.stateEntries("model/");
  for (auto& e : strategy.optimizer().stateEntries("optim/")) entries.push_back(std::move(e));
  if (ema) {
    for (auto& e : ema->stateEntries("ema/")) entries.push_back(std::move(e));
  }
  return entries;
}

std::string countersToJson(const TrainerCounters& c) {
  nlohmann::json j = {{"step", c.step},
                      {"global_batch", c.globalBatch},
                      {"seed", c.seed},
                      {"ema_updates", c.emaUpdates},
                      {"skipped_steps", c.skippedSteps},
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
    c.strategy = get("strategy").get<std::string>();
    c.worldSize = get("world_size").get<int>();
    c.resolvedConfig = get("resolved_config").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    throw Error(strCat("trainer state: wrong type: ", e.what()));
  }
  return c;
}

}  // namespace tessera::trainer
