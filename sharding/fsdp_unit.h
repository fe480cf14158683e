// FsdpUnit: one FSDP unit, FSDP2's FSDPParamGroup — the parameters one module owns, their
// fp32 master shards as the slots of one flat chunk, and the unit's lifecycle, one method
// per event:
//   forward:   preForward (unshard + waitForUnshard) ... postForward (reshard or keep)
//   backward:  preBackward (gathered again) ... gradients arrive (gradReady) ...
//              postBackward (reshard, then the reduce-scatter: startReduce / finishReduce)
// The strategy-wide order of these calls (prefetch, the unit kept from forward into
// backward, the end of backward) is FullyShardState's (fsdp_state.h). Layout, memory and
// communication: docs/design.md, "FSDP unit lifecycle".
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtensor/flat_layout.h"
#include "dtensor/sharded_param.h"

namespace c10 {
struct Event;
}
namespace torch::nn {
class Module;
}

namespace tessera::distributed {
class Communicator;
class CommHandle;
}  // namespace tessera::distributed

namespace tessera::sharding {

// Where the unit's parameters are: only the masters' shards (kSharded), being all-gathered
// (kUnsharding: the gather is in flight), or full in the module's parameters (kUnsharded).
enum class ShardedState { kSharded, kUnsharding, kUnsharded };
// What the unit is doing in the step: nothing (kIdle), running its forward (kForward),
// gathered for its backward (kPreBackward), done with its backward (kPostBackward).
enum class TrainingState { kIdle, kForward, kPreBackward, kPostBackward };

// What every unit of one strategy shares: the groups, the dtypes, and the peak accounting
// the strategy samples after each gather and copy-out.
class HostOffload;

struct UnitContext {
  distributed::Communicator* shardComm = nullptr;    // the Shard(0) group
  distributed::Communicator* replicaComm = nullptr;  // hybrid: across replica groups; else null
  at::ScalarType paramDtype = at::kFloat;            // the gathered parameters' dtype
  at::ScalarType reduceDtype = at::kFloat;           // the gradients' dtype on the wire
  std::function<void()> sample;                      // records the bytes held now
  HostOffload* offload = nullptr;  // CPU offload: masters and gradient shards on the host
  // run.deterministic: each micro-batch's gradients are taken from the parameters after its
  // backward (ShardingStrategy::addMicroBatchGradients), so they never accumulate in the
  // gradient shard in place (one rank's shortcut).
  bool gradientsApart = false;
};

// One reduce-scatter of a unit's gradients in flight (InflightCollectives' job).
struct ReduceJob {
  class FsdpUnit* unit = nullptr;
  at::Tensor flat, local;  // this rank's full gradients, packed; its reduced chunk
  std::shared_ptr<distributed::CommHandle> handle;
};

class FsdpUnit {
 public:
  FsdpUnit(std::string name, const torch::nn::Module* module, bool isRoot, const UnitContext& context);
  ~FsdpUnit();  // waits for a gather still in flight (its buffers must outlive it)
  FsdpUnit(const FsdpUnit&) = delete;
  FsdpUnit& operator=(const FsdpUnit&) = delete;

  // ---- construction (FullyShardStrategy, in this order) ------------------------------
  // The layout of the unit's members (their specs over the shard group, frozen ones
  // included; `trainable[k]` for member k) and an fp32 master chunk of zeros on `device`
  // (the module's; in host memory with CPU offload).
  void setLayout(std::vector<dtensor::ShardSpec> specs, const std::vector<bool>& trainable, at::Device device);
  // Member k's slot of the master chunk (spec(k).localShape()), for its initial values.
  at::Tensor masterSlot(size_t k) const;
  // The members' records, in layout order; their module parameters then get fresh empty
  // storage in the compute dtype (allocated only while the unit is gathered).
  void adoptRecords(std::vector<dtensor::ShardedParam*> records);

  // ---- lifecycle ---------------------------------------------------------------------
  // Issues the all-gather of the masters, cast to the compute dtype (kSharded ->
  // kUnsharding; a unit without parameters is kUnsharded at once). No-op otherwise. With
  // one rank in the shard group there is nothing to gather: the masters are cast straight
  // into the parameters' storage (no gather buffer), queued on the device like a gather;
  // with mastersAreParams() nothing is cast either.
  void unshard();
  // Whether gathering this unit hides nothing: one rank in the shard group and no upload
  // (the "gather" is a cast queued in stream order). Such a unit is neither prefetched nor
  // kept from its forward into its backward: it would only be held earlier and longer
  // (FSDP2 at one rank likewise materialises a unit only when it runs).
  bool gatherIsFree() const;
  // One rank in the shard group, no offload and fp32 compute: the module's parameters are
  // views of their masters (as DataParallelStrategy's are at fp32), so unshard() and
  // reshard() copy and free nothing and the optimizer's update is what the next forward
  // reads. paramBytes() is then 0.
  bool mastersAreParams() const;
  // A gather issued ahead of use (forward or backward prefetch): unshard(), unless the
  // gather is free.
  void prefetch() {
    if (!gatherIsFree()) unshard();
  }
  // Waits for the gather and copies the full parameters into the module's (regrown)
  // storage: kUnsharded. Gathers now when nothing was issued.
  void waitForUnshard();
  // Frees the parameters' storage (kSharded; not with mastersAreParams(): it is the
  // masters'); a gather in flight is waited for first.
  void reshard();
  void preForward();
  void postForward(bool reshardNow);
  // Gathered for the backward. True the first time in this backward (the scheduler
  // prefetches then).
  bool preBackward();
  // Trainable member j's gradient has arrived; true when it was the last one missing.
  bool gradReady(size_t j);
  // Every gradient is in: with `reshardNow`, frees the parameters (unless a frozen member is
  // held: no gradient says when its last user ran) before the reduction allocates its buffers.
  void postBackward(bool reshardNow);
  // At one rank with the masters as parameters (no replicas, fp32 gradients), autograd
  // accumulates each gradient straight into its slot of the gradient shard (the parameter's
  // grad is that view, attached before the unit's backward): nothing is packed, reduced or
  // added. True, and marks the unit reduced, in that case; false otherwise.
  bool reducedInPlace();
  // Packs the full gradients (zeros where one is missing), frees them and issues the
  // reduce-scatter (kAvg over the shard group: the one division by N).
  ReduceJob startReduce();
  // The reduce-scatter of `job` completed: (hybrid: averaged over the replica groups)
  // added into the gradient shard, which accumulates until clearGradients(). With CPU
  // offload the shard is copied to the host asynchronously; a later micro-batch's copy
  // waits in its own host buffer (adding it would stop the host until the GPU catches up,
  // in the middle of backward) until addPendingGradients().
  void finishReduce(ReduceJob& job);
  // run.deterministic: the layout the unit's gradients are packed in, the packed flat's
  // dtype and device; and a canonical sum's chunk (canonical_reduce.h, the replica groups'
  // part already in it) taken as finishReduce takes a reduce-scatter's.
  const dtensor::FlatLayout& gradLayout() const { return *gradLayout_; }
  at::TensorOptions reduceOptions() const { return deviceOptions(ctx_.reduceDtype); }
  void takeReducedChunk(const at::Tensor& local);
  // CPU offload: adds the micro-batches' downloaded gradients into the shard. Call after
  // HostOffload::finishCopies().
  void addPendingGradients();
  // Back to kIdle for the next backward, every gradient flag cleared.
  void endBackward();
  // Drops the gradient shard (zeroGrad).
  void clearGradients() {
    gradShard_ = at::Tensor();
    attached_.clear();
    attachedViews_.clear();
    pendingHostGrads_.clear();
  }

  // ---- what it holds -----------------------------------------------------------------
  const std::string& name() const { return name_; }
  const torch::nn::Module* module() const { return module_; }
  bool isRoot() const { return isRoot_; }
  ShardedState shardedState() const { return sharded_; }
  TrainingState trainingState() const { return training_; }
  const std::vector<dtensor::ShardedParam*>& params() const { return params_; }
  size_t trainableCount() const { return trainable_.size(); }
  bool hasFrozenParams() const { return trainable_.size() < params_.size(); }
  const at::Tensor& trainableParam(size_t j) const { return params_[trainable_[j]]->moduleParam; }
  // Whether any trainable parameter holds a full (unreduced) gradient, or (reducedInPlace's
  // case) a view of its slot of the gradient shard.
  bool hasLocalGradients() const;
  // Reduced in this backward already.
  bool reduced() const { return reduced_; }
  const at::Tensor& gradShard() const { return gradShard_; }
  // Sets each trainable record's `grad` to its slot of the gradient shard (the step's).
  void exposeGradients() const;
  int64_t paramBytes() const { return paramBytes_; }    // full parameters (padded to whole shards), compute dtype
  int64_t gatherBytes() const { return gatherBytes_; }  // the flat gather buffer (0 at one rank: none)
  int64_t reduceBytes() const;                          // the flat gradient buffer
  // Storage bytes alive now: full parameters and a gather buffer in flight.
  int64_t unshardedBytes() const;

 private:
  const UnitContext& ctx_;
  std::string name_;  // qualified module name; "" for the root
  const torch::nn::Module* module_;
  bool isRoot_;
  std::vector<dtensor::ShardedParam*> params_;  // slot k of layout_ is params_[k]
  std::unique_ptr<dtensor::FlatLayout> layout_;  // gathered: every member, frozen ones too
  at::Tensor masterChunk_;              // fp32: every member's master, in layout_'s slots
  at::Device device_ = at::kCPU;        // where the module computes (masterChunk_ too, unless offloaded)
  std::vector<size_t> trainable_;       // slot j of gradLayout_ is params_[trainable_[j]]
  std::unique_ptr<dtensor::FlatLayout> gradLayout_;
  at::Tensor gradShard_;                // fp32 reduced gradients, accumulating
  std::vector<bool> attached_;          // reducedInPlace's case: trainable j's grad was made its slot
  // That case's slots of gradShard_ in each parameter's shape, made once per gradient shard
  // (each micro-batch's backward only compares pointers).
  std::vector<at::Tensor> attachedViews_;
  std::vector<at::Tensor> pendingHostGrads_;  // CPU offload: later micro-batches' shards, landing
  int64_t paramBytes_ = 0, gatherBytes_ = 0;

  ShardedState sharded_ = ShardedState::kSharded;
  TrainingState training_ = TrainingState::kIdle;
  at::Tensor flat_;                     // the gather buffer while kUnsharding
  // Each parameter's storage as its padded full tensor (FlatLayout::paddedFullNumel): what
  // a gather is copied out into, in one operation for the unit.
  std::vector<at::Tensor> paddedViews_;
  // Bytes of parameter k's storage while gathered: its padded full tensor.
  size_t storageBytes(size_t k) const;
  bool gradientsInShard() const;  // reducedInPlace()'s case
  // Makes each trainable parameter's grad its slot of the gradient shard (allocated as zeros
  // when there is none yet).
  void attachGradientsToShard();
  // Gives every parameter its gathered storage (paddedViews_ made the first time).
  void growStorages();
  at::TensorOptions deviceOptions(at::ScalarType dtype) const { return at::TensorOptions().dtype(dtype).device(device_); }
  // CPU offload at one rank in the shard group: the upload of the masters into the
  // parameters, which the compute stream waits for before it reads them.
  std::unique_ptr<c10::Event> uploaded_;
  std::shared_ptr<distributed::CommHandle> gather_;
  // The timeline (common/trace.h): when this unit's forward or backward compute began
  // (-1: none open), recorded as a span when it ends.
  int64_t spanBeginNs_ = -1;
  void endSpan(const char* phase);
  std::string traceName() const { return name_.empty() ? "(root)" : name_; }
  std::vector<bool> ready_;             // per trainable member, in this backward
  size_t readyCount_ = 0;
  bool reduced_ = false;
};

}  // namespace tessera::sharding
