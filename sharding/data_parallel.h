// DataParallelStrategy: no_shard (DDP), zero1 and zero2 — every rank holds the full
// parameters and runs the whole model on its slice of the global batch; what differs is
// which training state is sharded (docs/design.md, "Sharding"):
//
//   no_shard  gradients all-reduced (averaged) in buckets; masters, optimizer replicated
//             (Replicate specs; every rank applies the same update).
//   zero1     gradients reduce-scattered in buckets into Shard(0) gradient shards; each
//             rank updates its rows of the masters (optimizer states sharded), then one
//             all-gather per bucket rebuilds the full parameters. The full (local,
//             unreduced) gradients stay in the module's .grad() until zeroGrad().
//   zero2     as zero1, but each bucket's full gradients are freed (.grad() reset) as soon
//             as they are packed for the reduce-scatter; the reduced gradient shards are
//             what the strategy keeps until zeroGrad().
//
// Per step, per rank, in bytes of the reduce/param dtype: no_shard all-reduces
// 2 Psi (N-1)/N; zero1/zero2 reduce-scatter Psi' (N-1)/N and all-gather Psi' (N-1)/N,
// where Psi' = Psi + padding (each parameter padded to N x ceil(rows/N) rows). Plus
// one all-reduce of one double for the global gradient norm (zero1/zero2, N > 1).
//
// Buckets: trainable parameters in reverse registration order (the order backward
// produces their gradients, as DDP), grouped into buckets of at most options.bucketBytes
// (counted in the flat reduce buffer, padding included; a larger parameter is a bucket of
// its own). A bucket's flat buffer is rank-major (FlatLayout), so one collective per
// bucket moves every member. At most kMaxInflightBuckets buckets are in flight, so the
// transient buffers stay within a few buckets.
//
// Reduction overlapped with backward (no_shard and zero2): a hook on each parameter's
// gradient accumulator counts the bucket's gradients in; once all are, the bucket's
// collective is issued while the rest of backward runs (buckets are issued in bucket
// order on every rank, so their collectives pair up). zero2 frees each bucket's full
// gradients there, so they never all exist at once (its memory is 4 Psi + 12 Psi/N, not
// 8 Psi + 12 Psi/N). A callback at the end of every backward issues the buckets whose
// gradients did not all arrive (unused parameters: zeros). step() waits for them and
// reduces what no backward did: everything under zero1, which keeps its full gradients
// anyway and reduces at step time, and the local gradients of backward passes run with
// setRequiresGradientSync(false) (DDP's no_sync: accumulate, reduce once at the end).
// Several synchronised backward passes before one step accumulate as torch does (zero2
// adds the reduced shards; no_shard's gradients are averages, to which the next backward
// adds, and the average of that sum is the sum of the averages).
//
// Master weights. fp32 compute: no_shard's masters are the module's parameters; for
// zero1/zero2 each parameter's storage is reallocated padded to N x chunkRows rows, the
// module parameter views its real rows and the master is this rank's chunk of the same
// storage, so the masters cost nothing beyond padding (8 Psi + 8 Psi/N, not + 4 Psi/N).
// bf16/fp16 compute: masters are separate fp32 buffers (no_shard: full; zero1/2: one
// shard), the module's parameters are cast copies, refreshed after every step (zero1/2:
// the shards are cast before the all-gather, which equals gathering fp32 and casting,
// at half the bytes).
//
// Parameters without a gradient on a rank contribute zeros to the average (every rank
// takes part in every bucket's collective); they are then stepped with that gradient.
#pragma once

#include <memory>
#include <vector>

#include "sharding/flat_layout.h"
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

 private:
  struct Bucket {
    Bucket(std::vector<ShardedParam*> params, FlatLayout flat)
        : members(std::move(params)), layout(std::move(flat)), ready(members.size(), false) {}
    std::vector<ShardedParam*> members;
    FlatLayout layout;
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
};

}  // namespace tessera::sharding
