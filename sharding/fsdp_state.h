// FullyShardState: the state a FullyShardStrategy shares over its units (FSDP2's FSDPState
// of the root with its comm context) — the units, the order the last forward ran them in,
// and the events that order drives: prefetching the next gathers in forward and backward,
// keeping the unit the backward enters first gathered, reducing gradients as they arrive,
// and the end of every backward. Each unit's own lifecycle is FsdpUnit's (fsdp_unit.h).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include "sharding/fsdp_unit.h"
#include "sharding/inflight.h"
#include "sharding/unit.h"

namespace tessera::sharding {

class GradReadyHooks;
class UnitStorageAllocator;
struct FullyShardOptions;

// One more in `counter` for the guard's scope: the depths FullyShardState counts (units
// entered, checkpointed forwards, recomputes).
struct CounterGuard {
  int& c;
  explicit CounterGuard(int& counter) : c(counter) { ++c; }
  ~CounterGuard() { --c; }
  CounterGuard(const CounterGuard&) = delete;
  CounterGuard& operator=(const CounterGuard&) = delete;
};

class FullyShardState {
 public:
  FullyShardState(const FullyShardOptions& options, UnitContext context);
  ~FullyShardState();
  FullyShardState(const FullyShardState&) = delete;
  FullyShardState& operator=(const FullyShardState&) = delete;

  // ---- construction ------------------------------------------------------------------
  // A unit for `module` (the root last); the state owns it.
  FsdpUnit& addUnit(std::string name, const torch::nn::Module* module, bool isRoot);
  // Once every unit has its records: the gradient hooks, the map from modules to units,
  // and the cap on reduce-scatters in flight.
  void finishUnits();
  // Makes every parameter storage allocate through this state's allocator, which marks it
  // as held (see unit_storage.h). Last: nothing may throw after it.
  void claimStorages();
  // run.deterministic (UnitContext::gradientsApart), for every unit.
  void keepGradientsApart() { context_.gradientsApart = true; }

  // ---- the events --------------------------------------------------------------------
  // Runs unit `u`'s forward (fn on its inputs) between its pre- and post-forward, with the
  // prefetch and the pre-backward hooks on its outputs.
  std::vector<at::Tensor> runUnit(FsdpUnit& u, const std::vector<at::Tensor>& inputs, const UnitFunction& fn);
  // Reduces what a backward left (a step after backwards without gradient sync), in unit
  // order, and waits for every reduction.
  void reduceRemaining();
  // Waits for every reduction in flight.
  void drainReductions();

  // ---- what the strategy asks --------------------------------------------------------
  const std::vector<std::unique_ptr<FsdpUnit>>& units() const { return units_; }
  // The unit of `module`, or null when it is none of this state's.
  FsdpUnit* unitOf(const torch::nn::Module& module) const;
  void setGradientSync(bool sync) { sync_ = sync; }
  // false: the root stays gathered after backward (ShardingStrategy::setReshardAfterBackward).
  void setReshardRootAfterBackward(bool reshard) { reshardRootAfterBackward_ = reshard; }
  int64_t unshardedBytes() const;
  int64_t peakBytes() const { return peak_; }
  void resetPeak() { peak_ = unshardedBytes(); }
  void sample();
  // The gradient shards alive now (the strategy counts them as held).
  std::vector<at::Tensor> gradShards() const;

  // Called at the end of every backward (the strategy refreshes what it counts as held).
  std::function<void()> onBackwardEnd;

  // Activation checkpointing (activation_checkpoint.cpp): nesting counters.
  int checkpointedForwardDepth = 0;  // inside a checkpointed unit's forward
  int recomputeDepth = 0;            // inside a recompute's nested backward

 private:
  void enterForward(FsdpUnit& u, size_t position);
  void exitForward(FsdpUnit& u, size_t position, bool grad, const std::vector<at::Tensor>& outputs);
  void finishRootForward(bool grad);
  void reshardKeptUnits(const FsdpUnit* except);
  void preBackward(FsdpUnit& u);
  void onGradReady(FsdpUnit& u, size_t j);
  void reduce(FsdpUnit& u);
  void queueEndOfBackward();
  void endBackward();
  // Whether `u`'s parameters are freed when its backward is over.
  bool reshardsAfterBackward(const FsdpUnit& u) const { return reshardRootAfterBackward_ || !u.isRoot(); }

  const FullyShardOptions& options_;
  UnitContext context_;
  std::vector<std::unique_ptr<FsdpUnit>> units_;  // the root last
  std::unordered_map<const torch::nn::Module*, FsdpUnit*> byModule_;
  std::vector<FsdpUnit*> currentOrder_;   // units entered in the running forward
  std::vector<FsdpUnit*> forwardOrder_;   // of the last completed forward
  std::vector<FsdpUnit*> backwardOrder_;  // its reverse, each unit once, no root
  // The unit the backward enters first, kept gathered from its forward into its backward:
  // the last one the previous forward entered, when it is a child of the root with
  // trainable parameters (null otherwise).
  FsdpUnit* keptUnit_ = nullptr;
  int forwardDepth_ = 0;  // units entered and not yet left: 1 inside the root only
  bool endOfBackwardQueued_ = false;
  bool sync_ = true;
  bool reshardRootAfterBackward_ = true;
  int64_t peak_ = 0;
  InflightCollectives<ReduceJob> pending_;
  std::unique_ptr<UnitStorageAllocator> storageAllocator_;
  std::unique_ptr<GradReadyHooks> gradHooks_;
  // Output hooks hold a weak reference: a graph outliving the state does nothing.
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);
};

}  // namespace tessera::sharding
