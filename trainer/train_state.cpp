// Checkpoint entries of a training run (see train_state.h).
#include "trainer/train_state.h"

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

}  // namespace tessera::trainer
