// EMA registration over a sharding strategy, and evaluation with the EMA swapped in
// (see strategy_ema.h).
#include "ema/strategy_ema.h"

#include <c10/core/GradMode.h>

#include "sharding/strategy.h"

namespace tessera::ema {

void followStrategy(ShardedModelEMAManager& manager, const sharding::ShardingStrategy& strategy) {
  for (const dtensor::ShardedParam& p : strategy.params()) {
    if (p.trainable) manager.addParam(p.name, p.ownedSpec(), p.ownedMaster());  // a frozen one never changes
  }
  for (const auto& b : strategy.buffers()) manager.addBuffer(b.name, strategy.bufferSpec(b.tensor), b.tensor);
}

void withEmaWeights(ShardedModelEMAManager& manager, sharding::ShardingStrategy& strategy, size_t decayIndex,
                    const std::function<void()>& fn) {
  c10::NoGradGuard noGrad;
  std::vector<at::Tensor> buffers;
  for (const std::string& name : manager.bufferNames()) buffers.push_back(manager.liveBuffer(name));
  sharding::withValuesSwapped(
      buffers, [&](size_t i) { return manager.emaBuffer(decayIndex, manager.bufferNames()[i]); }, [] {},
      [&] {
        strategy.withSwappedParameters(
            [&](const dtensor::ShardedParam& p) {
              return manager.follows(p.name) ? manager.emaShard(decayIndex, p.name) : at::Tensor();
            },
            fn);
      });
}

}  // namespace tessera::ema
