// ZeRO-3 units: sharding, gather/free of parameter storage, forward/backward hooks,
// prefetch, reduce-scatter of gradients, activation checkpointing (see fully_shard.h).
#include "sharding/fully_shard.h"

#include <c10/core/GradMode.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/Allocator.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "common/errors.h"
#include "distributed/communicator.h"
#include "distributed/device_mesh.h"
#include "sharding/flat_layout.h"
#include "sharding/grad_hooks.h"
#include "sharding/inflight.h"

namespace tessera::sharding {

// One FSDP unit: the parameters one module owns, their shards and their gather state.
struct FsdpUnit {
  enum class State { kSharded, kGathering, kUnsharded };

  std::string name;                  // qualified module name; "" for the root
  const torch::nn::Module* module = nullptr;
  bool isRoot = false;
  std::vector<ShardedParam*> params; // the strategy's records; slot k of `layout` is params[k]
  std::unique_ptr<FlatLayout> layout;// gathered: every parameter, frozen ones too
  at::Tensor masterChunk;            // fp32 [chunkNumel]: every member's master, FlatLayout slots
  // Reduced: the trainable parameters only. Slot j of `gradLayout` is params[trainable[j]].
  std::vector<size_t> trainable;
  std::unique_ptr<FlatLayout> gradLayout;
  at::Tensor gradShard;              // fp32 [gradLayout chunkNumel]: reduced gradients, accumulating
  int64_t paramBytes = 0;            // full parameters in paramDtype
  int64_t gatherBytes = 0;           // flat gather buffer

  State state = State::kSharded;
  at::Tensor flat;                   // gather buffer while kGathering
  std::shared_ptr<distributed::CommHandle> gather;

  // Per backward (over the trainable parameters).
  std::vector<bool> ready;
  size_t readyCount = 0;
  bool preBackwardDone = false;
  bool reduced = false;

  const at::Tensor& moduleParam(size_t k) const { return params[k]->moduleParam; }
  const at::Tensor& trainableParam(size_t j) const { return params[trainable[j]]->moduleParam; }
};

namespace {

// Reduce-scatters in flight while the next units' backward runs. Each holds a flat
// buffer of a whole unit: with units above kLargeReduceBytes, one at a time (a second
// added a unit to the peak and made a 67M-parameter CPU step no faster); small units are
// latency bound, and two in flight made the main job's step 20% faster (bench/).
constexpr size_t kMaxPendingReduces = 2;
constexpr int64_t kLargeReduceBytes = int64_t{4} << 20;

size_t fullBytes(const at::Tensor& p) { return static_cast<size_t>(p.numel()) * p.element_size(); }

}  // namespace

// The allocator of every parameter storage a strategy holds: it allocates through the
// storage's own allocator (the CPU's, or CUDA's caching allocator) when a unit is gathered,
// and marks the storage as the strategy's (see "where a unit lives", fully_shard.h).
class UnitStorageAllocator final : public c10::Allocator {
 public:
  UnitStorageAllocator(FullyShardStrategy::Internal* owner, c10::Allocator* inner) : owner_(owner), inner_(inner) {}
  c10::DataPtr allocate(size_t bytes) const override { return inner_->allocate(bytes); }
  c10::DeleterFnPtr raw_deleter() const override { return inner_->raw_deleter(); }
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  void copy_data(void* dest, const void* src, std::size_t count) const override { inner_->copy_data(dest, src, count); }
#endif
  FullyShardStrategy::Internal* owner() const { return owner_; }
  c10::Allocator* inner() const { return inner_; }

 private:
  FullyShardStrategy::Internal* owner_;
  c10::Allocator* inner_;
};

struct FullyShardStrategy::Internal {
  explicit Internal(FullyShardStrategy& strategy) : s(strategy) {}

  FullyShardStrategy& s;
  std::vector<std::unique_ptr<FsdpUnit>> units;  // root last
  std::vector<FsdpUnit*> currentOrder;   // units entered in the running forward
  std::vector<FsdpUnit*> forwardOrder;   // of the last completed forward
  std::vector<FsdpUnit*> backwardOrder;  // reverse of forwardOrder, each unit once, no root
  // Position in forwardOrder of the unit the backward enters first, kept gathered from its
  // forward into its backward: the last unit entered, when it is a child of the root with
  // trainable parameters (SIZE_MAX otherwise).
  size_t keepPosition = SIZE_MAX;
  int depth = 0;                         // unitForward nesting
  int checkpointedForwardDepth = 0;      // inside a checkpointed unit's forward
  int recomputeDepth = 0;                // inside a recompute's nested backward
  bool callbackQueued = false;
  struct PendingReduce {
    FsdpUnit* unit;
    at::Tensor flat, local;
    std::shared_ptr<distributed::CommHandle> handle;
  };
  InflightCollectives<PendingReduce> pending{kMaxPendingReduces, [this](PendingReduce& job) { finishReduce(job); }};
  // The units by module, for unitForward.
  std::unordered_map<const torch::nn::Module*, FsdpUnit*> unitOf;
  // Allocates the parameters' storage and marks it as ours (one for all: one device).
  std::unique_ptr<UnitStorageAllocator> storageAllocator;
  // On the trainable parameters' gradient accumulators: onGradReady.
  std::unique_ptr<GradReadyHooks> gradHooks = std::make_unique<GradReadyHooks>();
  // Output hooks hold a weak reference: a graph outliving the strategy does nothing.
  std::shared_ptr<int> alive = std::make_shared<int>(0);

  int shardRank() const { return s.shardComm_->rank(); }

  void sample() { s.peak_ = std::max(s.peak_, s.unshardedParamBytes()); }

  // ---- gather / free -----------------------------------------------------------------
  void issueGather(FsdpUnit& u) {
    if (u.state != FsdpUnit::State::kSharded) return;
    if (u.params.empty()) {  // e.g. a root whose children are all units: nothing to gather
      u.state = FsdpUnit::State::kUnsharded;
      return;
    }
    u.flat = at::empty({u.layout->flatNumel()}, u.masterChunk.options().dtype(s.options_.paramDtype));
    at::Tensor chunk = u.layout->chunk(u.flat, shardRank());
    chunk.copy_(u.masterChunk);  // cast to the compute dtype before gathering: half the bytes in bf16
    u.gather = s.shardComm_->allGatherIntoAsync(u.flat, chunk);
    u.state = FsdpUnit::State::kGathering;
    sample();
  }

  void unshard(FsdpUnit& u) {
    issueGather(u);
    if (u.state != FsdpUnit::State::kGathering) return;
    u.gather->wait();
    u.gather.reset();
    for (size_t k = 0; k < u.params.size(); ++k) {
      const at::Tensor& p = u.moduleParam(k);
      setStorageBytes(p, fullBytes(p));
      // variable_data(): a new version counter, so autograd's saved references to p do not
      // see a modification.
      u.layout->unpackFull(u.flat, k, p.variable_data());
    }
    u.state = FsdpUnit::State::kUnsharded;
    sample();  // the flat buffer and the full parameters, both alive for this moment

    u.flat = at::Tensor();
  }

  void reshard(FsdpUnit& u) {
    if (u.state == FsdpUnit::State::kGathering) {
      u.gather->wait();  // never leave a collective unwaited
      u.gather.reset();
      u.flat = at::Tensor();
    } else if (u.state == FsdpUnit::State::kUnsharded) {
      for (const ShardedParam* p : u.params) setStorageBytes(p->moduleParam, 0);
    }
    u.state = FsdpUnit::State::kSharded;
  }

  // ---- forward -----------------------------------------------------------------------
  std::vector<at::Tensor> runUnit(FsdpUnit& u, const std::vector<at::Tensor>& inputs, const UnitFunction& fn) {
    const bool outer = depth == 0;
    TESSERA_CHECK(!outer || u.isRoot, "FullyShardStrategy: unit '", u.name,
                  "' ran outside the root's forward; enter the root module through unitForward first");
    TESSERA_CHECK(outer || !u.isRoot, "FullyShardStrategy: the root unit was entered again inside its own forward");
    TESSERA_CHECK(checkpointedForwardDepth == 0, "FullyShardStrategy: unit '", u.name,
                  "' runs inside an activation-checkpointed unit; checkpointed units must not contain units");
    if (outer) {
      currentOrder.clear();
      // A unit kept for a backward that has not run yet (two forwards before one backward,
      // or a forward without one) is not held through this forward: its backward gathers
      // it again.
      if (s.fsdp_.reshardAfterForward) reshardKeptUnits(nullptr);
    }
    currentOrder.push_back(&u);
    const size_t position = currentOrder.size() - 1;
    unshard(u);
    // Issued after this unit's own gather buffer is gone: (prefetch + 1) units at most.
    if (position < forwardOrder.size() && forwardOrder[position] == &u) {
      for (size_t j = position + 1; j < forwardOrder.size() && j <= position + static_cast<size_t>(s.fsdp_.prefetch);
           ++j) {
        issueGather(*forwardOrder[j]);
      }
    }
    const bool grad = at::GradMode::is_enabled();
    std::vector<at::Tensor> outputs;
    {
      struct DepthGuard {
        int& d;
        explicit DepthGuard(int& depth) : d(depth) { ++d; }
        ~DepthGuard() { --d; }
      } guard(depth);
      outputs = (grad && s.fsdp_.activationCheckpointing && !u.isRoot) ? runCheckpointed(u, inputs, fn) : fn(inputs);
    }
    // The root stays gathered from its forward into its backward, which starts right
    // after it and needs it first (FSDP2 keeps the root unsharded after forward too):
    // one all-gather less per micro-batch. So does the unit the backward enters first
    // (the previous forward's order says which): resharding it would only gather it again
    // at once, while the loss is computed. A step that changes the masters reshards every
    // unit (publishParameters), so no unit is kept across one.
    const bool backwardNeedsFirst = depth == 1 && position == keepPosition && forwardOrder[position] == &u;
    if (!grad || (s.fsdp_.reshardAfterForward && !u.isRoot && !backwardNeedsFirst)) reshard(u);
    if (grad) {
      std::weak_ptr<int> token = alive;
      FsdpUnit* unit = &u;
      Internal* self = this;
      for (const at::Tensor& out : outputs) {
        if (!out.defined() || !out.requires_grad()) continue;
        out.register_hook([token, unit, self](const at::Tensor&) {
          if (token.lock()) self->preBackward(*unit);
        });
      }
    }
    if (outer) finishForward(grad);
    return outputs;
  }

  void finishForward(bool grad) {
    forwardOrder = currentOrder;
    FsdpUnit* last = forwardOrder.back();
    keepPosition = !last->isRoot && !last->trainable.empty() ? forwardOrder.size() - 1 : SIZE_MAX;
    // This forward's order differed from the recorded one and kept a unit that is not its
    // last: free it now rather than when its gradients arrive.
    if (grad && s.fsdp_.reshardAfterForward) reshardKeptUnits(last);
    backwardOrder.clear();
    std::unordered_set<FsdpUnit*> seen;
    for (auto it = forwardOrder.rbegin(); it != forwardOrder.rend(); ++it) {
      if (!(*it)->isRoot && seen.insert(*it).second) backwardOrder.push_back(*it);
    }
    // Gathers prefetched for units this forward did not run (the order changed), and in
    // no-grad mode everything: no backward will free them.
    for (auto& u : units) {
      if (!grad || u->state == FsdpUnit::State::kGathering) reshard(*u);
    }
  }

  // Reshards every gathered unit but the root and `except` (with reshardAfterForward, the
  // only ones gathered between a forward and its backward).
  void reshardKeptUnits(const FsdpUnit* except) {
    for (auto& u : units) {
      if (!u->isRoot && u.get() != except && u->state == FsdpUnit::State::kUnsharded) reshard(*u);
    }
  }

  std::vector<at::Tensor> runCheckpointed(FsdpUnit& u, const std::vector<at::Tensor>& inputs, const UnitFunction& fn);

  // ---- backward ----------------------------------------------------------------------
  void maybeQueueCallback() {
    // Only the outer backward: a recompute's nested backward ends long before the step's.
    if (callbackQueued || recomputeDepth > 0) return;
    callbackQueued = true;
    queueAtEndOfBackward([this] { finishBackward(); });
  }

  void preBackward(FsdpUnit& u) {
    maybeQueueCallback();
    unshard(u);
    if (u.preBackwardDone) return;
    u.preBackwardDone = true;
    // Prefetch, in reverse forward order, the next units autograd has not entered yet.
    int issued = 0;
    for (FsdpUnit* next : backwardOrder) {
      if (issued >= s.fsdp_.prefetch) break;
      if (next == &u || next->preBackwardDone) continue;
      issueGather(*next);
      ++issued;
    }
  }

  void onGradReady(FsdpUnit& u, size_t j) {
    maybeQueueCallback();
    if (u.ready[j]) return;
    u.ready[j] = true;
    if (++u.readyCount < u.trainable.size()) return;
    // Every node using the unit's trainable parameters has run (their gradients are all
    // in): free them before the reduction allocates its buffers, one unit less at the
    // peak. A frozen parameter has no gradient to say when its last user has run (a norm
    // ahead of the trainable layers runs its backward after theirs): a unit holding one
    // stays gathered until the end of backward.
    if (u.trainable.size() == u.params.size()) reshard(u);
    if (s.sync_) reduce(u);
  }

  // Packs the unit's full gradients (zeros where a trainable parameter has none), frees
  // them, and issues the reduce-scatter (average over the shard group: the one division
  // by N). Frozen parameters take no part.
  void reduce(FsdpUnit& u) {
    const auto options = u.masterChunk.options().dtype(s.options_.reduceDtype);
    pending.makeRoom();
    PendingReduce job;
    job.unit = &u;
    job.flat = at::empty({u.gradLayout->flatNumel()}, options);
    {
      c10::NoGradGuard noGrad;
      for (size_t j = 0; j < u.trainable.size(); ++j) {
        u.gradLayout->packFull(job.flat, j, u.trainableParam(j).grad());
        u.trainableParam(j).mutable_grad().reset();
      }
    }
    job.local = at::empty({u.gradLayout->chunkNumel()}, options);
    job.handle = s.shardComm_->reduceScatterAsync(job.local, job.flat, distributed::ReduceOp::kAvg);

    u.reduced = true;
    pending.push(std::move(job));
  }

  // A reduce-scatter has completed: add its chunk to the unit's gradient shard.
  void finishReduce(PendingReduce& job) {
    job.flat = at::Tensor();
    // hybrid: the shard group's average, averaged again over the replica groups.
    if (s.replicaComm_) s.replicaComm_->allReduce(job.local, distributed::ReduceOp::kAvg);
    c10::NoGradGuard noGrad;
    FsdpUnit& u = *job.unit;
    if (!u.gradShard.defined()) {
      u.gradShard = job.local.scalar_type() == at::kFloat ? job.local : job.local.to(at::kFloat);
    } else {
      u.gradShard.add_(job.local);
    }
  }

  void drainAll() { pending.drain(); }

  // End of every backward: reduce what the hooks left (each unit exactly once per
  // synchronised backward, in unit order on every rank), wait, free everything gathered.
  void finishBackward() {
    callbackQueued = false;
    if (s.sync_) {
      for (auto& u : units) {
        if (!u->reduced && !u->trainable.empty()) reduce(*u);
      }
    }
    drainAll();
    for (auto& u : units) {
      reshard(*u);
      std::fill(u->ready.begin(), u->ready.end(), false);
      u->readyCount = 0;
      u->preBackwardDone = false;
      u->reduced = false;
    }
    refreshHeldGradShards();
  }

  void refreshHeldGradShards() {
    s.heldGradShards_.clear();
    for (auto& u : units) {
      if (u->gradShard.defined()) s.heldGradShards_.push_back(u->gradShard);
    }
  }
};

// ---- activation checkpointing -----------------------------------------------------------

namespace {

struct RecomputeState : torch::CustomClassHolder {
  FullyShardStrategy::Internal* in = nullptr;
  FsdpUnit* unit = nullptr;
  UnitFunction fn;
  at::Tensor rngState;  // CPU generator state the forward saw
};

struct CounterGuard {
  int& c;
  explicit CounterGuard(int& counter) : c(counter) { ++c; }
  ~CounterGuard() { --c; }
};

// Forward without keeping activations (autograd runs Function::forward with grad off);
// backward gathers the unit if needed, recomputes the forward with grad on from the saved
// inputs, and runs a nested backward through it: the parameters' AccumulateGrad hooks fire
// there and reduce the unit as usual.
struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // `params` are inputs only so that the outputs require grad when the unit's parameters
  // do, even when `inputs` do not (the first unit after frozen or data inputs): otherwise
  // autograd would never reach the recompute. Their gradients come from the nested backward
  // (AccumulateGrad hooks); this node returns none for them.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                at::TensorList params, c10::intrusive_ptr<RecomputeState> state) {
    ctx->save_for_backward(inputs.vec());
    CounterGuard inside(state->in->checkpointedForwardDepth);
    std::vector<at::Tensor> outputs = state->fn(inputs.vec());
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list gradOutputs) {
    auto state = c10::static_intrusive_pointer_cast<RecomputeState>(ctx->saved_data["state"].toCapsule());
    const std::vector<at::Tensor> saved = ctx->get_saved_variables();
    state->in->unshard(*state->unit);
    std::vector<at::Tensor> inputs;
    for (const at::Tensor& x : saved) {
      inputs.push_back(x.defined() ? x.detach().requires_grad_(x.requires_grad()) : x);
    }
    std::vector<at::Tensor> outputs;
    {
      at::AutoGradMode gradOn(true);
      CounterGuard inside(state->in->checkpointedForwardDepth);
      auto gen = at::detail::getDefaultCPUGenerator();
      at::Tensor current;
      {
        std::lock_guard<std::mutex> lock(gen.mutex());
        current = gen.get_state();
        gen.set_state(state->rngState);
      }
      outputs = state->fn(inputs);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(current);
    }
    TESSERA_CHECK(outputs.size() == gradOutputs.size(), "FullyShardStrategy: checkpointed unit '", state->unit->name,
                  "' returned ", outputs.size(), " outputs in the recompute, ", gradOutputs.size(), " in forward");
    std::vector<at::Tensor> roots, grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && gradOutputs[i].defined()) {
        roots.push_back(outputs[i]);
        grads.push_back(gradOutputs[i]);
      }
    }
    if (!roots.empty()) {
      CounterGuard nested(state->in->recomputeDepth);
      torch::autograd::backward(roots, grads);
    }
    torch::autograd::variable_list result;
    for (const at::Tensor& x : inputs) result.push_back(x.defined() && x.requires_grad() ? x.grad() : at::Tensor());
    result.resize(result.size() + state->unit->trainable.size() + 1);  // params, state: none
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> FullyShardStrategy::Internal::runCheckpointed(FsdpUnit& u,
                                                                      const std::vector<at::Tensor>& inputs,
                                                                      const UnitFunction& fn) {
  auto state = c10::make_intrusive<RecomputeState>();
  state->in = this;
  state->unit = &u;
  state->fn = fn;
  auto gen = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    state->rngState = gen.get_state();
  }
  std::vector<at::Tensor> params;
  for (size_t j = 0; j < u.trainable.size(); ++j) params.push_back(u.trainableParam(j));
  return CheckpointFunction::apply(at::TensorList(inputs), at::TensorList(params), state);
}

// ---- finding units --------------------------------------------------------------------------

namespace {

// The strategy holding `param`, through its storage's allocator (see "where a unit
// lives", fully_shard.h).
FullyShardStrategy::Internal* strategyOf(const at::Tensor& param) {
  if (!param.defined() || !param.has_storage()) return nullptr;
  const auto* allocator = dynamic_cast<const UnitStorageAllocator*>(param.storage().unsafeGetStorageImpl()->allocator());
  return allocator != nullptr ? allocator->owner() : nullptr;
}

// The strategy whose unit `module` may be: every parameter under a strategy's root is
// held by it, so the first one decides.
FullyShardStrategy::Internal* strategyOf(const torch::nn::Module& module) {
  for (const at::Tensor& p : module.parameters(/*recurse=*/true)) return strategyOf(p);
  return nullptr;
}

// The submodules of `root` that options.wrap names, in named_modules() order: "blocks.*"
// matches the direct children of `blocks`, anything else one module by its exact name (a
// pattern matching none is a ConfigError). Modules with fewer than minParams parameters
// are left out; the count is every parameter below the module, frozen ones and those
// of wrapped submodules included.
std::vector<std::pair<std::string, const torch::nn::Module*>> wrappedModules(const torch::nn::Module& root,
                                                                             const std::vector<std::string>& patterns,
                                                                             int64_t minParams) {
  const auto modules = root.named_modules("", /*include_self=*/false);
  std::vector<bool> chosen(modules.size(), false);
  for (const std::string& pattern : patterns) {
    const bool children = pattern.size() > 2 && pattern.compare(pattern.size() - 2, 2, ".*") == 0;
    const std::string parent = children ? pattern.substr(0, pattern.size() - 2) : pattern;
    int hits = 0;
    for (size_t i = 0; i < modules.size(); ++i) {
      const std::string& name = modules[i].key();
      bool match = name == pattern;
      if (children && name.size() > parent.size() + 1 && name.compare(0, parent.size() + 1, parent + ".") == 0) {
        match = name.find('.', parent.size() + 1) == std::string::npos;
      }
      if (!match) continue;
      chosen[i] = true;
      ++hits;
    }
    TESSERA_CHECK_AS(ConfigError, hits > 0, "sharding.wrap: pattern '", pattern, "' matches no submodule");
  }
  std::vector<std::pair<std::string, const torch::nn::Module*>> out;
  for (size_t i = 0; i < modules.size(); ++i) {
    if (!chosen[i]) continue;
    int64_t params = 0;
    for (const at::Tensor& p : modules[i].value()->parameters(/*recurse=*/true)) params += p.numel();
    if (params >= minParams) out.emplace_back(modules[i].key(), modules[i].value().get());
  }
  return out;
}

}  // namespace

bool heldByFullyShard(const at::Tensor& param) { return strategyOf(param) != nullptr; }

std::vector<at::Tensor> unitForward(torch::nn::Module& module, const std::vector<at::Tensor>& inputs,
                                    const UnitFunction& fn) {
  FullyShardStrategy::Internal* strategy = strategyOf(module);
  if (strategy == nullptr) return fn(inputs);
  auto it = strategy->unitOf.find(&module);
  if (it == strategy->unitOf.end()) return fn(inputs);  // a plain submodule of some unit
  return strategy->runUnit(*it->second, inputs, fn);
}

at::Tensor unitForward(torch::nn::Module& module, const at::Tensor& input,
                       const std::function<at::Tensor(const at::Tensor&)>& fn) {
  std::vector<at::Tensor> out = unitForward(module, std::vector<at::Tensor>{input},
                                            // By value: a checkpointed unit calls it again in backward.
                                            [fn](const std::vector<at::Tensor>& in) {
                                              return std::vector<at::Tensor>{fn(in[0])};
                                            });
  return out[0];
}

// ---- the strategy ----------------------------------------------------------------------------

FullyShardStrategy::FullyShardStrategy(torch::nn::Module& module, std::shared_ptr<distributed::Communicator> comm,
                                       StrategyOptions options, FullyShardOptions fsdp)
    : ShardingStrategy(module, std::move(comm), std::move(options)),
      fsdp_(fsdp),
      in_(std::make_unique<Internal>(*this)) {
  TESSERA_CHECK_AS(ConfigError, kind_ == StrategyKind::kZero3 || kind_ == StrategyKind::kHybrid,
                   "FullyShardStrategy: strategy '", options_.strategy, "' is not zero3 or hybrid");
  TESSERA_CHECK_AS(ConfigError, fsdp_.prefetch >= 0, "FullyShardStrategy: prefetch must be >= 0, got ",
                   fsdp_.prefetch);
  if (kind_ == StrategyKind::kHybrid) {
    const int world = comm_->worldSize();
    const int size = fsdp_.shardSize;
    TESSERA_CHECK_AS(ConfigError, size > 0 && world % size == 0, "FullyShardStrategy: hybrid shard size ", size,
                     " must be > 0 and divide the world size ", world);
    const auto mesh = distributed::DeviceMesh::twoD(comm_, world / size, size);
    shardComm_ = mesh.shardGroup();
    if (mesh.replicateSize() > 1) replicaComm_ = mesh.replicateGroup();
  }
  const int shardWorld = shardComm_->worldSize();
  const int shardRank = shardComm_->rank();

  // Parameters by tensor; one tensor under two names (tied weights) is rejected.
  const auto& collected = moduleParams();
  std::unordered_map<const c10::TensorImpl*, size_t> byImpl;
  for (size_t i = 0; i < collected.size(); ++i) {
    const at::Tensor& p = collected[i].tensor;
#ifdef TESSERA_TORCH_HAS_CUDA
    const bool supported = p.device().is_cpu() || p.device().is_cuda();
#else
    const bool supported = p.device().is_cpu();
#endif
    TESSERA_CHECK_AS(ConfigError, supported, "FullyShardStrategy: parameter '", collected[i].name, "' is on ",
                     p.device(), "; fully_shard frees and regrows CPU storage, and CUDA storage in a build with "
                     "CUDA LibTorch");
    TESSERA_CHECK_AS(ConfigError, p.device() == collected[0].tensor.device(), "FullyShardStrategy: parameter '",
                     collected[i].name, "' is on ", p.device(), ", '", collected[0].name, "' on ",
                     collected[0].tensor.device(), ": all parameters must be on one device");
    TESSERA_CHECK_AS(ConfigError, p.device().is_cpu() || !fsdp_.activationCheckpointing,
                     "FullyShardStrategy: activation checkpointing replays the CPU generator only; parameter '",
                     collected[i].name, "' is on ", p.device());
    const bool fresh = byImpl.emplace(p.unsafeGetTensorImpl(), i).second;
    TESSERA_CHECK_AS(ConfigError, fresh, "FullyShardStrategy: parameter '", collected[i].name,
                     "' is the same tensor as another parameter (tied weights are not supported)");
  }

  // Units: the wrapped submodules in named_modules() order, then the root. Deeper units
  // claim their parameters first (an outer unit gets what its inner units do not own).
  const auto unitModules = wrappedModules(module_, options_.wrap, fsdp_.minUnitParams);
  const size_t rootIndex = unitModules.size();
  std::vector<size_t> owner(collected.size(), rootIndex);
  std::vector<bool> claimed(collected.size(), false);
  for (size_t ui = unitModules.size(); ui-- > 0;) {
    for (const at::Tensor& p : unitModules[ui].second->parameters(/*recurse=*/true)) {
      auto it = byImpl.find(p.unsafeGetTensorImpl());
      if (it == byImpl.end() || claimed[it->second]) continue;  // an inner unit's
      claimed[it->second] = true;
      owner[it->second] = ui;
    }
  }
  for (size_t ui = 0; ui <= rootIndex; ++ui) {
    auto u = std::make_unique<FsdpUnit>();
    u->isRoot = ui == rootIndex;
    u->name = u->isRoot ? "" : unitModules[ui].first;
    u->module = u->isRoot ? &module_ : unitModules[ui].second;
    in_->units.push_back(std::move(u));
  }

  // Shards: each unit's fp32 masters are slots of one chunk, which is exactly this rank's
  // chunk of the unit's flat gather buffer; they are filled from the parameter's values,
  // or, for a deferred parameter, with the initial values of this rank's rows only (no
  // rank ever holds a whole deferred parameter). The module's parameters get fresh, empty
  // storage of their own in paramDtype (so freeing it frees nothing else), allocated by the
  // strategy's allocator only while their unit is gathered. The records are registered in
  // named_parameters() order, whatever unit owns them.
  std::vector<std::vector<size_t>> members(in_->units.size());  // collected indices per unit
  for (size_t i = 0; i < collected.size(); ++i) members[owner[i]].push_back(i);
  std::vector<std::pair<at::Tensor, ShardSpec>> shards(collected.size());  // master slot and spec per parameter
  c10::NoGradGuard noGrad;
  const at::Device device = collected.empty() ? at::Device(at::kCPU) : collected[0].tensor.device();
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
  for (size_t ui = 0; ui < in_->units.size(); ++ui) {
    FsdpUnit& u = *in_->units[ui];
    std::vector<ShardSpec> specs, gradSpecs;
    for (size_t k = 0; k < members[ui].size(); ++k) {
      const at::Tensor& p = collected[members[ui][k]].tensor;
      specs.emplace_back(p.sizes().vec(), at::kFloat, shardWorld, shardRank);
      if (!p.requires_grad()) continue;
      u.trainable.push_back(k);
      gradSpecs.push_back(specs.back());
    }
    u.layout = std::make_unique<FlatLayout>(std::move(specs));
    u.gradLayout = std::make_unique<FlatLayout>(std::move(gradSpecs));
    u.masterChunk = at::zeros({u.layout->chunkNumel()}, fp32);
    for (size_t k = 0; k < members[ui].size(); ++k) {
      const NamedTensor& np = collected[members[ui][k]];
      const at::Tensor& p = np.tensor;
      const ShardSpec& spec = u.layout->spec(k);
      at::Tensor slot = u.layout->slot(u.masterChunk, k);
      if (hasNoStorage(p)) {
        const auto [begin, end] = spec.localRowRange();
        initialRows(np.name, begin, slot.view({spec.chunkRows(), spec.rowNumel()}).narrow(0, 0, end - begin));
      } else {
        slot.copy_(spec.shardOf(p.detach().to(at::kFloat)));
      }
      shards[members[ui][k]] = {slot, spec};
      p.set_data(deferredTensor(p.sizes().vec(), fp32.dtype(options_.paramDtype)));
      u.paramBytes += static_cast<int64_t>(fullBytes(p));
    }
    u.gatherBytes = u.layout->flatNumel() * static_cast<int64_t>(c10::elementSize(options_.paramDtype));
    u.ready.assign(u.trainable.size(), false);
  }
  std::vector<ShardedParam*> records(collected.size());
  for (size_t i = 0; i < collected.size(); ++i) {
    records[i] = &registerParam(collected[i].name, collected[i].tensor, shards[i].second, shards[i].first);
  }
  for (size_t ui = 0; ui < in_->units.size(); ++ui) {
    for (size_t i : members[ui]) in_->units[ui]->params.push_back(records[i]);
  }
  // A trainable parameter's gradient being in drives its unit's reduction.
  for (auto& up : in_->units) {
    FsdpUnit& u = *up;
    for (size_t j = 0; j < u.trainable.size(); ++j) {
      Internal* in = in_.get();
      in_->gradHooks->add(u.trainableParam(j), [in, &u, j] { in->onGradReady(u, j); });
    }
    in_->unitOf[u.module] = &u;
  }
  int64_t largestReduce = 0;
  for (const auto& u : in_->units) {
    largestReduce = std::max<int64_t>(largestReduce, u->gradLayout->flatNumel() * c10::elementSize(options_.reduceDtype));
  }
  if (largestReduce > kLargeReduceBytes) in_->pending.setMaxInflight(1);
  // Last, once nothing can throw: the storages outlive a strategy whose constructor
  // failed, and must not keep an allocator that died with it.
  for (const ShardedParam& p : params()) {
    c10::StorageImpl* storage = p.moduleParam.storage().unsafeGetStorageImpl();
    if (!in_->storageAllocator) in_->storageAllocator = std::make_unique<UnitStorageAllocator>(in_.get(), storage->allocator());
    storage->set_allocator(in_->storageAllocator.get());
  }
  peak_ = unshardedParamBytes();
}

FullyShardStrategy::~FullyShardStrategy() {
  in_->gradHooks.reset();  // removes the hooks
  for (auto& u : in_->units) {
    // The storages outlive the strategy (the module keeps them): back to their own allocator.
    for (const ShardedParam* p : u->params) {
      p->moduleParam.storage().unsafeGetStorageImpl()->set_allocator(in_->storageAllocator->inner());
    }
    // A gather still in flight is waited (its buffers must outlive it); errors are moot now.
    if (u->gather) {
      try {
        u->gather->wait();
      } catch (...) {
      }
    }
  }
  // Reduce-scatters still in flight: waited by ~InflightCollectives.
}

size_t FullyShardStrategy::unitCount() const { return in_->units.size(); }
const std::string& FullyShardStrategy::unitName(size_t i) const { return in_->units.at(i)->name; }
std::vector<std::string> FullyShardStrategy::unitParamNames(size_t i) const {
  std::vector<std::string> names;
  for (const ShardedParam* p : in_->units.at(i)->params) names.push_back(p->name);
  return names;
}
int64_t FullyShardStrategy::unitGatherBytes(size_t i) const { return in_->units.at(i)->gatherBytes; }
int64_t FullyShardStrategy::unitParamBytes(size_t i) const { return in_->units.at(i)->paramBytes; }

int64_t FullyShardStrategy::unshardedParamBytes() const {
  int64_t bytes = 0;
  for (const auto& u : in_->units) {
    for (const ShardedParam* p : u->params) bytes += static_cast<int64_t>(p->moduleParam.storage().nbytes());
    if (u->flat.defined()) bytes += static_cast<int64_t>(u->flat.storage().nbytes());
  }
  return bytes;
}

void FullyShardStrategy::gatherFullParameters() {
  for (auto& u : in_->units) in_->issueGather(*u);
  for (auto& u : in_->units) in_->unshard(*u);
}

void FullyShardStrategy::publishParameters() {
  for (auto& u : in_->units) in_->reshard(*u);
}

void FullyShardStrategy::zeroGrad() {
  in_->drainAll();
  ShardingStrategy::zeroGrad();
  for (auto& u : in_->units) u->gradShard = at::Tensor();
}

void FullyShardStrategy::withSwappedParameters(const std::function<at::Tensor(const ShardedParam&)>& ownedValue,
                                               const std::function<void()>& fn) {
  std::vector<at::Tensor> masters;
  for (const ShardedParam& p : params()) masters.push_back(p.master);
  withValuesSwapped(
      masters, [&](size_t i) { return ownedValue(params()[i]); }, [this] { publishParameters(); }, fn);
}

void FullyShardStrategy::synchronizeGradients() {
  in_->drainAll();
  // Full gradients not reduced yet (the last backward ran without sync): reduce them now,
  // once, in unit order on every rank.
  for (auto& u : in_->units) {
    bool local = false;
    for (size_t j = 0; j < u->trainable.size(); ++j) local = local || u->trainableParam(j).grad().defined();
    if (local) in_->reduce(*u);
  }
  in_->drainAll();
  for (auto& u : in_->units) u->reduced = false;
  in_->refreshHeldGradShards();
  for (auto& u : in_->units) {
    if (!u->gradShard.defined()) continue;
    for (size_t j = 0; j < u->trainable.size(); ++j) {
      u->params[u->trainable[j]]->grad = u->gradLayout->slot(u->gradShard, j);
    }
  }
}

}  // namespace tessera::sharding
