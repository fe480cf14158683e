// Where a unit lives ([Note: where a unit lives], docs/design.md): FSDP2 attaches its state
// to the module it shards; a C++ module cannot hold extra state, so a FullyShardState
// marks the storage of every parameter it holds instead. Each such storage allocates
// through a UnitStorageAllocator, which forwards to the storage's own allocator (the CPU's,
// or CUDA's caching allocator) and knows its state. So any parameter, frozen ones included,
// leads to the state holding it, and from a module's parameters to its unit: no registry,
// two strategies never see each other's units, and a destroyed state gives the storages
// their allocator back.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <torch/version.h>

namespace torch::nn {
class Module;
}

namespace tessera::sharding {

class FullyShardState;

class UnitStorageAllocator final : public c10::Allocator {
 public:
  UnitStorageAllocator(FullyShardState* owner, c10::Allocator* inner) : owner_(owner), inner_(inner) {}
  // c10::Allocator::allocate is const in LibTorch 1.x and not in 2.x: one of these
  // overrides it (no `override`, so both compile).
  c10::DataPtr allocate(size_t bytes) const { return inner_->allocate(bytes); }
  c10::DataPtr allocate(size_t bytes) { return inner_->allocate(bytes); }
  c10::DeleterFnPtr raw_deleter() const override { return inner_->raw_deleter(); }
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  void copy_data(void* dest, const void* src, std::size_t count) const override { inner_->copy_data(dest, src, count); }
#endif
  FullyShardState* owner() const { return owner_; }
  c10::Allocator* inner() const { return inner_; }

 private:
  FullyShardState* owner_;
  c10::Allocator* inner_;
};

// The state holding `param` (null when none does).
FullyShardState* stateOf(const at::Tensor& param);
// The state whose unit `module` may be: every parameter under a state's root is held by
// it, so the first one decides (null for a module without parameters or held by none).
FullyShardState* stateOf(const torch::nn::Module& module);

}  // namespace tessera::sharding
