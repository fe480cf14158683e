// DataParallelStrategy: no_shard (DDP), zero1 and zero2 — every rank holds the full
// parameters and runs the whole model on its slice of the global batch; what differs is
// which training state is sharded:
//   no_shard  gradients all-reduced (averaged) in buckets; masters and optimizer replicated.
//   zero1     gradients reduce-scattered into Shard(0) shards; each rank updates its rows
//             of the masters, then one all-gather per bucket rebuilds the parameters; the
//             full gradients stay in .grad() until zeroGrad().
//   zero2     as zero1, but each bucket's full gradients are freed as soon as they are
//             packed for the reduce-scatter.
// no_shard and zero2 reduce during backward, bucket by bucket as DDP does; zero1 at step().
// With StrategyOptions::stateGroupSize, what is sharded is sharded inside each group of that
// many ranks (every group holding all of it, as hybrid's shard groups do): zero1/zero2
// reduce-scatter inside the group and then average their shards across the groups.
// Buckets, the overlap with backward, master weights and the bytes sent per step:
// docs/design.md, "Data-parallel strategies".
#pragma once

#include <memory>
#include <vector>

#include "dtensor/flat_layout.h"
#include "sharding/strategy.h"

namespace tessera::sharding {

class DataParallelStrategy final : public ShardingStrategy {
 public:
  static constexpr size_t kMaxInflightBuckets = 2;

  // options.strategy: no_shard, zero1 or zero2 (tessera::ConfigError otherwise).
  // Collective over `comm` (initial broadcast). The module's parameters live on one
  // device the communicator accepts (CPU, or CUDA for nccl and for gloo's staging).
  DataParallelStrategy(torch::nn::Module& module, std::shared_ptr<distributed::Communicator> comm,
                       StrategyOptions options);

  ~DataParallelStrategy() override;

  void publishParameters() override;
  void zeroGrad() override;
  // false: the backward passes that follow accumulate their gradients locally (DDP's
  // no_sync); step() reduces them once.
  void setRequiresGradientSync(bool sync) override { sync_ = sync; }

  // How many gradient buckets (one collective each per reduction).
  size_t bucketCount() const { return buckets_.size(); }

  struct Overlap;  // the backward hooks and the collectives in flight (data_parallel.cpp)

 protected:
  void synchronizeGradients() override;
  std::vector<GradGroup> gradGroups() const override;

 private:
  struct Bucket {
    Bucket(std::vector<dtensor::ShardedParam*> params, dtensor::FlatLayout flat)
        : members(std::move(params)), layout(std::move(flat)), ready(members.size(), false) {}
    std::vector<dtensor::ShardedParam*> members;
    dtensor::FlatLayout layout;
    // This step's reduction state.
    std::vector<bool> ready;  // member's gradient in, in this backward
    size_t readyCount = 0;
    bool issued = false;      // reduced by a synchronised backward since the last step
    bool local = false;       // holds local gradients no reduction has seen
    at::Tensor shard;         // zero1/zero2: the reduced gradient shards (FlatLayout chunk)
    at::Tensor average;       // no_shard with 16-bit gradients: the fp32 averages
  };

  // Issues bucket b's collective (waiting for the oldest in flight first); its result
  // lands when finishBucket runs.
  void issueBucket(size_t b);
  void finishBucket(size_t b, at::Tensor flat, at::Tensor local);
  // Issues, in bucket order, every bucket whose gradients are all in (`all`: every bucket
  // not issued yet, with zeros for missing gradients).
  void issueReadyBuckets(bool all);
  void onGradReady(size_t b, size_t k);

  bool sharded_ = false;          // zero1 / zero2
  bool freeFullGrads_ = false;    // zero2
  bool mastersAreParams_ = false; // fp32 compute: masters alias the module's parameters
  bool overlap_ = false;          // no_shard / zero2: reduce during backward
  bool sync_ = true;
  bool callbackQueued_ = false;
  size_t nextToIssue_ = 0;
  std::vector<Bucket> buckets_;
  std::unique_ptr<Overlap> inflight_;
  // zero1/zero2 in state groups (StrategyOptions::stateGroupSize): the ranks holding the
  // same rows in the other groups, over which the group's reduced shards are averaged.
  std::shared_ptr<distributed::Communicator> replicaComm_;
};

}  // namespace tessera::sharding
