// no_shard / zero1 / zero2 (see data_parallel.h).
#include "sharding/data_parallel.h"

#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <deque>

#include "common/errors.h"
#include "distributed/communicator.h"

namespace tessera::sharding {
namespace {

// One bucket's collective in flight, with the buffers it reads and writes.
struct InflightBucket {
  size_t bucket = 0;
  at::Tensor flat;
  at::Tensor local;  // reduce-scatter output (zero1/zero2)
  std::shared_ptr<distributed::CommHandle> handle;
};

// Issues one collective per bucket through `issue`, keeping at most `maxInflight` in
// flight, and hands each to `finish` (after its wait) in bucket order.
template <typename Issue, typename Finish>
void pipelineBuckets(size_t buckets, size_t maxInflight, Issue issue, Finish finish) {
  std::deque<InflightBucket> inflight;
  auto drainOne = [&] {
    InflightBucket job = std::move(inflight.front());
    inflight.pop_front();
    job.handle->wait();
    finish(job);
  };
  for (size_t b = 0; b < buckets; ++b) {
    if (inflight.size() >= maxInflight) drainOne();
    inflight.push_back(issue(b));
  }
  while (!inflight.empty()) drainOne();
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
  for (const NamedParam& np : trainableParams()) {
    const at::Tensor& p = np.param;
    const std::vector<int64_t> shape = p.sizes().vec();
    const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(p.device());
    if (!sharded_) {
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
  std::vector<int64_t> bytes;
  for (size_t i = 0; i < paramCount(); ++i) {
    const ShardSpec& s = specAt(i);
    bytes.push_back((sharded_ ? s.paddedNumel() * world : s.globalNumel()) * elementBytes);
  }
  for (auto& members : planBuckets(bytes, options_.bucketBytes)) {
    std::vector<ShardSpec> specs;
    for (size_t i : members) specs.push_back(specAt(i));
    buckets_.push_back({std::move(members), FlatLayout(std::move(specs))});
  }
}

std::vector<at::Tensor> DataParallelStrategy::synchronizeGradients() {
  return sharded_ ? reduceScatterGradients() : allReduceGradients();
}

std::vector<at::Tensor> DataParallelStrategy::allReduceGradients() {
  std::vector<at::Tensor> grads(paramCount());
  c10::NoGradGuard noGrad;
  auto issue = [&](size_t b) {
    const Bucket& bucket = buckets_[b];
    InflightBucket job;
    job.bucket = b;
    job.flat = at::empty({bucket.layout.flatNumel()},
                         at::TensorOptions().dtype(options_.reduceDtype).device(param(bucket.members[0]).device()));
    for (size_t k = 0; k < bucket.members.size(); ++k) {
      bucket.layout.packFull(job.flat, k, param(bucket.members[k]).grad());
    }
    // kAvg: the one division by N of the gradient average.
    job.handle = comm_->allReduceAsync(job.flat, distributed::ReduceOp::kAvg);
    return job;
  };
  auto finish = [&](InflightBucket& job) {
    const Bucket& bucket = buckets_[job.bucket];
    for (size_t k = 0; k < bucket.members.size(); ++k) {
      const size_t i = bucket.members[k];
      const at::Tensor average = bucket.layout.slot(job.flat, k);
      at::Tensor& grad = param(i).mutable_grad();
      if (!grad.defined()) grad = at::empty_like(param(i).detach());
      grad.copy_(average);  // the module's gradients are the averaged ones, as in DDP
      // Hand the optimizer the reduce-dtype values (fp32 by default), not a bf16 rounding.
      grads[i] = grad.scalar_type() == options_.reduceDtype ? grad : average;
    }
  };
  pipelineBuckets(buckets_.size(), kMaxInflightBuckets, issue, finish);
  return grads;
}

std::vector<at::Tensor> DataParallelStrategy::reduceScatterGradients() {
  std::vector<at::Tensor> grads(paramCount());
  std::vector<at::Tensor> shards(buckets_.size());
  // zero2 without zeroGrad() since the last step: add to the shards it kept, as torch
  // accumulates into .grad().
  const bool accumulate = freeFullGrads_ && heldGradShards_.size() == buckets_.size();
  c10::NoGradGuard noGrad;
  auto issue = [&](size_t b) {
    const Bucket& bucket = buckets_[b];
    const auto options =
        at::TensorOptions().dtype(options_.reduceDtype).device(param(bucket.members[0]).device());
    InflightBucket job;
    job.bucket = b;
    job.flat = at::empty({bucket.layout.flatNumel()}, options);
    for (size_t k = 0; k < bucket.members.size(); ++k) {
      const at::Tensor& p = param(bucket.members[k]);
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
    for (size_t k = 0; k < bucket.members.size(); ++k) grads[bucket.members[k]] = bucket.layout.slot(shard, k);
  };
  pipelineBuckets(buckets_.size(), kMaxInflightBuckets, issue, finish);
  if (freeFullGrads_) heldGradShards_ = std::move(shards);
  return grads;
}

void DataParallelStrategy::publishParameters() {
  c10::NoGradGuard noGrad;
  if (!sharded_) {
    if (mastersAreParams_) return;  // the optimizer stepped the parameters themselves
    for (size_t i = 0; i < paramCount(); ++i) param(i).detach().copy_(master(i));
    return;
  }
  const int rank = comm_->rank();
  auto issue = [&](size_t b) {
    const Bucket& bucket = buckets_[b];
    InflightBucket job;
    job.bucket = b;
    job.flat = at::empty({bucket.layout.flatNumel()},
                         at::TensorOptions().dtype(options_.paramDtype).device(param(bucket.members[0]).device()));
    // This rank's chunk, cast to the compute dtype before gathering (same values as
    // gathering fp32 and casting: rounding is elementwise).
    at::Tensor chunk = bucket.layout.chunk(job.flat, rank);
    for (size_t k = 0; k < bucket.members.size(); ++k) bucket.layout.slot(chunk, k).copy_(master(bucket.members[k]));
    job.handle = comm_->allGatherIntoAsync(job.flat, chunk);
    return job;
  };
  auto finish = [&](InflightBucket& job) {
    const Bucket& bucket = buckets_[job.bucket];
    for (size_t k = 0; k < bucket.members.size(); ++k) bucket.layout.unpackFull(job.flat, k, param(bucket.members[k]));
  };
  pipelineBuckets(buckets_.size(), kMaxInflightBuckets, issue, finish);
}

}  // namespace tessera::sharding
