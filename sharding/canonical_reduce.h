// run.deterministic's reductions: sums whose bits depend on the micro-batches alone, never on
// how many ranks computed them, which rank computed what, or the strategy that reduces.
//
// A step's global batch is `count` micro-batches (data.micro_batch samples each), rank r
// computing the contiguous range [begin(r), end(r)). Their gradients are added in one fixed
// binary tree over the micro-batch indices (the canonical tree: a node [lo, hi) of two or
// more leaves splits at lo + the largest power of two below hi - lo), each node the sum
// left + right of its children. A rank adds the leaves it computed as far as the tree lets
// it (the nodes wholly inside its range: its frontier); the nodes that span ranks are added
// by the rank that owns a slice of the result, from every rank's frontier, in the same
// order. Floating-point addition is commutative, so every node has the same bits wherever
// it is added: the root is the same sum on 1 rank or 64, under no_shard or zero3.
//
// The bytes: a rank sends each frontier node's slices once (a reduce-scatter sends one
// flat), so a step moves frontier-size times a reduce-scatter: 1x where every rank's range
// is a node of the tree (a power of two of micro-batches per rank), at most log2(count) + 1.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace tessera::distributed {
class Communicator;
}

namespace tessera::sharding {

// The micro-batches of a step and which rank computes which.
struct MicroBatchPlan {
  int64_t count = 0;  // micro-batches in a step (>= world)
  int world = 1;
  int64_t begin(int rank) const { return count * rank / world; }
  int64_t end(int rank) const { return count * (rank + 1) / world; }
  // Forward and backward passes every rank runs: the most any rank has. A rank with fewer
  // runs the rest as passes whose gradients are dropped (index -1), so that zero3's
  // gathers stay matched across ranks.
  int64_t passes() const { return (count + world - 1) / world; }
};

// A node [lo, hi) of the canonical tree over [0, count).
struct TreeNode {
  int64_t lo = 0, hi = 0;
  bool operator==(const TreeNode& o) const { return lo == o.lo && hi == o.hi; }
};

// The canonical tree's maximal nodes inside [begin, end), in index order: what a rank
// holding those leaves adds by itself.
std::vector<TreeNode> frontier(int64_t count, int64_t begin, int64_t end);

// Nodes added in index order, siblings merged as soon as both are in: the stack a rank's
// leaves (or the owner's received frontiers) go through. Each entry's tensor is the node's
// sum; merging adds the right child into the left one's tensor.
class TreeStack {
 public:
  explicit TreeStack(int64_t count) : count_(count) {}
  void push(TreeNode node, at::Tensor sum);
  const std::vector<std::pair<TreeNode, at::Tensor>>& nodes() const { return stack_; }
  bool empty() const { return stack_.empty(); }
  void clear() { stack_.clear(); }

 private:
  int64_t count_;
  std::vector<std::pair<TreeNode, at::Tensor>> stack_;
};

// The destination of one flat's sum: what world rank r receives is elements
// [offset(r), offset(r) + length(r)) of the sum, padded to `sliceNumel`.
struct SliceLayout {
  std::vector<int64_t> offsets, lengths;
  int64_t sliceNumel = 0;
  // A layout of `chunks` equal chunks of `chunkNumel` (a FlatLayout's) over a world of
  // `world` ranks: chunk c split into world / chunks consecutive slices, rank r getting
  // slice r / chunks of chunk r % chunks (zero3: its chunk; hybrid: a part of its shard
  // group's chunk; no_shard, one chunk: a 1/world part of it).
  static SliceLayout ofChunks(int chunks, int64_t chunkNumel, int world);
};

// The canonical sum of one flat (the same on every rank's call): this rank's frontier sums
// `mine` (nodes of frontier(plan.count, plan.begin(rank), plan.end(rank)), each the flat's
// full length) in, this rank's slice of the root out ([sliceNumel], padding zero).
// Collective over `world` (every rank, same order): one gather to each rank in turn.
at::Tensor canonicalReduceScatter(distributed::Communicator& world, const MicroBatchPlan& plan,
                                  const std::vector<std::pair<TreeNode, at::Tensor>>& mine, const SliceLayout& slices);

// The canonical sums of a step's gradients, by group (a gradient bucket, a zero3 unit):
// each micro-batch's packed gradients added as a leaf, then reduced at the step.
class CanonicalGradients {
 public:
  explicit CanonicalGradients(MicroBatchPlan plan) : plan_(plan) {}
  const MicroBatchPlan& plan() const { return plan_; }
  // Micro-batch `index`'s gradients of group `group` (a flat; -1: a padding pass, dropped).
  void add(size_t group, int64_t index, at::Tensor flat);
  // Group `group`'s sum over every micro-batch, this rank's slice of it (see
  // canonicalReduceScatter); its leaves are dropped. A group no leaf reached sums zeros of
  // `flatNumel` elements in `options`.
  at::Tensor reduce(size_t group, distributed::Communicator& world, const SliceLayout& slices, int64_t flatNumel,
                    const at::TensorOptions& options);
  void clear() { stacks_.clear(); }

 private:
  MicroBatchPlan plan_;
  std::map<size_t, TreeStack> stacks_;
};

// Values given per micro-batch (losses), summed in index order: this rank's values in by
// index, the sum over all `count` out, the same on every rank. Collective over `world`.
double canonicalValueSum(distributed::Communicator& world, int64_t count, const std::map<int64_t, double>& mine);

}  // namespace tessera::sharding
