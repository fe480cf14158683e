// no_shard / zero1 / zero2 (see data_parallel.h).
#include "sharding/data_parallel.h"

#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <functional>

#include "common/errors.h"
#include "distributed/communicator.h"
#include "sharding/inflight.h"

namespace tessera::sharding {
namespace {

// One bucket's collective in flight, with the buffers it reads and writes.
struct InflightBucket {
  size_t bucket = 0;
  at::Tensor flat;
  at::Tensor local;  // reduce-scatter output (zero1/zero2)
  std::shared_ptr<distributed::CommHandle> handle;
};

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

}  // namespace

DataParallelStrategy::DataParallelStrategy(torch::nn::Module& module, std::shared_ptr<distributed::Communicator> comm,
                                           StrategyOptions options)
    : ShardingStrategy(module, std::move(comm), std::move(options)) {
  TESSERA_CHECK_AS(ConfigError,
                   kind_ == StrategyKind::kNoShard || kind_ == StrategyKind::kZero1 || kind_ == StrategyKind::kZero2,
                   "DataParallelStrategy: strategy '", options_.strategy, "' is not one of no_shard, zero1, zero2");
  sharded_ = kind_ != StrategyKind::kNoShard;
  freeFullGrads_ = kind_ == StrategyKind::kZero2;
  mastersAreParams_ = options_.paramDtype == at::kFloat;
  const int world = comm_->worldSize();
  const int rank = comm_->rank();

  c10::NoGradGuard noGrad;
  for (const NamedTensor& np : moduleParams()) {
    const at::Tensor& p = np.tensor;
    const std::vector<int64_t> shape = p.sizes().vec();
    const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(p.device());
    // Every rank holds the whole parameter: a deferred one is materialised in full here,
    // one tensor at a time.
    if (hasNoStorage(p)) p.set_data(fullInitialValue(np));
    if (!sharded_ || !p.requires_grad()) {
      // Replicated (no_shard, and frozen parameters under zero1/zero2: no optimizer state
      // to shard).
      ShardSpec spec(shape, at::kFloat, world, rank, Placement::kReplicate);
      at::Tensor master;
      if (mastersAreParams_) {
        if (p.scalar_type() != at::kFloat || !p.is_contiguous()) p.set_data(p.detach().to(at::kFloat).contiguous());
        master = p.detach();
      } else {
        master = at::empty(shape, fp32);
        master.copy_(p.detach());
        p.set_data(p.detach().to(options_.paramDtype).contiguous());
      }
      registerParam(np.name, p, std::move(spec), std::move(master));
      continue;
    }
    ShardSpec spec(shape, at::kFloat, world, rank);
    at::Tensor master;
    if (mastersAreParams_) {
      // One storage of N x chunkRows rows: the module sees the first `rows`, this rank's
      // master is its chunk. Padding rows are zero and stay zero (zero gradients).
      at::Tensor storage = at::zeros({world * spec.paddedNumel()}, fp32);
      storage.narrow(0, 0, spec.globalNumel()).copy_(p.detach().reshape({-1}));
      p.set_data(storage.narrow(0, 0, spec.globalNumel()).view(shape));
      master = storage.narrow(0, rank * spec.paddedNumel(), spec.paddedNumel()).view(spec.localShape());
    } else {
      master = spec.shardOf(p.detach().to(at::kFloat));
      p.set_data(p.detach().to(options_.paramDtype).contiguous());
    }
    registerParam(np.name, p, std::move(spec), std::move(master));
  }

  // Buckets, sized by their flat reduce buffer (padding included).
  const int64_t elementBytes = static_cast<int64_t>(c10::elementSize(options_.reduceDtype));
  std::vector<ShardedParam*> trainable;  // frozen parameters are in no bucket
  for (ShardedParam& p : mutableParams()) {
    if (p.trainable) trainable.push_back(&p);
  }
  std::vector<int64_t> bytes;
  for (const ShardedParam* p : trainable) {
    bytes.push_back((sharded_ ? p->spec.paddedNumel() * world : p->spec.globalNumel()) * elementBytes);
  }
  for (const auto& indices : planBuckets(bytes, options_.bucketBytes)) {
    std::vector<ShardedParam*> members;
    std::vector<ShardSpec> specs;
    for (size_t i : indices) {
      members.push_back(trainable[i]);
      specs.push_back(trainable[i]->spec);
    }
    buckets_.push_back({std::move(members), FlatLayout(std::move(specs))});
  }
}

void DataParallelStrategy::synchronizeGradients() {
  if (sharded_) {
    reduceScatterGradients();
  } else {
    allReduceGradients();
  }
}

void DataParallelStrategy::allReduceGradients() {
  c10::NoGradGuard noGrad;
  auto issue = [&](size_t b) {
    const Bucket& bucket = buckets_[b];
    InflightBucket job;
    job.bucket = b;
    job.flat = at::empty({bucket.layout.flatNumel()},
                         at::TensorOptions().dtype(options_.reduceDtype).device(bucket.members[0]->master.device()));
    for (size_t k = 0; k < bucket.members.size(); ++k) {
      bucket.layout.packFull(job.flat, k, bucket.members[k]->moduleParam.grad());
    }
    // kAvg: the one division by N of the gradient average.
    job.handle = comm_->allReduceAsync(job.flat, distributed::ReduceOp::kAvg);
    return job;
  };
  auto finish = [&](InflightBucket& job) {
    const Bucket& bucket = buckets_[job.bucket];
    for (size_t k = 0; k < bucket.members.size(); ++k) {
      ShardedParam& p = *bucket.members[k];
      const at::Tensor average = bucket.layout.slot(job.flat, k);
      at::Tensor& grad = p.moduleParam.mutable_grad();
      if (!grad.defined()) grad = at::empty_like(p.moduleParam.detach());
      grad.copy_(average);  // the module's gradients are the averaged ones, as in DDP
      // Hand the optimizer the reduce-dtype values (fp32 by default), not a bf16 rounding.
      p.grad = grad.scalar_type() == options_.reduceDtype ? grad : average;
    }
  };
  pipelineBuckets(buckets_.size(), issue, finish);
}

void DataParallelStrategy::reduceScatterGradients() {
  std::vector<at::Tensor> shards(buckets_.size());
  // zero2 without zeroGrad() since the last step: add to the shards it kept, as torch
  // accumulates into .grad().
  const bool accumulate = freeFullGrads_ && heldGradShards_.size() == buckets_.size();
  c10::NoGradGuard noGrad;
  auto issue = [&](size_t b) {
    const Bucket& bucket = buckets_[b];
    const auto options =
        at::TensorOptions().dtype(options_.reduceDtype).device(bucket.members[0]->master.device());
    InflightBucket job;
    job.bucket = b;
    job.flat = at::empty({bucket.layout.flatNumel()}, options);
    for (size_t k = 0; k < bucket.members.size(); ++k) {
      const at::Tensor& p = bucket.members[k]->moduleParam;
      bucket.layout.packFull(job.flat, k, p.grad());
      if (freeFullGrads_) p.mutable_grad().reset();  // zero2: full gradient freed once packed
    }
    job.local = at::empty({bucket.layout.chunkNumel()}, options);
    job.handle = comm_->reduceScatterAsync(job.local, job.flat, distributed::ReduceOp::kAvg);
    return job;
  };
  auto finish = [&](InflightBucket& job) {
    job.flat.reset();
    at::Tensor shard = job.local;
    if (accumulate) shard = heldGradShards_[job.bucket].add_(shard);
    shards[job.bucket] = shard;
    const Bucket& bucket = buckets_[job.bucket];
    for (size_t k = 0; k < bucket.members.size(); ++k) bucket.members[k]->grad = bucket.layout.slot(shard, k);
  };
  pipelineBuckets(buckets_.size(), issue, finish);
  if (freeFullGrads_) heldGradShards_ = std::move(shards);
}

void DataParallelStrategy::publishParameters() {
  c10::NoGradGuard noGrad;
  // Replicated masters (no_shard; frozen parameters): the module's parameters themselves
  // in fp32 compute, else copied (cast) from them.
  if (!mastersAreParams_) {
    for (const ShardedParam& p : params()) {
      if (p.spec.placement() == Placement::kReplicate) p.moduleParam.detach().copy_(p.master);
    }
  }
  if (!sharded_) return;
  const int rank = comm_->rank();
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
    job.handle = comm_->allGatherIntoAsync(job.flat, chunk);
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
