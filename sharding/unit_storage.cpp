// Finding the FullyShardState that holds a parameter or a module (see unit_storage.h).
#include "sharding/unit_storage.h"

#include <torch/nn/module.h>

namespace tessera::sharding {

FullyShardState* stateOf(const at::Tensor& param) {
  if (!param.defined() || !param.has_storage()) return nullptr;
  const auto* allocator = dynamic_cast<const UnitStorageAllocator*>(param.storage().unsafeGetStorageImpl()->allocator());
  return allocator != nullptr ? allocator->owner() : nullptr;
}

namespace {

// The first parameter under `module`, depth first as parameters() lists them, without
// collecting all of them (this runs at every unit's forward). Returned by value: the
// vectors parameters() and children() hand out are temporaries.
at::Tensor firstParameter(const torch::nn::Module& module) {
  for (const at::Tensor& p : module.parameters(/*recurse=*/false)) {
    if (p.defined()) return p;
  }
  for (const auto& child : module.children()) {
    at::Tensor p = firstParameter(*child);
    if (p.defined()) return p;
  }
  return {};
}

}  // namespace

FullyShardState* stateOf(const torch::nn::Module& module) {
  const at::Tensor p = firstParameter(module);
  return p.defined() ? stateOf(p) : nullptr;
}

}  // namespace tessera::sharding
