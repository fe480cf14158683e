// Connects a ShardedModelEMAManager to a ShardingStrategy: the EMA follows each
// parameter's fp32 master, shard for shard. A sharded master (zero1/zero2/zero3) is
// followed with its own spec; a replicated master (no_shard) is followed only in this
// rank's rows (a Shard(0) spec over the strategy's group), so EMA memory per rank is
// 1/N of the model under every strategy and the update needs no communication.
#pragma once

#include "ema/ema_manager.h"

namespace tessera::sharding {
class ShardingStrategy;
}

namespace tessera::ema {

// Registers every trainable parameter of `strategy` with `manager` (in the strategy's
// order, under the module's parameter names).
void followStrategy(ShardedModelEMAManager& manager, sharding::ShardingStrategy& strategy);

}  // namespace tessera::ema
