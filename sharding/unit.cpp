// Entering a unit's forward (see unit.h): finds the FullyShardState holding the module
// through its parameters' storage (unit_storage.h) and runs the unit there.
#include "sharding/unit.h"

#include "sharding/fsdp_state.h"
#include "sharding/unit_storage.h"

namespace tessera::sharding {

std::vector<at::Tensor> unitForward(torch::nn::Module& module, const std::vector<at::Tensor>& inputs,
                                    const UnitFunction& fn) {
  FullyShardState* state = stateOf(module);
  FsdpUnit* unit = state != nullptr ? state->unitOf(module) : nullptr;
  if (unit == nullptr) return fn(inputs);  // no strategy, or a plain submodule of some unit
  return state->runUnit(*unit, inputs, fn);
}

at::Tensor unitForward(torch::nn::Module& module, const at::Tensor& input,
                       const std::function<at::Tensor(const at::Tensor&)>& fn) {
  return unitForward(module, std::vector<at::Tensor>{input}, [fn](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{fn(in[0])};
  })[0];
}

bool isLiveUnit(const torch::nn::Module& module) {
  const FullyShardState* state = stateOf(module);
  return state != nullptr && state->unitOf(module) != nullptr;
}

bool heldByFullyShard(const at::Tensor& param) { return stateOf(param) != nullptr; }

}  // namespace tessera::sharding
