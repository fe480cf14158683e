// run.deterministic's canonical tree and its reduce-scatter (see canonical_reduce.h).
#include "sharding/canonical_reduce.h"

#include <c10/core/GradMode.h>

#include <algorithm>

#include "common/errors.h"
#include "distributed/communicator.h"

namespace tessera::sharding {
namespace {

// The split point of node [lo, hi) (hi - lo >= 2): lo + the largest power of two below hi - lo.
int64_t splitOf(const TreeNode& n) {
  int64_t half = 1;
  while (half * 2 < n.hi - n.lo) half *= 2;
  return n.lo + half;
}

// The parent of `node` in the tree over [0, count); nullopt-like {0, 0} for the root or a
// range that is no node of the tree.
TreeNode parentOf(const TreeNode& node, int64_t count) {
  TreeNode at{0, count};
  while (at.hi - at.lo >= 2) {
    const int64_t mid = splitOf(at);
    const TreeNode left{at.lo, mid}, right{mid, at.hi};
    if (left == node || right == node) return at;
    if (node.lo >= mid) {
      at = right;
    } else if (node.hi <= mid) {
      at = left;
    } else {
      break;
    }
  }
  return {0, 0};
}

void collectFrontier(const TreeNode& at, int64_t begin, int64_t end, std::vector<TreeNode>& out) {
  if (at.hi <= begin || at.lo >= end) return;
  if (at.lo >= begin && at.hi <= end) {
    out.push_back(at);
    return;
  }
  const int64_t mid = splitOf(at);
  collectFrontier({at.lo, mid}, begin, end, out);
  collectFrontier({mid, at.hi}, begin, end, out);
}

}  // namespace

std::vector<TreeNode> frontier(int64_t count, int64_t begin, int64_t end) {
  std::vector<TreeNode> out;
  if (count > 0) collectFrontier({0, count}, std::max<int64_t>(0, begin), std::min(count, end), out);
  return out;
}

void TreeStack::push(TreeNode node, at::Tensor sum) {
  c10::NoGradGuard noGrad;
  stack_.emplace_back(node, std::move(sum));
  while (stack_.size() >= 2) {
    auto& left = stack_[stack_.size() - 2];
    const auto& right = stack_.back();
    const TreeNode parent = parentOf(left.first, count_);
    if (left.first.hi != right.first.lo || !(parent == TreeNode{left.first.lo, right.first.hi})) break;
    left.second.add_(right.second);  // left + right: the node's sum, whichever rank adds it
    left.first = parent;
    stack_.pop_back();
  }
}

SliceLayout SliceLayout::ofChunks(int chunks, int64_t chunkNumel, int world) {
  TESSERA_CHECK(chunks >= 1 && world % chunks == 0, "SliceLayout: ", chunks, " chunks do not divide ", world, " ranks");
  const int parts = world / chunks;
  SliceLayout s;
  s.sliceNumel = (chunkNumel + parts - 1) / parts;
  for (int r = 0; r < world; ++r) {
    const int chunk = r % chunks, part = r / chunks;
    // A part past the chunk's end (more parts than elements) is empty, placed at the end so
    // that narrowing a flat by it stays in range.
    const int64_t start = std::min(static_cast<int64_t>(part) * s.sliceNumel, chunkNumel);
    s.offsets.push_back(static_cast<int64_t>(chunk) * chunkNumel + start);
    s.lengths.push_back(std::clamp<int64_t>(chunkNumel - start, 0, s.sliceNumel));
  }
  return s;
}

at::Tensor canonicalReduceScatter(distributed::Communicator& world, const MicroBatchPlan& plan,
                                  const std::vector<std::pair<TreeNode, at::Tensor>>& mine, const SliceLayout& slices) {
  c10::NoGradGuard noGrad;
  const int ranks = world.worldSize(), me = world.rank();
  TESSERA_CHECK(plan.world == ranks && static_cast<int>(slices.offsets.size()) == ranks,
                "canonicalReduceScatter: a plan or slices for ", plan.world, " / ", slices.offsets.size(), " ranks on ",
                world.describe());
  std::vector<std::vector<TreeNode>> frontiers(static_cast<size_t>(ranks));
  size_t most = 0;
  for (int r = 0; r < ranks; ++r) {
    frontiers[static_cast<size_t>(r)] = frontier(plan.count, plan.begin(r), plan.end(r));
    most = std::max(most, frontiers[static_cast<size_t>(r)].size());
  }
  const std::vector<TreeNode>& expected = frontiers[static_cast<size_t>(me)];
  TESSERA_CHECK(mine.size() == expected.size(), "canonicalReduceScatter: rank ", me, " holds ", mine.size(),
                " sums of micro-batches ", plan.begin(me), "..", plan.end(me) - 1, ", the tree has ", expected.size());
  for (size_t i = 0; i < mine.size(); ++i) {
    TESSERA_CHECK(mine[i].first == expected[i], "canonicalReduceScatter: rank ", me, "'s sum ", i, " is of micro-batches ",
                  mine[i].first.lo, "..", mine[i].first.hi - 1, ", the tree's is ", expected[i].lo, "..",
                  expected[i].hi - 1);
  }
  const at::TensorOptions options = mine.front().second.options();
  const int64_t q = slices.sliceNumel, f = static_cast<int64_t>(most);
  at::Tensor received;
  for (int root = 0; root < ranks; ++root) {
    // What `root` owns of each of this rank's sums, padded to the most sums any rank has.
    at::Tensor send = at::zeros({f, q}, options);
    const int64_t offset = slices.offsets[static_cast<size_t>(root)], length = slices.lengths[static_cast<size_t>(root)];
    for (size_t i = 0; i < mine.size() && length > 0; ++i) {
      send[static_cast<int64_t>(i)].narrow(0, 0, length).copy_(mine[i].second.reshape({-1}).narrow(0, offset, length));
    }
    const at::Tensor out = root == me ? at::empty({ranks * f, q}, options) : at::Tensor();
    world.gatherToRoot(out, send.reshape({-1}), root);
    if (root == me) received = out;
  }
  // Every rank's sums in index order (ranks hold consecutive ranges), merged up the tree.
  TreeStack stack(plan.count);
  for (int r = 0; r < ranks; ++r) {
    const std::vector<TreeNode>& nodes = frontiers[static_cast<size_t>(r)];
    // Rows of `received`, each used once: the tree adds into them in place.
    for (size_t i = 0; i < nodes.size(); ++i) stack.push(nodes[i], received[r * f + static_cast<int64_t>(i)]);
  }
  TESSERA_CHECK(stack.nodes().size() == 1 && stack.nodes().front().first == (TreeNode{0, plan.count}),
                "canonicalReduceScatter: the micro-batches' sums did not add up to one root");
  return stack.nodes().front().second;
}

void CanonicalGradients::add(size_t group, int64_t index, at::Tensor flat) {
  if (index < 0) return;
  auto it = stacks_.try_emplace(group, plan_.count).first;
  it->second.push({index, index + 1}, std::move(flat));
}

at::Tensor CanonicalGradients::reduce(size_t group, distributed::Communicator& world, const SliceLayout& slices,
                                      int64_t flatNumel, const at::TensorOptions& options) {
  auto it = stacks_.find(group);
  std::vector<std::pair<TreeNode, at::Tensor>> mine;
  if (it != stacks_.end()) {
    mine = it->second.nodes();
    stacks_.erase(it);
  } else {
    // No leaf reached this group on this rank: each of its frontier's sums is zeros.
    for (const TreeNode& node : frontier(plan_.count, plan_.begin(world.rank()), plan_.end(world.rank()))) {
      mine.emplace_back(node, at::zeros({flatNumel}, options));
    }
  }
  return canonicalReduceScatter(world, plan_, mine, slices);
}

double canonicalValueSum(distributed::Communicator& world, int64_t count, const std::map<int64_t, double>& mine) {
  // Each value comes from exactly one rank, the others add +0: the all-reduce moves values,
  // it does not round them; the sum is then taken in index order.
  at::Tensor values = at::zeros({count}, at::kDouble);
  for (const auto& [index, value] : mine) {
    TESSERA_CHECK(index >= 0 && index < count, "canonicalValueSum: index ", index, " of ", count);
    values[index] = value;
  }
  distributed::allReduceHostTensor(world, values, distributed::ReduceOp::kSum);
  double sum = 0;
  const double* v = values.data_ptr<double>();
  for (int64_t i = 0; i < count; ++i) sum += v[i];
  return sum;
}

}  // namespace tessera::sharding
