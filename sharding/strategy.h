// ShardingStrategy: the one interface every data-parallel strategy implements (no_shard,
// zero1, zero2 in data_parallel.h; zero3 and hybrid in fully_shard.h) and the parts of a
// step they share. The design — records, initialisation, the step as a template method,
// gradient averaging — is in docs/design.md, "Sharding".
//
// A strategy owns one ShardedParam record per parameter of its module (frozen ones too):
// the optimizer, the EMA, checkpoints and exports reach a parameter through it; it is a
// Stateful component of a checkpoint (its fp32 masters and buffers). Use, on every rank,
// in the same order:
//
//   auto strategy = makeStrategy(*model, comm, options);  // broadcasts rank 0's state
//   for (...) {
//     strategy->zeroGrad();
//     loss(model->forward(localBatch)).backward();        // mean over the local batch
//     strategy->step(schedule.lrAt(step));                // or step(torchOptimizer); collective
//   }
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/enum_names.h"
#include "dtensor/param_init.h"
#include "dtensor/shard_spec.h"
#include "dtensor/flat_layout.h"
#include "dtensor/sharded_param.h"
#include "dtensor/stateful.h"
#include "optim/sharded_optimizer.h"
#include "sharding/canonical_reduce.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace tessera::distributed {
class Communicator;
}

namespace tessera::sharding {

enum class StrategyKind { kNoShard, kZero1, kZero2, kZero3, kHybrid };
inline constexpr std::array<EnumName<StrategyKind>, 5> kStrategyKindNames = {{{"no_shard", StrategyKind::kNoShard},
                                                                              {"zero1", StrategyKind::kZero1},
                                                                              {"zero2", StrategyKind::kZero2},
                                                                              {"zero3", StrategyKind::kZero3},
                                                                              {"hybrid", StrategyKind::kHybrid}}};
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
inline constexpr std::array<EnumName<BufferSync>, 3> kBufferSyncNames = {
    {{"broadcast", BufferSync::kBroadcast}, {"average", BufferSync::kAverage}, {"none", BufferSync::kNone}}};

// zero3 / hybrid only (FullyShardStrategy, sharding/fully_shard.h).
struct FullyShardOptions {
  // Free each unit's full parameters after its forward (ZeRO-3: gather again in backward);
  // false keeps them until the unit's gradients are reduced (fewer bytes sent, more held).
  bool reshardAfterForward = true;
  // With reshardAfterForward: keep the unit the forward ran last gathered into its backward,
  // which enters it first (torchtitan's choice for the last block: no second gather of it),
  // at the cost of holding it while the loss runs; false frees it too (FSDP2's default: the
  // backward's prefetch gathers it again while the loss's backward runs).
  bool keepLastUnit = true;
  // Units whose all-gather is issued ahead of use (forward order, then reverse order in
  // backward); 0 = gather each unit only when it is needed.
  int prefetch = 1;
  // Recompute each non-root unit's forward during backward instead of keeping its
  // activations (the unit is gathered again for the recompute). Units with it must not
  // contain other units. Dropout etc. see the same CPU RNG state in the recompute.
  bool activationCheckpointing = false;
  // Wrapped modules (StrategyOptions::wrap) holding fewer parameters than this (counting
  // their submodules') are not units: their parameters stay with the enclosing unit. Tiny
  // units cost a collective each and save no memory worth having; 0 = every wrapped module.
  int64_t minUnitParams = 0;
  // Hybrid (HSDP): shard over groups of `shardSize` consecutive ranks, all-reduce the
  // reduced gradient shards across the replica groups. 0 = the whole world (zero3).
  int shardSize = 0;
  // CPU offload (FSDP2's CPUOffloadPolicy): fp32 masters, gradient shards and optimizer
  // state in host memory, the optimizer stepping there; each unit's shard copied to the
  // device for its gather, its reduced gradients copied back (sharding/host_offload.h).
  // For models on a GPU; on the CPU the masters are in host memory already.
  bool cpuOffload = false;
};

struct StrategyOptions {
  StrategyKind strategy = StrategyKind::kNoShard;
  int64_t bucketBytes = 25 * 1024 * 1024; // gradient bucket size, in reduce-dtype bytes
  at::ScalarType paramDtype = at::kFloat; // compute dtype of the module: fp32, bf16, fp16
  at::ScalarType reduceDtype = at::kFloat;// dtype gradients are reduced in: fp32, bf16, fp16
  optim::OptimizerOptions optimizer;             // the sharded optimizer over the fp32 masters
  double gradClip = 0.0;                  // max global grad norm; 0 = no clipping
  BufferSync bufferSync = BufferSync::kBroadcast;
  FullyShardOptions fullyShard;           // zero3 / hybrid
  // no_shard / zero1 / zero2: the consecutive ranks over which the owned rows (the masters and
  // optimizer state zero1/zero2 shard, what an EMA follows, what an evaluation swaps in) are
  // split, each such group holding all of them, as hybrid's shard groups hold its state;
  // stateComm() is then that group. 0: every rank (one group). tessera-train's fault.survive
  // sets it to the replica group, so that a lost group takes no rows that no other group holds.
  int stateGroupSize = 0;
  // zero3 / hybrid: the submodules that become units, by qualified name (named_modules()):
  // "blocks.*" = every direct child of blocks, "blocks.0" = that module. The root is
  // always a unit too (it gets the parameters no other unit holds); empty = the root only.
  std::vector<std::string> wrap;
  // The initial values of deferred parameters (required when the module has any).
  dtensor::ParamInitializer initializer;
};

// Values summed over all ranks in a step's own all-reduce (the gradient norm's), by name:
// the step's loss and this rank's stop request ride along without a collective of their
// own. Every rank adds the same names in the same order; one StepSums serves one step.
class StepSums {
 public:
  // Adds `value` to this rank's `name` (0 until the first add). UsageError after the step.
  void add(const std::string& name, double value);
  // After the step: the sum over all ranks (before it: this rank's). UsageError for a name
  // never added.
  double operator[](const std::string& name) const;

 private:
  friend class ShardingStrategy;
  void takeSums(const at::Tensor& sums);  // the step's results (undefined: none were added)
  std::vector<std::string> names_;
  std::vector<double> values_;
  bool summed_ = false;
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
  int64_t params = 0;     // the module's parameters (compute copies; fp32 masters when aliased;
                          // frozen parameters' masters)
  int64_t grads = 0;      // the module's .grad() tensors + gradient shards the strategy holds
  int64_t optimizer = 0;  // optimizer states + fp32 masters held apart from the parameters
  int64_t buffers = 0;    // the module's buffers
  int64_t total() const { return params + grads + optimizer + buffers; }
  std::string str() const;
};

class ShardingStrategy : public dtensor::Stateful {
 public:
  struct NamedTensor {
    std::string name;
    at::Tensor tensor;
  };

  ~ShardingStrategy() override;
  ShardingStrategy(const ShardingStrategy&) = delete;
  ShardingStrategy& operator=(const ShardingStrategy&) = delete;

  StrategyKind kind() const { return kind_; }
  distributed::Communicator& comm() const { return *comm_; }
  // The group the records' specs are laid out over: comm(), or hybrid's shard group (each
  // replica group then holds the same shards).
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
  // options().gradClip by global norm, and applied to the fp32 masters by the strategy's
  // fused optimizer with learning rate `lr`; the module's parameters are then updated
  // everywhere and its buffers synchronised. A non-finite global norm skips the update on
  // every rank: the result says so, the gradients are dropped, parameters and optimizer
  // states are untouched. `sums` (optional) are summed over all ranks in the same
  // all-reduce as the gradient norm (or one of their own where the norm needs none).
  StepResult step(double lr, StepSums* sums = nullptr);
  // The same step with a torch::optim optimizer built over shardedParameters() (any
  // parameter groups; its learning rates are its own): the averaged, clipped gradients are
  // set as the shards' .grad(), then optimizer.step().
  StepResult step(torch::optim::Optimizer& optimizer, StepSums* sums = nullptr);

  // The trainable parameters' local shards, by name, for a torch::optim optimizer (FSDP2's
  // sharded model.parameters()): each aliases its fp32 master (ShardedParam::master's
  // layout: this rank's padded rows when sharded, the full tensor under no_shard), the
  // same tensor objects for the strategy's lifetime.
  const std::vector<NamedTensor>& shardedParameters();

  // Rewrites the module's parameters from the fp32 masters (collective). step() does this
  // itself; call it after changing masters directly, e.g. restoring a checkpoint.
  virtual void publishParameters() = 0;

  // ---- What a trainer needs, whatever the strategy -----------------------------------
  // false: the backward passes that follow may keep their gradients local (micro-batches
  // before the last of a step: DDP's no_sync); true (default): reduce as usual. step()
  // reduces whatever is still local, so no gradient is lost. no_shard, zero2, zero3 and
  // hybrid reduce during backward and skip that while false; zero1 reduces once per step
  // anyway, so for it this changes nothing.
  virtual void setRequiresGradientSync(bool sync);
  // false: the root unit stays gathered after the backward passes that follow, for the next
  // micro-batch of the same step (FSDP2's set_reshard_after_backward on the root module: its
  // next forward gathers nothing). The other units reshard as always, and the root is
  // gathered through every forward and backward anyway, so the peak does not grow. true
  // (default): reshard. publishParameters() (the step) reshards it whatever this says; zero3
  // and hybrid honour it, the other strategies hold their parameters whole anyway.
  virtual void setReshardAfterBackward(bool reshard);

  // ---- run.deterministic (canonical_reduce.h) --------------------------------------
  // From now on each micro-batch's gradients are kept apart (addMicroBatchGradients after
  // its backward) and summed at step() in the canonical tree over `plan`'s micro-batches,
  // whatever the world size and strategy; the gradient norm is exact. Backward passes then
  // reduce nothing (they run as without gradient sync). Call before the first backward.
  void setDeterministic(const MicroBatchPlan& plan);
  bool deterministic() const { return canonical_ != nullptr; }
  // After the backward of micro-batch `index` (-1: a padding pass, its gradients dropped):
  // the module's gradients move into the step's canonical sums, group by group.
  void addMicroBatchGradients(int64_t index);

  // Runs `fn` with the module computing from other parameter values, then restores the
  // live values exactly, also when fn throws. `ownedValue(p)` is p's replacement in its
  // owned layout (p.ownedSpec(): e.g. an EMA shard), any floating dtype, or an undefined
  // tensor to keep p as it is. Collective: every rank calls it (and ownedValue answers
  // alike on every rank). zero3/hybrid swap the masters (a 1/N copy kept aside) and fn's
  // forward gathers them; the others gather one full tensor at a time into the module and
  // keep its live values aside.
  virtual void withSwappedParameters(const std::function<at::Tensor(const dtensor::ShardedParam&)>& ownedValue,
                                     const std::function<void()>& fn);

  // ---- The parameters ---------------------------------------------------------------
  // One record per parameter (frozen ones: trainable false), in named_parameters() order.
  // The records live as long as the strategy and never move (pointers to them stay valid).
  const std::vector<dtensor::ShardedParam>& params() const { return params_; }
  // tessera::Error naming `name` when it is not a parameter of the module.
  const dtensor::ShardedParam& param(const std::string& name) const;
  // The module's buffers (BatchNorm statistics), by name, as synchronised after each step.
  const std::vector<NamedTensor>& buffers() const { return buffers_; }
  // How a buffer is laid out in checkpoints: replicated over the state group.
  dtensor::ShardSpec bufferSpec(const at::Tensor& buffer) const;
  optim::ShardedOptimizer& optimizer() { return optimizer_; }
  const optim::ShardedOptimizer& optimizer() const { return optimizer_; }

  // The module's state as checkpoint entries that save and load in place:
  // <prefix><param> for every master (its record's spec) and <prefix><buffer> for every
  // buffer (replicated). After loading, call publishParameters().
  std::vector<dtensor::StateEntry> stateEntries(const std::string& prefix);
  // Stateful (dtensor/stateful.h): the entries named as the module names them; a load
  // publishes the loaded masters into the module; exported under its key.
  std::vector<dtensor::StateEntry> stateEntries() override { return stateEntries(""); }
  void afterLoad() override { publishParameters(); }
  std::map<std::string, std::string> exportNames() const override { return {{"", ""}}; }
  std::string componentKind() const override { return "model"; }

  // Steps applied and steps skipped for a non-finite gradient norm.
  int64_t stepsApplied() const { return stepsApplied_; }
  int64_t stepsSkipped() const { return stepsSkipped_; }

  // Storage bytes held right now (see ResidentBytes). Between step() and zeroGrad():
  // fp32 AdamW no_shard 16 Psi, zero1 8 Psi + 8 Psi/N, zero2 4 Psi + 12 Psi/N (+ padding).
  ResidentBytes residentBytes() const;

 protected:
  // Collects the parameters and the buffers of `module`, validates the options,
  // broadcasts rank 0's parameters (all but deferred ones, frozen included) and buffers,
  // and drops stale gradients. Derived constructors then register every collected
  // parameter (moduleParams()) with registerParam, in order, materialising the deferred
  // ones (initialRows, fullInitialValue).
  ShardingStrategy(torch::nn::Module& module, std::shared_ptr<distributed::Communicator> comm,
                   StrategyOptions options);

  // Registers the record of parameter `name`: its spec, and its fp32 master (which may
  // alias the parameter's storage). A trainable one (requires_grad) joins the optimizer
  // (weight decay and learning-rate scale per OptimizerOptions: decays, lrScaleOf). The
  // returned record stays where it is for the strategy's lifetime.
  dtensor::ShardedParam& registerParam(const std::string& name, const at::Tensor& moduleParam, dtensor::ShardSpec spec,
                              at::Tensor master);

  // A deferred parameter's initial values of global rows [rowBegin, rowBegin + rows.size(0))
  // written into `rows` ([n, rowNumel], fp32) by options().initializer.
  void initialRows(const std::string& name, int64_t rowBegin, const at::Tensor& rows) const;
  // The whole initial value of a parameter as fp32 on its device: its own values, or for
  // a deferred one a fresh tensor filled by the initializer (one tensor at a time).
  at::Tensor fullInitialValue(const NamedTensor& param) const;
  std::vector<dtensor::ShardedParam>& mutableParams() { return params_; }

  // Sets every record's `grad`: the averaged gradient in the record's layout (any
  // floating dtype), or undefined to skip that parameter this step (the optimizer leaves
  // it and its states alone). Storage a strategy keeps across steps (zero2's and zero3's
  // gradient shards) goes into heldGradShards_.
  virtual void synchronizeGradients() = 0;
  // Buffers: made equal across ranks per options().bufferSync (collective).
  void synchronizeBuffers();

  // run.deterministic: the groups a strategy reduces its gradients in (gradient buckets,
  // zero3 units), each a flat layout of the module parameters whose .grad() it packs.
  struct GradGroup {
    const dtensor::FlatLayout* layout = nullptr;
    std::vector<at::Tensor> params;  // the module's parameters, in the layout's order
    at::TensorOptions options;       // of the packed flat: the reduce dtype, the device
  };
  virtual std::vector<GradGroup> gradGroups() const = 0;
  // Group `group`'s canonical sum as the strategy holds a reduced gradient: the layout's
  // chunk of this rank (sharded over `comm()`), its shard group's chunk (hybrid), or the
  // whole flat (one chunk: replicated). Collective over comm(), group by group in order;
  // `replicas` is hybrid's replica group (the ranks holding the same chunk).
  at::Tensor canonicalGroupSum(size_t group, const GradGroup& g, distributed::Communicator* replicas = nullptr);
  std::unique_ptr<CanonicalGradients> canonical_;  // run.deterministic: the step's sums
  // setDeterministic's hook: a strategy whose backward keeps gradients anywhere but the
  // parameters' .grad() stops doing so.
  virtual void keepGradientsInParameters() {}

  // Every parameter of the module (frozen ones too), as collected at construction.
  const std::vector<NamedTensor>& moduleParams() const { return collected_; }

  torch::nn::Module& module_;
  std::shared_ptr<distributed::Communicator> comm_;  // the world: broadcasts, buffers
  // The group the Shard(0) specs shard over: the world here; hybrid's shard group. The
  // gradient-norm all-reduce runs over it (replica groups hold equal gradients).
  std::shared_ptr<distributed::Communicator> shardComm_;
  StrategyOptions options_;
  StrategyKind kind_;
  BufferSync bufferSync_;
  // Gradient storage the strategy keeps between step() and zeroGrad() (zero2's bucket
  // shards, zero3's unit shards); counted by residentBytes().
  std::vector<at::Tensor> heldGradShards_;

 private:
  std::vector<NamedTensor> collected_;  // every parameter, at construction
  std::vector<NamedTensor> buffers_;
  // The step after synchronizeGradients: clip, non-finite skip, `update` (an optimizer's
  // step), publish, buffers.
  StepResult stepWith(const std::function<void()>& update, StepSums* sums);
  void checkOptimizerTensors(torch::optim::Optimizer& optimizer);

  std::vector<dtensor::ShardedParam> params_;    // reserved for every parameter: never reallocates
  std::unordered_map<std::string, dtensor::ShardedParam*> byName_;
  optim::ShardedOptimizer optimizer_;
  std::vector<NamedTensor> shards_;     // shardedParameters(), made at its first call
  std::vector<dtensor::ShardedParam*> shardRecords_;  // the record of each of shards_
  const torch::optim::Optimizer* checkedOptimizer_ = nullptr;  // the last one checkOptimizerTensors passed
  int64_t stepsApplied_ = 0;
  int64_t stepsSkipped_ = 0;
};

// The swap-and-restore under withSwappedParameters (and the EMA's buffers): copies
// value(i) into targets[i] (their live values kept aside), calls refresh(), runs fn,
// copies the live values back and calls refresh() again, also when fn throws. Each value
// is computed, copied and dropped in turn.
void withValuesSwapped(const std::vector<at::Tensor>& targets, const std::function<at::Tensor(size_t)>& value,
                       const std::function<void()>& refresh, const std::function<void()>& fn);

// Builds the strategy options.strategy names over `module`'s parameters (frozen ones
// too) and the ranks of `comm`. Collective: broadcasts rank 0's buffers and the
// parameters that have values; deferred parameters (no storage yet) are initialised by
// options.initializer, each rank writing only what it holds. no_shard, zero1 and zero2
// are DataParallelStrategy (data_parallel.h); zero3 and hybrid are FullyShardStrategy
// (fully_shard.h), with options.wrap naming the units.
std::unique_ptr<ShardingStrategy> makeStrategy(torch::nn::Module& module,
                                               std::shared_ptr<distributed::Communicator> comm,
                                               const StrategyOptions& options);

}  // namespace tessera::sharding
