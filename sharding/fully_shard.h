// FullyShardStrategy: ZeRO-3 in the FSDP2 way (docs/design.md, "FSDP unit lifecycle").
// Parameters live only as fp32 Shard(0) master shards between uses; each unit (e.g. one
// transformer block, plus the root holding the remaining parameters) is all-gathered just
// before it runs and freed right after.
//
// Use, on every rank, in the same order:
//
//   options.wrap = {"blocks.*"};                        // the units, by module name
//   FullyShardStrategy engine(*model, comm, options);   // the root: model
//   // the model enters itself and every unit through unitForward in its forward:
//   //   h = unitForward(*block, h, [&](const at::Tensor& x) { return block->forward(x); });
//   for (...) {
//     engine.zeroGrad();
//     at::Tensor y = unitForward(*model, x, [&](const at::Tensor& in) { return model->forward(in); });
//     loss(y).backward();            // hooks gather, reduce-scatter and free, unit by unit
//     engine.step(lr);               // the shared ShardingStrategy step (clip, optimizer)
//   }
//
// Why unitForward: LibTorch modules have no forward hooks and their forward() is not
// virtual, so the model itself routes each unit's call through unitForward. It is a plain
// call when the module is not a unit (any other strategy), so one model source serves all
// five strategies, and parameter names stay those of the plain model (checkpoints and EMA
// see the same names whatever the strategy).
//
// [Note: where a unit lives] The strategy owns its units; there is no process-wide
// registry. FSDP2 attaches its state to the module it shards, but a C++ module cannot
// hold extra state, so unitForward finds a module's strategy through the module's
// parameters: the strategy gives each parameter's storage its own allocator (which
// allocates through the storage's original one when the unit is gathered, and knows its
// strategy). That works for frozen parameters too, which have no autograd hooks. The
// strategy then looks the module up among its own units. Strategies over two models
// therefore never see each other's units, a parameter is held by at most one live
// strategy (a second one over it is refused), and a destroyed strategy gives the storages
// their allocator back and leaves plain modules behind (their parameters freed).
//
// Unit lifecycle (per unit, one flat buffer, rank-major FlatLayout):
//   unshard   this rank's fp32 master chunk is cast into chunk r of a flat buffer in
//             paramDtype, ONE allGatherInto, then each parameter's storage (freed while
//             sharded) is regrown and its real rows copied out of the flat buffer, which is
//             then dropped (FSDP2's copy-out). The flat buffer cannot simply become the
//             parameters' storage: rank-major chunks interleave the parameters, and a
//             parameter-major layout would break the per-parameter ShardSpec that the
//             optimizer, EMA and checkpoints share.
//   reshard   each parameter's storage is resized to 0 bytes (at::native::resize_bytes_cpu):
//             the tensor objects (TensorImpl) stay the same for the whole run, so the
//             references autograd saved stay valid and see the regrown storage. Copies go
//             through variable_data() (own version counter), so they never trip autograd's
//             saved-variable version check.
//   forward   pre: wait for the prefetched gather (or gather now), then issue the gathers of
//             the next `prefetch` units in the recorded forward order. post: reshard when
//             reshardAfterForward (always in no-grad mode; in grad mode never the root,
//             whose backward follows at once, as in FSDP2, nor the unit the backward
//             enters first: the last one of the previous forward's order, when it is a
//             child of the root with trainable parameters; a second forward before the
//             backward, or one in another order, reshards it first),
//             and register a hook on every
//             output that requires grad, which re-gathers the unit before autograd enters
//             it in backward and prefetches the next units in reverse forward order.
//   backward  an AccumulateGrad post hook per trainable parameter; when all of a unit's
//             trainable parameters have their gradient, the unit is resharded first (one
//             unit less at the peak; not if it holds a frozen parameter, whose last use
//             no gradient signals: it waits for the end of backward), then the gradients
//             are packed (cast to reduceDtype) into a flat buffer, the full gradients are
//             freed (.grad() reset) and one async reduce-scatter (kAvg: the one division by
//             N) is issued. Frozen parameters take no part in it. The reduced chunk is
//             added into the unit's fp32 gradient shard, which accumulates over
//             micro-batches until zeroGrad(). A callback queued on
//             the autograd engine runs at the end of every backward: it reduces the units
//             whose gradients did not all arrive (parameters that got no gradient, units
//             not reached), with zeros for missing gradients, waits for every
//             reduce-scatter and reshards whatever is still gathered. Each unit is reduced
//             exactly once per synchronised backward.
//   no sync   setRequiresGradientSync(false): backward keeps the full gradients in .grad()
//             (accumulating as torch does) and only reshards the parameters; the next
//             synchronised backward (or step()) reduces the sum once.
//
// Requirements (as FSDP's): every rank runs the same units in the same order, and the same
// parameters get gradients on every rank (collectives are issued from hooks, so their order
// follows the autograd graph). The root is entered through unitForward at depth 0; every
// other unit runs inside it. Tied parameters (one tensor under two names) are rejected.
//
// Frozen parameters (requires_grad false, e.g. a teacher) are sharded like the others and
// gathered with their unit, so they cost 1/N per rank between uses; they have no gradient
// and take no part in the reduce-scatter (a unit reduces the flat gradients of its
// trainable parameters only).
//
// Deferred parameters (sharding/param_init.h) are never materialised in full: each rank
// fills its master rows from StrategyOptions::initializer.
//
// Memory (measured by unshardedParamBytes()): with reshardAfterForward, the forward holds
// the root, the running unit and at most `prefetch` units in flight: (prefetch + 1) units
// + root, because the next gathers are issued only after the running unit's flat buffer is
// dropped. One exception: while a unit's parameters are copied out of its gather buffer it
// is held twice for that moment, so prefetch 0 peaks at 2 units + root, not 1. The unit
// kept from forward into backward is the running unit of the forward's end and of the
// backward's start: it adds nothing to that peak.
// Between steps a rank holds fp32 masters, gradient shards and AdamW moments of
// 16 Psi/N bytes (+ padding), and no full parameter.
//
// Comm per step and rank (ring model of the communicator): all-gather of every unit in
// forward, again in backward when reshardAfterForward (all but the root and the unit the
// backward enters first), one reduce-scatter: (3 Psi' - Psi'_root - Psi'_last) (N-1)/N
// elements from the second step on (2 Psi' (N-1)/N without resharding
// after forward), Psi' = Psi + padding; plus
// one double all-reduced for the gradient norm.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "sharding/strategy.h"

namespace torch::nn {
class Module;
}

namespace tessera::sharding {

// Runs a unit's forward: pre-forward unshard, fn, post-forward reshard and backward hooks.
// A module that is not a unit of a live FullyShardStrategy: just fn(inputs). Non-tensor
// arguments go into fn's captures (they must be the same when activation checkpointing
// recomputes the forward).
using UnitFunction = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
std::vector<at::Tensor> unitForward(torch::nn::Module& module, const std::vector<at::Tensor>& inputs,
                                    const UnitFunction& fn);
at::Tensor unitForward(torch::nn::Module& module, const at::Tensor& input,
                       const std::function<at::Tensor(const at::Tensor&)>& fn);

// Whether a live FullyShardStrategy holds `param` (its storage is the strategy's).
bool heldByFullyShard(const at::Tensor& param);

class FullyShardStrategy final : public ShardingStrategy {
 public:
  // options.strategy: zero3 or hybrid (tessera::ConfigError otherwise). Collective over
  // `comm`: broadcasts rank 0's parameters, shards them, frees the full parameters. The
  // units are `module` (the root) and the submodules options.wrap names (ConfigError for
  // a pattern that matches none). The module's parameters are on the CPU, or on one CUDA
  // device in a build with CUDA LibTorch. fsdp.shardSize must divide the world size
  // (hybrid; zero3 ignores it): the ranks form a replicate x shard DeviceMesh.
  FullyShardStrategy(torch::nn::Module& module, std::shared_ptr<distributed::Communicator> comm,
                     StrategyOptions options, FullyShardOptions fsdp);
  // The same with options.fullyShard.
  FullyShardStrategy(torch::nn::Module& module, std::shared_ptr<distributed::Communicator> comm,
                     const StrategyOptions& options)
      : FullyShardStrategy(module, std::move(comm), options, options.fullyShard) {}
  ~FullyShardStrategy() override;

  const FullyShardOptions& fsdpOptions() const { return fsdp_; }

  // Reshards every unit (the next forward gathers the updated masters; casting to the
  // compute dtype happens in the gather). Collective only through the waits of gathers
  // already in flight.
  void publishParameters() override;
  void zeroGrad() override;

  // false: backward accumulates unsharded gradients and does not communicate (micro-batches
  // before the last); true (default): every backward reduce-scatters into the gradient
  // shards. step() reduces whatever is still unsharded, so no gradient is lost.
  void setRequiresGradientSync(bool sync) override { sync_ = sync; }

  // Swaps the masters (the owned layout is theirs) and reshards: fn's forward gathers the
  // swapped values; restored and resharded afterwards.
  void withSwappedParameters(const std::function<at::Tensor(const ShardedParam&)>& ownedValue,
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
  // full values, e.g. for an evaluation or export outside unitForward. Collective.
  void gatherFullParameters();

  // Measured: storage bytes of all units' full parameters plus gather buffers alive now.
  int64_t unshardedParamBytes() const;
  // Largest unshardedParamBytes() seen since resetPeak(), sampled at every gather issue,
  // copy-out and reshard.
  int64_t peakUnshardedParamBytes() const { return peak_; }
  void resetPeak() { peak_ = unshardedParamBytes(); }

  // ---- called by units and hooks (fully_shard.cpp) ----------------------------------
  struct Internal;

 protected:
  void synchronizeGradients() override;

 private:
  friend struct Internal;
  FullyShardOptions fsdp_;
  std::shared_ptr<distributed::Communicator> replicaComm_;  // hybrid: across replica groups
  bool sync_ = true;
  int64_t peak_ = 0;
  std::unique_ptr<Internal> in_;
};

}  // namespace tessera::sharding
