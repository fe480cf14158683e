// Connects a ShardedModelEMAManager to a ShardingStrategy: the EMA follows the rows of
// each parameter's fp32 master that this rank owns (ShardedParam::ownedSpec), and the
// module's buffers. A sharded master (zero1/zero2/zero3/hybrid) is followed shard for
// shard; a replicated master (no_shard) only in this rank's rows, so EMA memory per rank
// is 1/N of the model under every strategy and the update needs no communication.
#pragma once

#include <functional>

#include "ema/ema_manager.h"

namespace tessera::sharding {
class ShardingStrategy;
}

namespace tessera::ema {

// Registers every trainable parameter of `strategy` (in its order, under the module's
// parameter names) and every module buffer with `manager`. Frozen parameters are not
// averaged (their average is themselves): an EMA evaluation computes with their live
// values, and exports of the EMA do not hold them (export "model" does).
void followStrategy(ShardedModelEMAManager& manager, const sharding::ShardingStrategy& strategy);

// Runs `fn` without autograd (an evaluation, sampling) with the module computing from
// EMA `decayIndex`'s weights and buffers, and restores the live ones exactly afterwards,
// also when fn throws. Collective over the strategy's ranks (see
// ShardingStrategy::withSwappedParameters: no rank holds more than one full tensor at a
// time beyond what the strategy itself holds).
void withEmaWeights(ShardedModelEMAManager& manager, sharding::ShardingStrategy& strategy, size_t decayIndex,
                    const std::function<void()>& fn);

}  // namespace tessera::ema
