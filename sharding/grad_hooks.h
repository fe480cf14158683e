// Autograd hook points the strategies reduce gradients from while backward still runs:
// "this parameter's gradient is accumulated" and "this backward pass is over". Shared by
// zero3's units (fully_shard.cpp) and the buckets of no_shard/zero2 (data_parallel.cpp).
//
// Tried on LibTorch 1.13 and 2.x: a FunctionPostHook on the parameter's gradient
// accumulator runs after param.grad() holds the accumulated gradient (once per backward,
// after all of the parameter's contributions are summed); Engine::queue_callback, called
// from inside a backward hook, runs once the whole backward has finished.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace tessera::sharding {

class GradReadyHooks {
 public:
  GradReadyHooks() = default;
  ~GradReadyHooks();  // removes every hook added
  GradReadyHooks(const GradReadyHooks&) = delete;
  GradReadyHooks& operator=(const GradReadyHooks&) = delete;

  // Calls `ready` each time autograd has accumulated `param`'s gradient (param must
  // require grad). The parameter holds its accumulator only weakly, and a new one would
  // not carry the hook, so this keeps it alive.
  void add(const at::Tensor& param, std::function<void()> ready);

 private:
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> keys_;
};

// From inside a backward hook: runs `fn` once the backward pass in progress has finished.
void queueAtEndOfBackward(std::function<void()> fn);

}  // namespace tessera::sharding
