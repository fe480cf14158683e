// Finding the FullyShardState that holds a parameter or a module (see unit_storage.h).
#include "sharding/unit_storage.h"

#include <torch/nn/module.h>

namespace tessera::sharding {

FullyShardState* stateOf(const at::Tensor& param) {
  if (!param.defined() || !param.has_storage()) return nullptr;
  const auto* allocator = dynamic_cast<const UnitStorageAllocator*>(param.storage().unsafeGetStorageImpl()->allocator());
  return allocator != nullptr ? allocator->owner() : nullptr;
}

FullyShardState* stateOf(const torch::nn::Module& module) {
  for (const at::Tensor& p : module.parameters(/*recurse=*/true)) return stateOf(p);
  return nullptr;
}

}  // namespace tessera::sharding
