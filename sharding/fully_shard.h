// FullyShardStrategy: ZeRO-3 in the FSDP2 way, and fullyShard(), its FSDP2-shaped entry
// point. Parameters live only as fp32 Shard(0) master shards between uses; each unit (the
// model's sharding::Unit modules, or the modules StrategyOptions::wrap names, plus the root
// holding the rest) is all-gathered just before it runs and freed right after:
//
//   sharding::Unit<Net> net(...);                   // blocks declared as sharding::Unit (unit.h)
//   auto fsdp = sharding::fullyShard(*net, comm);   // collective: broadcasts, shards, frees
//   for (...) {
//     fsdp->zeroGrad();
//     loss(net->forward(x)).backward();             // units gather, reduce-scatter and free
//     fsdp->step(lr);                               // or fsdp->step(myTorchOptimizer)
//   }
//
// The parts: a unit's lifecycle in fsdp_unit.h, the order of events over the units
// (prefetch, backward) in fsdp_state.h, unit discovery in unit_discovery.h, activation
// checkpointing in activation_checkpoint.h. The lifecycle, its memory and communication
// figures and the rules of what stays gathered: docs/design.md, "FSDP unit lifecycle".
// Requirements (as FSDP's): every rank runs the same units in the same order, and the same
// parameters get gradients on every rank; tied parameters are rejected.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "sharding/strategy.h"
#include "sharding/unit.h"

namespace torch::nn {
class Module;
}

namespace tessera::sharding {

class FsdpUnit;
class FullyShardState;
class HostOffload;

class FullyShardStrategy final : public ShardingStrategy {
 public:
  // options.strategy: zero3 or hybrid (tessera::ConfigError otherwise). Collective over
  // `comm`: broadcasts rank 0's parameters, shards them, frees the full parameters. The
  // module's parameters are on the CPU, or on one CUDA device in a build with CUDA
  // LibTorch. fsdp.shardSize must divide the world size (hybrid; zero3 ignores it): the
  // ranks form a replicate x shard DeviceMesh. fsdp.cpuOffload keeps the masters, the
  // gradient shards and the optimizer state in host memory (host_offload.h).
  FullyShardStrategy(torch::nn::Module& module, std::shared_ptr<distributed::Communicator> comm,
                     StrategyOptions options, FullyShardOptions fsdp);
  // The same with options.fullyShard.
  FullyShardStrategy(torch::nn::Module& module, std::shared_ptr<distributed::Communicator> comm,
                     const StrategyOptions& options)
      : FullyShardStrategy(module, std::move(comm), options, options.fullyShard) {}
  ~FullyShardStrategy() override;


  // Reshards every unit (the next forward gathers the updated masters; casting to the
  // compute dtype happens in the gather). Collective only through the waits of gathers
  // already in flight.
  void publishParameters() override;
  void zeroGrad() override;

  // false: backward accumulates unsharded gradients and does not communicate (micro-batches
  // before the last); true (default): every backward reduce-scatters into the gradient
  // shards. step() reduces whatever is still unsharded, so no gradient is lost.
  void setRequiresGradientSync(bool sync) override;
  void setReshardAfterBackward(bool reshard) override;

  // Swaps the masters (the owned layout is theirs) and reshards: fn's forward gathers the
  // swapped values; restored and resharded afterwards.
  void withSwappedParameters(const std::function<at::Tensor(const dtensor::ShardedParam&)>& ownedValue,
                             const std::function<void()>& fn) override;

  // Units, the root last. unitName(i) is the module's qualified name ("" for the root).
  size_t unitCount() const;
  const std::string& unitName(size_t i) const;
  // Names of the parameters unit i owns.
  std::vector<std::string> unitParamNames(size_t i) const;
  // Bytes of unit i's flat gather buffer (padded full parameters in paramDtype).
  int64_t unitGatherBytes(size_t i) const;
  // Bytes of unit i's full parameters in paramDtype (what its storages hold when gathered).
  int64_t unitParamBytes(size_t i) const;

  // Gathers every unit and leaves it gathered until its next reshard (the end of its next
  // forward or backward, or publishParameters()): the module's parameters then hold the
  // full values, e.g. for an evaluation or export outside the units' forwards. Collective.
  void gatherFullParameters();

  // Measured: storage bytes of all units' full parameters plus gather buffers alive now.
  int64_t unshardedParamBytes() const;
  // Largest unshardedParamBytes() seen since resetPeak(), sampled at every gather issue,
  // copy-out and reshard.
  int64_t peakUnshardedParamBytes() const;
  void resetPeak();

 protected:
  void synchronizeGradients() override;
  std::vector<GradGroup> gradGroups() const override;
  void keepGradientsInParameters() override;

 private:
  void setUpHybridGroups();
  void checkParameters() const;
  // The units (found by unit_discovery.h, the root last) and the collected index of each
  // one's parameters.
  std::vector<std::vector<size_t>> buildUnits();
  // Fills unit `u`'s master chunk from its members' values (this rank's rows of deferred
  // parameters from the initializer), and writes each member's master slot and spec into
  // `shards` at the member's collected index (sized for every collected parameter).
  void shardUnit(FsdpUnit& u, const std::vector<size_t>& members,
                 std::vector<std::pair<at::Tensor, dtensor::ShardSpec>>& shards) const;

  FullyShardOptions fsdp_;
  std::shared_ptr<distributed::Communicator> replicaComm_;  // hybrid: across replica groups
  std::unique_ptr<HostOffload> offload_;                    // fsdp_.cpuOffload; else null
  std::unique_ptr<FullyShardState> state_;
};

// FSDP2's fully_shard(model) for a root module declared sharding::Unit (UsageError
// otherwise: its forward is where the root's parameters are gathered): a
// FullyShardStrategy over `root` and the ranks of `comm` — zero3, or hybrid when
// options.strategy says so (the default "no_shard" means zero3 here) — its units the
// modules declared sharding::Unit (or options.wrap's, whose forwards must go through
// sharding::unitForward). Collective.
std::unique_ptr<FullyShardStrategy> fullyShard(torch::nn::Module& root, std::shared_ptr<distributed::Communicator> comm,
                                               StrategyOptions options = {});

}  // namespace tessera::sharding
