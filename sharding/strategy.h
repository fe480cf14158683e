// ShardingStrategy: the one interface every data-parallel strategy implements
// (no_shard, zero1, zero2 here; zero3 and hybrid with fullyShard), and the parts of a
// training step they all share (ARCHITECTURE.md §3, "ZeRO stages on the same machinery").
//
// A strategy owns, per trainable parameter (named as module.named_parameters() names
// it): a ShardSpec over the strategy's shard group, the fp32 master buffer laid out by
// that spec (which the ShardedOptimizer updates), and the optimizer states (same spec).
// The module keeps computing with its own parameter tensors, in `param dtype`; they are
// the same tensor objects for the whole run (their data may be replaced once, at
// construction: cast to param dtype, or moved into padded storage).
//
// Use, on every rank, in the same order:
//
//   auto strategy = makeStrategy(*model, comm, options);  // broadcasts rank 0's state
//   for (...) {
//     strategy->zeroGrad();
//     loss(model->forward(localBatch)).backward();        // mean over the local batch
//     StepResult r = strategy->step(schedule.lrAt(step)); // collective
//   }
//
// Initialisation: every rank may build its model with the same seed, but identity is
// guaranteed by the constructor, which broadcasts rank 0's parameters and buffers (so
// ranks that seeded differently, or loaded different files, still start identical).
//
// step() is a template method: synchronizeGradients() (strategy specific: all-reduce,
// reduce-scatter, or the flush of what zero3's backward hooks already reduced), then
// the shared clip / non-finite check / optimizer step, then publishParameters()
// (strategy specific: all-gather for zero1/2, a cast for replicated mixed precision,
// nothing for zero3 whose next forward gathers), then the buffer synchronisation.
//
// How zero3 and hybrid plug in (issue 5, sharding/fully_shard.h): FullyShardStrategy
// derives from this class. Its constructor takes the module's units (marked with
// fullyShard, or by name from StrategyOptions::wrap in makeStrategy), registers every
// parameter with a Shard(0) spec whose master is the unit's local shard (a FlatLayout
// slot, so one all-gather per unit rebuilds it), and frees the full parameters; the
// units' forward (unitForward) and autograd hooks unshard, reshard and reduce-scatter
// each unit into heldGradShards_ during backward. Its synchronizeGradients() flushes
// what the hooks left pending and returns the gradient shards; publishParameters()
// reshards every unit, so the next forward gathers the updated masters (cast to the
// compute dtype inside the gather). hybrid reduce-scatters in its shard group and
// all-reduces the gradient shards over the replica group. The step template, clipping,
// non-finite skip, optimizer, buffer sync, state accessors and byte accounting are
// shared unchanged.
//
// Gradient averaging: each rank's loss is the mean over its local batch, gradients are
// averaged over ranks (divided by N exactly once), so equal local batches give the
// gradient of the mean loss over the global batch.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "sharding/shard_spec.h"
#include "sharding/sharded_optimizer.h"

namespace torch::nn {
class Module;
}

namespace tessera::distributed {
class Communicator;
}

namespace tessera::sharding {

enum class StrategyKind { kNoShard, kZero1, kZero2, kZero3, kHybrid };
// "no_shard" | "zero1" | "zero2" | "zero3" | "hybrid"; tessera::ConfigError otherwise.
StrategyKind parseStrategyKind(const std::string& name);
const char* strategyKindName(StrategyKind kind);

// How module buffers (BatchNorm running statistics) stay identical across ranks. Every
// rank's forward updates its own buffers from its local batch; after each step they are
// made equal again, so the next forward, evaluation and checkpoints agree.
enum class BufferSync {
  kBroadcast,  // rank 0's buffers, as DDP's broadcast_buffers (default)
  kAverage,    // floating buffers averaged over ranks (integer ones: rank 0's)
  kNone,       // left alone (the user keeps them consistent, or the model has none)
};
// "broadcast" | "average" | "none"; tessera::ConfigError otherwise.
BufferSync parseBufferSync(const std::string& name);
const char* bufferSyncName(BufferSync sync);

// zero3 / hybrid only (FullyShardStrategy, sharding/fully_shard.h).
struct FullyShardOptions {
  // Free each unit's full parameters after its forward (ZeRO-3: gather again in backward);
  // false keeps them until the unit's gradients are reduced (fewer bytes sent, more held).
  bool reshardAfterForward = true;
  // Units whose all-gather is issued ahead of use (forward order, then reverse order in
  // backward); 0 = gather each unit only when it is needed.
  int prefetch = 1;
  // Recompute each non-root unit's forward during backward instead of keeping its
  // activations (the unit is gathered again for the recompute). Units with it must not
  // contain other units. Dropout etc. see the same CPU RNG state in the recompute.
  bool activationCheckpointing = false;
  // Hybrid (HSDP): shard over groups of `shardSize` consecutive ranks, all-reduce the
  // reduced gradient shards across the replica groups. 0 = the whole world (zero3).
  int shardSize = 0;
};

struct StrategyOptions {
  std::string strategy = "no_shard";      // no_shard | zero1 | zero2 | zero3 | hybrid
  int64_t bucketBytes = 25 * 1024 * 1024; // gradient bucket size, in reduce-dtype bytes
  at::ScalarType paramDtype = at::kFloat; // compute dtype of the module: fp32, bf16, fp16
  at::ScalarType reduceDtype = at::kFloat;// dtype gradients are reduced in: fp32, bf16, fp16
  OptimizerOptions optimizer;             // the sharded optimizer over the fp32 masters
  double gradClip = 0.0;                  // max global grad norm; 0 = no clipping
  std::string bufferSync = "broadcast";   // broadcast | average | none
  FullyShardOptions fullyShard;           // zero3 / hybrid
  // zero3 / hybrid: submodules makeStrategy marks as units by qualified name
  // (fullyShardByName: "blocks.*" = every child of blocks); empty = only those the
  // caller marked with fullyShard(), plus the root.
  std::vector<std::string> wrap;
};

struct StepResult {
  double gradNorm = 0.0;  // global L2 norm of the averaged gradients, before clipping
  double clipCoef = 1.0;  // factor the gradients were scaled by (1 = not clipped)
  bool skipped = false;   // the norm was not finite: gradients dropped, nothing applied
};

// Bytes of tensor storage live on this rank, by role. Measured, not computed: the sum of
// storage nbytes of the distinct storages the module and the strategy hold (a storage
// shared by two roles, e.g. a master aliasing the module's parameter, counts once,
// under the first role listed here). Padding is included, since it is held.
struct ResidentBytes {
  int64_t params = 0;     // the module's parameters (compute copies; fp32 masters when aliased)
  int64_t grads = 0;      // the module's .grad() tensors + gradient shards the strategy holds
  int64_t optimizer = 0;  // optimizer states + fp32 masters held apart from the parameters
  int64_t buffers = 0;    // the module's buffers
  int64_t total() const { return params + grads + optimizer + buffers; }
  std::string str() const;
};

class ShardingStrategy {
 public:
  virtual ~ShardingStrategy();
  ShardingStrategy(const ShardingStrategy&) = delete;
  ShardingStrategy& operator=(const ShardingStrategy&) = delete;

  StrategyKind kind() const { return kind_; }
  const StrategyOptions& options() const { return options_; }
  distributed::Communicator& comm() const { return *comm_; }
  // The group spec(), masterShard() and optimizerState() are laid out over: comm(), or
  // hybrid's shard group (each replica group then holds the same shards).
  distributed::Communicator& stateComm() const { return *shardComm_; }
  const std::shared_ptr<distributed::Communicator>& stateCommPtr() const { return shardComm_; }
  // True on the ranks of the first replica group (every rank but hybrid's others): their
  // state is all of it, so checkpoints and exports are written over stateComm() by them
  // alone (shard groups are consecutive ranks, the first holds ranks 0..shard size-1).
  bool firstReplica() const;

  // Drops all gradients: the module's .grad() become undefined (their memory is freed,
  // torch's set_to_none) and gradient shards the strategy holds are released.
  virtual void zeroGrad();

  // One optimizer step from the gradients the module accumulated since the last
  // zeroGrad() (several backward passes accumulate, as in torch). Collective: every rank
  // calls it after its backward. Gradients are averaged over ranks, clipped to
  // options().gradClip by global norm, and applied to the fp32 masters with learning
  // rate `lr`; the module's parameters are then updated everywhere and its buffers
  // synchronised. A non-finite global norm skips the update on every rank: the result
  // says so, the gradients are dropped, parameters and optimizer states are untouched.
  StepResult step(double lr);

  // Rewrites the module's parameters from the fp32 masters (collective). step() does this
  // itself; call it after changing masters directly, e.g. restoring a checkpoint.
  virtual void publishParameters() = 0;

  // ---- State by parameter name, for EMA and checkpoints -------------------------------
  const std::vector<std::string>& paramNames() const { return names_; }
  bool hasParam(const std::string& name) const { return index_.count(name) > 0; }
  // Index of `name` in paramNames() and in optimizer() (tessera::Error when unknown).
  size_t paramIndex(const std::string& name) const;
  // Layout of the parameter's master, gradient and optimizer states on this rank
  // (Replicate for no_shard, Shard(0) over the shard group otherwise).
  const ShardSpec& spec(const std::string& name) const;
  // The fp32 master buffer (spec.localShape(), padding rows zero). Updated in place by
  // the optimizer; write into it (then publishParameters()) to restore a checkpoint.
  at::Tensor masterShard(const std::string& name) const;
  // Optimizer state `key` ("exp_avg", "exp_avg_sq", "momentum_buffer") of the parameter,
  // same layout as its master; undefined before its first step.
  at::Tensor optimizerState(const std::string& name, const std::string& key) const;
  // The module's parameter tensor (the compute copy).
  const at::Tensor& moduleParam(const std::string& name) const;
  ShardedOptimizer& optimizer() { return optimizer_; }
  const ShardedOptimizer& optimizer() const { return optimizer_; }

  // Steps applied and steps skipped for a non-finite gradient norm.
  int64_t stepsApplied() const { return stepsApplied_; }
  int64_t stepsSkipped() const { return stepsSkipped_; }

  // Storage bytes held right now (see ResidentBytes). Between step() and zeroGrad():
  // fp32 AdamW no_shard 16 Psi, zero1 8 Psi + 8 Psi/N, zero2 4 Psi + 12 Psi/N (+ padding).
  ResidentBytes residentBytes() const;

 protected:
  // Collects the trainable parameters (requires_grad) and the buffers of `module`,
  // validates the options, broadcasts rank 0's parameters (all, frozen included) and
  // buffers, and drops stale gradients. Derived constructors then register every
  // collected parameter (trainableParams()) with registerParam, in order.
  ShardingStrategy(torch::nn::Module& module, std::shared_ptr<distributed::Communicator> comm,
                   StrategyOptions options);

  // Registers a trainable parameter: its spec, and its fp32 master buffer (which may alias
  // the parameter's storage). Adds it to the optimizer (decay per defaultDecays).
  void registerParam(const std::string& name, const at::Tensor& param, ShardSpec spec, at::Tensor master);

  // Returns the averaged gradient of every registered parameter in its spec's local
  // layout (any floating dtype), in registration order; an undefined tensor skips that
  // parameter this step (the optimizer leaves it and its states alone). May keep
  // gradient shards in heldGradShards_.
  virtual std::vector<at::Tensor> synchronizeGradients() = 0;
  // Buffers: made equal across ranks per options().bufferSync (collective).
  void synchronizeBuffers();

  struct NamedParam {
    std::string name;
    at::Tensor param;
  };
  const std::vector<NamedParam>& trainableParams() const { return trainable_; }
  const at::Tensor& master(size_t i) const { return masters_.at(i); }
  const at::Tensor& param(size_t i) const { return params_.at(i); }
  const ShardSpec& specAt(size_t i) const { return specs_.at(i); }
  size_t paramCount() const { return params_.size(); }

  torch::nn::Module& module_;
  std::shared_ptr<distributed::Communicator> comm_;  // the world: broadcasts, buffers
  // The group the Shard(0) specs shard over: the world here; hybrid's shard group. The
  // gradient-norm all-reduce runs over it (replica groups hold equal gradients).
  std::shared_ptr<distributed::Communicator> shardComm_;
  StrategyOptions options_;
  StrategyKind kind_;
  BufferSync bufferSync_;
  // Gradient storage the strategy keeps between step() and zeroGrad() (zero2's shards).
  std::vector<at::Tensor> heldGradShards_;
  // Parameter storage the strategy keeps besides the module's parameters and the masters
  // (zero3's local compute shards); counted as parameters by residentBytes().
  std::vector<at::Tensor> heldParamShards_;

 private:
  std::vector<NamedParam> trainable_;  // collected at construction
  std::vector<at::Tensor> buffers_;
  // Registered parameters, by index.
  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;
  std::vector<ShardSpec> specs_;
  std::vector<at::Tensor> masters_;
  std::unordered_map<std::string, size_t> index_;
  ShardedOptimizer optimizer_;
  int64_t stepsApplied_ = 0;
  int64_t stepsSkipped_ = 0;
};

// Builds the strategy options.strategy names over `module`'s trainable parameters and
// the ranks of `comm`. Collective (broadcasts rank 0's state). no_shard, zero1 and zero2
// are DataParallelStrategy (data_parallel.h). zero3 and hybrid need fullyShard
// (sharded units of the module), which is not built yet: tessera::ConfigError saying so.
std::unique_ptr<ShardingStrategy> makeStrategy(torch::nn::Module& module,
                                               std::shared_ptr<distributed::Communicator> comm,
                                               const StrategyOptions& options);

}  // namespace tessera::sharding
