// The events of a FullyShardStrategy's forward and backward over its units (see
// fsdp_state.h; the why of each rule: docs/design.md, "FSDP unit lifecycle").
#include "sharding/fsdp_state.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <unordered_set>

#include "common/errors.h"
#include "distributed/communicator.h"
#include "sharding/activation_checkpoint.h"
#include "sharding/grad_hooks.h"
#include "sharding/strategy.h"
#include "sharding/unit_storage.h"

namespace tessera::sharding {
namespace {

// Reduce-scatters in flight while the next units' backward runs. Each holds a flat buffer
// of a whole unit: units above kLargeReduceBytes go one at a time (a second would add a
// unit to the peak for no speed); small units are latency bound and overlap two.
constexpr size_t kMaxPendingReduces = 2;
constexpr int64_t kLargeReduceBytes = int64_t{4} << 20;

bool inBackward(const FsdpUnit& u) {
  return u.trainingState() == TrainingState::kPreBackward || u.trainingState() == TrainingState::kPostBackward;
}

}  // namespace

FullyShardState::FullyShardState(const FullyShardOptions& options, UnitContext context)
    : options_(options),
      context_(std::move(context)),
      pending_(kMaxPendingReduces, [](ReduceJob& job) { job.unit->finishReduce(job); }),
      gradHooks_(std::make_unique<GradReadyHooks>()) {
  context_.sample = [this] { sample(); };
}

FullyShardState::~FullyShardState() {
  gradHooks_.reset();  // removes the hooks
  // The storages outlive the state (the module keeps them): back to their own allocator.
  if (storageAllocator_) {
    for (const auto& u : units_) {
      for (const dtensor::ShardedParam* p : u->params()) {
        p->moduleParam.storage().unsafeGetStorageImpl()->set_allocator(storageAllocator_->inner());
      }
    }
  }
  // Gathers in flight are waited by ~FsdpUnit, reduce-scatters by ~InflightCollectives.
}

FsdpUnit& FullyShardState::addUnit(std::string name, const torch::nn::Module* module, bool isRoot) {
  units_.push_back(std::make_unique<FsdpUnit>(std::move(name), module, isRoot, context_));
  return *units_.back();
}

void FullyShardState::finishUnits() {
  int64_t largestReduce = 0;
  for (auto& up : units_) {
    FsdpUnit* u = up.get();
    for (size_t j = 0; j < u->trainableCount(); ++j) {
      gradHooks_->add(u->trainableParam(j), [this, u, j] { onGradReady(*u, j); });
    }
    byModule_[u->module()] = u;
    largestReduce = std::max(largestReduce, u->reduceBytes());
  }
  if (largestReduce > kLargeReduceBytes) pending_.setMaxInflight(1);
  peak_ = unshardedBytes();
}

void FullyShardState::claimStorages() {
  for (const auto& u : units_) {
    for (const dtensor::ShardedParam* p : u->params()) {
      c10::StorageImpl* storage = p->moduleParam.storage().unsafeGetStorageImpl();
      if (!storageAllocator_) storageAllocator_ = std::make_unique<UnitStorageAllocator>(this, storage->allocator());
      storage->set_allocator(storageAllocator_.get());
    }
  }
}

FsdpUnit* FullyShardState::unitOf(const torch::nn::Module& module) const {
  auto it = byModule_.find(&module);
  return it == byModule_.end() ? nullptr : it->second;
}

// ---- forward --------------------------------------------------------------------------

std::vector<at::Tensor> FullyShardState::runUnit(FsdpUnit& u, const std::vector<at::Tensor>& inputs,
                                                 const UnitFunction& fn) {
  const bool outer = forwardDepth_ == 0;
  TESSERA_CHECK(!outer || u.isRoot(), "FullyShardStrategy: unit '", u.name(),
                "' ran outside the root's forward; enter the root module first (declare it a sharding::Unit, or "
                "call it through sharding::unitForward)");
  TESSERA_CHECK(outer || !u.isRoot(), "FullyShardStrategy: the root unit was entered again inside its own forward");
  TESSERA_CHECK(checkpointedForwardDepth == 0, "FullyShardStrategy: unit '", u.name(),
                "' runs inside an activation-checkpointed unit; checkpointed units must not contain units");
  if (outer) {
    currentOrder_.clear();
    // A unit kept for a backward that has not run yet (two forwards before one backward,
    // or a forward without one) is not held through this forward: its backward gathers it.
    if (options_.reshardAfterForward) reshardKeptUnits(nullptr);
  }
  currentOrder_.push_back(&u);
  const size_t position = currentOrder_.size() - 1;
  enterForward(u, position);
  const bool grad = at::GradMode::is_enabled();
  std::vector<at::Tensor> outputs;
  {
    CounterGuard depth(forwardDepth_);
    outputs = grad && options_.activationCheckpointing && !u.isRoot() ? runCheckpointed(*this, u, inputs, fn)
                                                                       : fn(inputs);
  }
  exitForward(u, position, grad, outputs);
  if (outer) finishRootForward(grad);
  return outputs;
}

// Gathers the unit, then issues the next `prefetch` units' gathers in the recorded order
// (after this unit's own gather buffer is gone: (prefetch + 1) units at most).
void FullyShardState::enterForward(FsdpUnit& u, size_t position) {
  u.preForward();
  if (position >= forwardOrder_.size() || forwardOrder_[position] != &u) return;
  const size_t last = std::min(forwardOrder_.size() - 1, position + static_cast<size_t>(options_.prefetch));
  for (size_t j = position + 1; j <= last; ++j) forwardOrder_[j]->prefetch();
}

// Reshards the unit unless its backward follows at once: the root (FSDP2 keeps it too),
// and the unit the backward enters first (resharding would only gather it again while the
// loss is computed). Registers the pre-backward hook on every output that requires grad.
void FullyShardState::exitForward(FsdpUnit& u, size_t position, bool grad, const std::vector<at::Tensor>& outputs) {
  const bool backwardEntersHere = forwardDepth_ == 1 && keptUnit_ == &u && position + 1 == forwardOrder_.size();
  u.postForward(!grad || (options_.reshardAfterForward && !u.isRoot() && !backwardEntersHere));
  if (!grad) return;
  std::weak_ptr<int> token = alive_;
  FsdpUnit* unit = &u;
  for (const at::Tensor& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    out.register_hook([token, unit, this](const at::Tensor&) {
      if (token.lock()) preBackward(*unit);
    });
  }
}

// The root's forward is over: its order is the one prefetching follows from now on.
void FullyShardState::finishRootForward(bool grad) {
  forwardOrder_ = currentOrder_;
  FsdpUnit* last = forwardOrder_.back();
  keptUnit_ = options_.keepLastUnit && !last->isRoot() && last->trainableCount() > 0 && !last->gatherIsFree()
                  ? last
                  : nullptr;
  // This forward's order differed from the recorded one and kept a unit that is not its
  // last: free it now rather than when its gradients arrive.
  if (grad && options_.reshardAfterForward) reshardKeptUnits(last);
  backwardOrder_.clear();
  std::unordered_set<FsdpUnit*> seen;
  for (auto it = forwardOrder_.rbegin(); it != forwardOrder_.rend(); ++it) {
    if (!(*it)->isRoot() && seen.insert(*it).second) backwardOrder_.push_back(*it);
  }
  // Gathers prefetched for units this forward did not run (the order changed), and in
  // no-grad mode everything: no backward will free them.
  for (auto& u : units_) {
    if (!grad || u->shardedState() == ShardedState::kUnsharding) u->reshard();
  }
}

// Reshards every gathered unit but the root and `except` (with reshardAfterForward, the
// only ones gathered between a forward and its backward).
void FullyShardState::reshardKeptUnits(const FsdpUnit* except) {
  for (auto& u : units_) {
    if (!u->isRoot() && u.get() != except && u->shardedState() == ShardedState::kUnsharded) u->reshard();
  }
}

// ---- backward -------------------------------------------------------------------------

void FullyShardState::preBackward(FsdpUnit& u) {
  queueEndOfBackward();
  if (!u.preBackward()) return;
  // Prefetch, in reverse forward order, the next units autograd has not entered yet.
  int issued = 0;
  for (FsdpUnit* next : backwardOrder_) {
    if (issued >= options_.prefetch) break;
    if (next == &u || inBackward(*next)) continue;
    next->prefetch();
    ++issued;
  }
}

void FullyShardState::onGradReady(FsdpUnit& u, size_t j) {
  queueEndOfBackward();
  if (!u.gradReady(j)) return;
  u.postBackward(reshardsAfterBackward(u));
  if (sync_) reduce(u);
}

void FullyShardState::reduce(FsdpUnit& u) {
  if (u.reducedInPlace()) return;
  pending_.makeRoom();  // before the new job allocates its buffers
  pending_.push(u.startReduce());
}

void FullyShardState::queueEndOfBackward() {
  // Only the outer backward: a recompute's nested backward ends long before the step's.
  if (endOfBackwardQueued_ || recomputeDepth > 0) return;
  endOfBackwardQueued_ = true;
  queueAtEndOfBackward([this] { endBackward(); });
}

// End of every backward: reduce what the hooks left (each unit exactly once per
// synchronised backward, in unit order on every rank: parameters that got no gradient,
// units not reached, with zeros for what is missing), wait, free everything gathered.
void FullyShardState::endBackward() {
  endOfBackwardQueued_ = false;
  if (sync_) {
    for (auto& u : units_) {
      if (!u->reduced() && u->trainableCount() > 0) reduce(*u);
    }
  }
  pending_.drain();
  for (auto& u : units_) {
    if (reshardsAfterBackward(*u)) u->reshard();
    u->endBackward();
  }
  if (onBackwardEnd) onBackwardEnd();
}

void FullyShardState::drainReductions() { pending_.drain(); }

void FullyShardState::reduceRemaining() {
  pending_.drain();
  // Full gradients not reduced yet (the last backward ran without sync): reduce them now,
  // once, in unit order on every rank.
  for (auto& u : units_) {
    if (u->hasLocalGradients()) reduce(*u);
  }
  pending_.drain();
  for (auto& u : units_) u->endBackward();
}

// ---- accounting -----------------------------------------------------------------------

int64_t FullyShardState::unshardedBytes() const {
  int64_t bytes = 0;
  for (const auto& u : units_) bytes += u->unshardedBytes();
  return bytes;
}

void FullyShardState::sample() { peak_ = std::max(peak_, unshardedBytes()); }

std::vector<at::Tensor> FullyShardState::gradShards() const {
  std::vector<at::Tensor> out;
  for (const auto& u : units_) {
    if (u->gradShard().defined()) out.push_back(u->gradShard());
  }
  return out;
}

}  // namespace tessera::sharding
