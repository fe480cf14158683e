// no_shard / zero1 / zero2 (see data_parallel.h).
#include "sharding/data_parallel.h"

#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <functional>

#include "common/errors.h"
#include "distributed/communicator.h"
#include "distributed/device_mesh.h"
#include "sharding/grad_hooks.h"
#include "sharding/inflight.h"

namespace tessera::sharding {

// One bucket's collective in flight, with the buffers it reads and writes (outside an
// anonymous namespace: DataParallelStrategy::Overlap holds them).
struct InflightBucket {
  size_t bucket = 0;
  at::Tensor flat;
  at::Tensor local;  // reduce-scatter output (zero1/zero2)
  std::shared_ptr<distributed::CommHandle> handle;
};

struct DataParallelStrategy::Overlap {
  explicit Overlap(DataParallelStrategy& s)
      : inflight(kMaxInflightBuckets, [&s](InflightBucket& job) {
          // State groups: the group's reduce-scatter averaged over it, this over the groups.
          if (s.replicaComm_ != nullptr && job.local.defined()) {
            s.replicaComm_->allReduce(job.local, distributed::ReduceOp::kAvg);
          }
          s.finishBucket(job.bucket, job.flat, job.local);
        }) {}
  InflightCollectives<InflightBucket> inflight;  // the gradient reductions
  GradReadyHooks hooks;                          // no_shard / zero2: onGradReady
};

namespace {

// Issues one collective per bucket through `issue`, keeping at most kMaxInflightBuckets in
// flight, and hands each to `finish` (after its wait) in bucket order.
template <typename Issue>
void pipelineBuckets(size_t buckets, Issue issue, std::function<void(InflightBucket&)> finish) {
  InflightCollectives<InflightBucket> inflight(DataParallelStrategy::kMaxInflightBuckets, std::move(finish));
  for (size_t b = 0; b < buckets; ++b) {
    inflight.makeRoom();
    inflight.push(issue(b));
  }
  inflight.drain();
}

// A replicated parameter's fp32 master (no_shard, and frozen parameters under zero1/zero2:
// no optimizer state to shard). fp32 compute: the parameter itself, made fp32 and
// contiguous; otherwise a separate fp32 copy, the parameter becoming its cast copy.
at::Tensor replicatedMaster(const at::Tensor& p, const std::vector<int64_t>& shape, const at::TensorOptions& fp32,
                            bool mastersAreParams, at::ScalarType paramDtype) {
  at::Tensor master;
  if (mastersAreParams) {
    if (p.scalar_type() != at::kFloat || !p.is_contiguous()) p.set_data(p.detach().to(at::kFloat).contiguous());
    master = p.detach();
  } else {
    master = at::empty(shape, fp32);
    master.copy_(p.detach());
    p.set_data(p.detach().to(paramDtype).contiguous());
  }
  return master;
}

// This rank's Shard(0) fp32 master of a trainable parameter under zero1/zero2 (see
// spec); the parameter is re-pointed at its new storage (fp32) or its cast copy.
at::Tensor shardedMaster(const at::Tensor& p, const dtensor::ShardSpec& spec, const std::vector<int64_t>& shape,
                         const at::TensorOptions& fp32, int world, int rank, bool mastersAreParams,
                         at::ScalarType paramDtype) {
  at::Tensor master;
  if (mastersAreParams) {
    // One storage of N x chunkRows rows: the module sees the first `rows`, this rank's
    // master is its chunk. Padding rows are zero and stay zero (zero gradients).
    at::Tensor storage = at::zeros({world * spec.paddedNumel()}, fp32);
    storage.narrow(0, 0, spec.globalNumel()).copy_(p.detach().reshape({-1}));
    p.set_data(storage.narrow(0, 0, spec.globalNumel()).view(shape));
    master = storage.narrow(0, rank * spec.paddedNumel(), spec.paddedNumel()).view(spec.localShape());
  } else {
    master = spec.shardOf(p.detach().to(at::kFloat));
    p.set_data(p.detach().to(paramDtype).contiguous());
  }
  return master;
}

// The gradient buckets: each one's members and flat layout, sized by their flat reduce
// buffer (padding included).
std::vector<std::pair<std::vector<dtensor::ShardedParam*>, dtensor::FlatLayout>> planGradientBuckets(std::vector<dtensor::ShardedParam>& params,
                                                                                   bool sharded, int world,
                                                                                   const StrategyOptions& options) {
  const int64_t elementBytes = static_cast<int64_t>(c10::elementSize(options.reduceDtype));
  // Reverse registration order: the order backward produces the gradients. Frozen
  // parameters are in no bucket.
  std::vector<dtensor::ShardedParam*> trainable;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    if (it->trainable) trainable.push_back(&*it);
  }
  std::vector<int64_t> bytes;
  for (const dtensor::ShardedParam* p : trainable) {
    bytes.push_back((sharded ? p->spec.paddedNumel() * world : p->spec.globalNumel()) * elementBytes);
  }
  std::vector<std::pair<std::vector<dtensor::ShardedParam*>, dtensor::FlatLayout>> buckets;
  for (const auto& indices : dtensor::planBuckets(bytes, options.bucketBytes)) {
    std::vector<dtensor::ShardedParam*> members;
    std::vector<dtensor::ShardSpec> specs;
    for (size_t i : indices) {
      members.push_back(trainable[i]);
      specs.push_back(trainable[i]->spec);
    }
    buckets.emplace_back(std::move(members), dtensor::FlatLayout(std::move(specs)));
  }
  return buckets;
}

}  // namespace

DataParallelStrategy::DataParallelStrategy(torch::nn::Module& module, std::shared_ptr<distributed::Communicator> comm,
                                           StrategyOptions options)
    : ShardingStrategy(module, std::move(comm), std::move(options)) {
  TESSERA_CHECK_AS(ConfigError,
                   kind_ == StrategyKind::kNoShard || kind_ == StrategyKind::kZero1 || kind_ == StrategyKind::kZero2,
                   "DataParallelStrategy: strategy '", strategyKindName(kind_), "' is not one of no_shard, zero1, zero2");
  sharded_ = kind_ != StrategyKind::kNoShard;
  freeFullGrads_ = kind_ == StrategyKind::kZero2;
  overlap_ = kind_ != StrategyKind::kZero1;
  inflight_ = std::make_unique<Overlap>(*this);
  mastersAreParams_ = options_.paramDtype == at::kFloat;
  const int groupSize = options_.stateGroupSize;
  if (groupSize > 0 && groupSize < comm_->worldSize()) {
    TESSERA_CHECK_AS(ConfigError, comm_->worldSize() % groupSize == 0, "DataParallelStrategy: ",
                     strategyKindName(kind_), " state groups of ", groupSize, " ranks must divide the world size ",
                     comm_->worldSize());
    const distributed::DeviceMesh mesh = distributed::DeviceMesh::twoD(comm_, comm_->worldSize() / groupSize, groupSize);
    shardComm_ = mesh.shardGroup();
    if (sharded_) replicaComm_ = mesh.replicateGroup();
  }
  // zero1/zero2 shard over the state group (every rank, or one of stateGroupSize ranks).
  const int world = shardComm_->worldSize();
  const int rank = shardComm_->rank();

  c10::NoGradGuard noGrad;
  for (const NamedTensor& np : moduleParams()) {
    const at::Tensor& p = np.tensor;
    const std::vector<int64_t> shape = p.sizes().vec();
    const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(p.device());
    // Every rank holds the whole parameter: a deferred one is materialised in full here,
    // one tensor at a time.
    if (dtensor::hasNoStorage(p)) p.set_data(fullInitialValue(np));
    if (!sharded_ || !p.requires_grad()) {
      dtensor::ShardSpec spec(shape, at::kFloat, world, rank, dtensor::Placement::kReplicate);
      at::Tensor master = replicatedMaster(p, shape, fp32, mastersAreParams_, options_.paramDtype);
      registerParam(np.name, p, std::move(spec), std::move(master));
      continue;
    }
    dtensor::ShardSpec spec(shape, at::kFloat, world, rank);
    at::Tensor master = shardedMaster(p, spec, shape, fp32, world, rank, mastersAreParams_, options_.paramDtype);
    registerParam(np.name, p, std::move(spec), std::move(master));
  }

  for (auto& [members, layout] : planGradientBuckets(mutableParams(), sharded_, world, options_)) {
    buckets_.emplace_back(std::move(members), std::move(layout));
  }
  if (overlap_) {
    for (size_t b = 0; b < buckets_.size(); ++b) {
      for (size_t k = 0; k < buckets_[b].members.size(); ++k) {
        inflight_->hooks.add(buckets_[b].members[k]->moduleParam, [this, b, k] { onGradReady(b, k); });
      }
    }
  }
}

DataParallelStrategy::~DataParallelStrategy() = default;

void DataParallelStrategy::onGradReady(size_t b, size_t k) {
  Bucket& bucket = buckets_[b];
  if (!sync_) {
    bucket.local = true;  // no_sync: step() reduces it
    return;
  }
  if (!callbackQueued_) {
    callbackQueued_ = true;
    queueAtEndOfBackward([this] {
      // The buckets whose gradients did not all arrive (unused parameters); all finished
      // before the next backward adds to the gradients they write (no_shard); then a
      // fresh count for the next backward.
      callbackQueued_ = false;
      issueReadyBuckets(/*all=*/true);
      inflight_->inflight.drain();
      for (Bucket& each : buckets_) {
        std::fill(each.ready.begin(), each.ready.end(), false);
        each.readyCount = 0;
      }
      nextToIssue_ = 0;
    });
  }
  if (bucket.ready[k]) return;
  bucket.ready[k] = true;
  ++bucket.readyCount;
  issueReadyBuckets(/*all=*/false);
}

void DataParallelStrategy::issueReadyBuckets(bool all) {
  while (nextToIssue_ < buckets_.size()) {
    const Bucket& bucket = buckets_[nextToIssue_];
    if (!all && bucket.readyCount < bucket.members.size()) return;  // in bucket order on every rank
    issueBucket(nextToIssue_++);
  }
}

void DataParallelStrategy::issueBucket(size_t b) {
  Bucket& bucket = buckets_[b];
  inflight_->inflight.makeRoom();
  c10::NoGradGuard noGrad;
  const auto options = at::TensorOptions().dtype(options_.reduceDtype).device(bucket.members[0]->master.device());
  InflightBucket job;
  job.bucket = b;
  job.flat = at::empty({bucket.layout.flatNumel()}, options);
  for (size_t k = 0; k < bucket.members.size(); ++k) {
    const at::Tensor& p = bucket.members[k]->moduleParam;
    bucket.layout.packFull(job.flat, k, p.grad());  // zeros for a parameter without a gradient
    if (freeFullGrads_) p.mutable_grad().reset();    // zero2: full gradient freed once packed
  }
  // kAvg: the one division by N of the gradient average.
  if (sharded_) {
    job.local = at::empty({bucket.layout.chunkNumel()}, options);
    job.handle = shardComm_->reduceScatterAsync(job.local, job.flat, distributed::ReduceOp::kAvg);
  } else {
    job.handle = comm_->allReduceAsync(job.flat, distributed::ReduceOp::kAvg);
  }
  bucket.issued = true;
  bucket.local = false;
  inflight_->inflight.push(std::move(job));
}

void DataParallelStrategy::finishBucket(size_t b, at::Tensor flat, at::Tensor local) {
  Bucket& bucket = buckets_[b];
  c10::NoGradGuard noGrad;
  if (sharded_) {
    // zero1's .grad() held everything since zeroGrad(), so the latest replaces; zero2's
    // full gradients were freed, so a reduction is new and adds, in fp32 whatever the
    // reduce dtype (as zero3 accumulates).
    if (!freeFullGrads_) {
      bucket.shard = local;
    } else if (bucket.shard.defined()) {
      bucket.shard.add_(local);
    } else {
      bucket.shard = local.to(at::kFloat);
    }
    return;
  }
  for (size_t k = 0; k < bucket.members.size(); ++k) {
    const at::Tensor& p = bucket.members[k]->moduleParam;
    at::Tensor& grad = p.mutable_grad();
    if (!grad.defined()) grad = at::empty_like(p.detach());
    grad.copy_(bucket.layout.slot(flat, k));  // the module's gradients are the averages, as in DDP
  }
  // Hand the optimizer the reduce-dtype values (fp32 by default), not a 16-bit rounding.
  bucket.average = bucket.members[0]->moduleParam.scalar_type() == options_.reduceDtype ? at::Tensor() : flat;
}

std::vector<ShardingStrategy::GradGroup> DataParallelStrategy::gradGroups() const {
  std::vector<GradGroup> groups;
  for (const Bucket& bucket : buckets_) {
    GradGroup g;
    g.layout = &bucket.layout;
    for (const dtensor::ShardedParam* p : bucket.members) g.params.push_back(p->moduleParam);
    g.options = at::TensorOptions().dtype(options_.reduceDtype).device(bucket.members[0]->master.device());
    groups.push_back(std::move(g));
  }
  return groups;
}

void DataParallelStrategy::synchronizeGradients() {
  if (deterministic()) {
    // Every bucket's canonical sum (canonical_reduce.h), taken as a reduction's result.
    const std::vector<GradGroup> groups = gradGroups();
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const at::Tensor sum = canonicalGroupSum(b, groups[b], replicaComm_.get());
      if (sharded_) {
        finishBucket(b, at::Tensor(), sum);
      } else {
        finishBucket(b, sum, at::Tensor());
      }
      buckets_[b].issued = true;
    }
  }
  // What no synchronised backward reduced since the last step (zero1: everything), and
  // local gradients accumulated since, in bucket order.
  for (size_t b = 0; b < buckets_.size() && !deterministic(); ++b) {
    if (!buckets_[b].issued || buckets_[b].local) issueBucket(b);
  }
  inflight_->inflight.drain();
  heldGradShards_.clear();
  for (Bucket& bucket : buckets_) {
    for (size_t k = 0; k < bucket.members.size(); ++k) {
      dtensor::ShardedParam& p = *bucket.members[k];
      if (sharded_) {
        p.grad = bucket.layout.slot(bucket.shard, k);
      } else {
        p.grad = bucket.average.defined() ? bucket.layout.slot(bucket.average, k) : p.moduleParam.grad();
      }
    }
    if (freeFullGrads_) heldGradShards_.push_back(bucket.shard);  // zero2 keeps them until zeroGrad()
    if (!freeFullGrads_) bucket.shard = at::Tensor();              // zero1: transient (the records hold them for the step)
    bucket.average = at::Tensor();
    bucket.issued = false;
    bucket.local = false;
  }
}

void DataParallelStrategy::zeroGrad() {
  inflight_->inflight.drain();  // a reduction in flight would write into what is dropped
  ShardingStrategy::zeroGrad();
  for (Bucket& bucket : buckets_) {
    bucket.shard = bucket.average = at::Tensor();
    bucket.issued = bucket.local = false;
  }
}

void DataParallelStrategy::publishParameters() {
  c10::NoGradGuard noGrad;
  // Replicated masters (no_shard; frozen parameters): the module's parameters themselves
  // in fp32 compute, else copied (cast) from them.
  if (!mastersAreParams_) {
    for (const dtensor::ShardedParam& p : params()) {
      if (p.spec.placement() == dtensor::Placement::kReplicate) p.moduleParam.detach().copy_(p.master);
    }
  }
  if (!sharded_) return;
  const int rank = shardComm_->rank();
  auto issue = [&](size_t b) {
    const Bucket& bucket = buckets_[b];
    InflightBucket job;
    job.bucket = b;
    job.flat = at::empty({bucket.layout.flatNumel()},
                         at::TensorOptions().dtype(options_.paramDtype).device(bucket.members[0]->master.device()));
    // This rank's chunk, cast to the compute dtype before gathering (same values as
    // gathering fp32 and casting: rounding is elementwise).
    at::Tensor chunk = bucket.layout.chunk(job.flat, rank);
    for (size_t k = 0; k < bucket.members.size(); ++k) bucket.layout.slot(chunk, k).copy_(bucket.members[k]->master);
    job.handle = shardComm_->allGatherIntoAsync(job.flat, chunk);
    return job;
  };
  auto finish = [&](InflightBucket& job) {
    const Bucket& bucket = buckets_[job.bucket];
    for (size_t k = 0; k < bucket.members.size(); ++k) {
      bucket.layout.unpackFull(job.flat, k, bucket.members[k]->moduleParam);
    }
  };
  pipelineBuckets(buckets_.size(), issue, finish);
}

}  // namespace tessera::sharding
