// The trainer's sharded state as checkpoint entries (its counters: train_counters.h).
//
// Entry names (the checkpoint's tensor names; exports strip the prefix back to the
// user's module names), each collected from the part that owns the state:
//   model/<param>, model/<buffer>  the strategy: fp32 masters (Shard(0) or Replicate), buffers
//   optim/<state>/<param>          the optimizer: exp_avg, exp_avg_sq, momentum_buffer
//   optim/step/<param>             the optimizer: its step count (int64, replicated)
//   ema/<ema name>/<param>         the EMA: generator_ema, generator_ema_0.999, ...
// Loading the same names with the new run's specs reshards them (any world size, any
// strategy).
#pragma once

#include <vector>

#include "checkpoint/state.h"
#include "trainer/train_counters.h"

namespace tessera::sharding {
class ShardingStrategy;
}
namespace tessera::ema {
class ShardedModelEMAManager;
}

namespace tessera::trainer {

// All tensors of the run's state on this rank (`ema` may be null). The optimizer creates
// zero states for parameters it has not stepped yet, so every rank lists the same entries.
std::vector<checkpoint::StateEntry> collectStateEntries(sharding::ShardingStrategy& strategy,
                                                        ema::ShardedModelEMAManager* ema);

}  // namespace tessera::trainer
