// EMA registration over a sharding strategy's masters (see strategy_ema.h).
#include "ema/strategy_ema.h"

#include "distributed/communicator.h"
#include "sharding/strategy.h"

namespace tessera::ema {

void followStrategy(ShardedModelEMAManager& manager, sharding::ShardingStrategy& strategy) {
  const int world = strategy.comm().worldSize(), rank = strategy.comm().rank();
  for (const auto& name : strategy.paramNames()) {
    const sharding::ShardSpec& spec = strategy.spec(name);
    at::Tensor master = strategy.masterShard(name);
    if (spec.placement() == sharding::Placement::kReplicate) {
      sharding::ShardSpec slice(spec.globalShape(), spec.dtype(), world, rank);
      auto [begin, end] = slice.localRowRange();
      manager.addParam(name, slice, master.reshape({slice.globalRows(), slice.rowNumel()}).narrow(0, begin, end - begin));
    } else {
      manager.addParam(name, spec, master);
    }
  }
}

}  // namespace tessera::ema
