// FullyShardStrategy's construction (groups, checks, units, masters, records) and its
// ShardingStrategy operations over the units (see fully_shard.h).
#include "sharding/fully_shard.h"

#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <unordered_set>

#include "common/errors.h"
#include "distributed/communicator.h"
#include "distributed/device_mesh.h"
#include "sharding/fsdp_state.h"
#include "sharding/fsdp_unit.h"
#include "sharding/host_offload.h"
#include "dtensor/param_init.h"
#include "sharding/unit_discovery.h"

namespace tessera::sharding {

FullyShardStrategy::FullyShardStrategy(torch::nn::Module& module, std::shared_ptr<distributed::Communicator> comm,
                                       StrategyOptions options, FullyShardOptions fsdp)
    : ShardingStrategy(module, std::move(comm), std::move(options)), fsdp_(fsdp) {
  TESSERA_CHECK_AS(ConfigError, kind_ == StrategyKind::kZero3 || kind_ == StrategyKind::kHybrid,
                   "FullyShardStrategy: strategy '", strategyKindName(kind_), "' is not zero3 or hybrid");
  TESSERA_CHECK_AS(ConfigError, fsdp_.prefetch >= 0, "FullyShardStrategy: prefetch must be >= 0, got ",
                   fsdp_.prefetch);
  if (kind_ == StrategyKind::kHybrid) setUpHybridGroups();
  checkParameters();
  if (fsdp_.cpuOffload) {
    offload_ = std::make_unique<HostOffload>(moduleParams().empty() ? at::Device(at::kCPU)
                                                                     : moduleParams()[0].tensor.device());
  }
  UnitContext context;
  context.shardComm = shardComm_.get();
  context.replicaComm = replicaComm_.get();
  context.paramDtype = options_.paramDtype;
  context.reduceDtype = options_.reduceDtype;
  context.offload = offload_.get();
  state_ = std::make_unique<FullyShardState>(fsdp_, std::move(context));

  // Masters first (they read the parameters' values), then the records in
  // named_parameters() order, then the parameters' storage becomes the units'.
  const std::vector<std::vector<size_t>> members = buildUnits();
  std::vector<std::pair<at::Tensor, dtensor::ShardSpec>> shards(moduleParams().size());
  for (size_t ui = 0; ui < members.size(); ++ui) shardUnit(*state_->units()[ui], members[ui], shards);
  std::vector<dtensor::ShardedParam*> records;
  for (size_t i = 0; i < shards.size(); ++i) {
    records.push_back(&registerParam(moduleParams()[i].name, moduleParams()[i].tensor, shards[i].second, shards[i].first));
  }
  for (size_t ui = 0; ui < members.size(); ++ui) {
    std::vector<dtensor::ShardedParam*> mine;
    for (size_t i : members[ui]) mine.push_back(records[i]);
    state_->units()[ui]->adoptRecords(std::move(mine));
  }
  state_->onBackwardEnd = [this] { heldGradShards_ = state_->gradShards(); };
  state_->finishUnits();
  // Last, once nothing can throw: the storages outlive a strategy whose constructor
  // failed, and must not keep an allocator that died with it.
  state_->claimStorages();
}

FullyShardStrategy::~FullyShardStrategy() = default;

void FullyShardStrategy::setUpHybridGroups() {
  const int world = comm_->worldSize();
  const int size = fsdp_.shardSize == 0 ? world : fsdp_.shardSize;  // 0: one shard group of every rank
  TESSERA_CHECK_AS(ConfigError, size > 0 && world % size == 0, "FullyShardStrategy: hybrid shard size ",
                   fsdp_.shardSize, " must be >= 0 and divide the world size ", world);
  const auto mesh = distributed::DeviceMesh::twoD(comm_, world / size, size);
  shardComm_ = mesh.shardGroup();
  if (mesh.replicateSize() > 1) replicaComm_ = mesh.replicateGroup();
}

// Every parameter on the CPU or one CUDA device, and no tensor under two names.
void FullyShardStrategy::checkParameters() const {
  const auto& collected = moduleParams();
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const NamedTensor& np : collected) {
    const at::Tensor& p = np.tensor;
#ifdef TESSERA_TORCH_HAS_CUDA
    const bool supported = p.device().is_cpu() || p.device().is_cuda();
#else
    const bool supported = p.device().is_cpu();
#endif
    TESSERA_CHECK_AS(ConfigError, supported, "FullyShardStrategy: parameter '", np.name, "' is on ", p.device(),
                     "; fully_shard frees and regrows CPU storage, and CUDA storage in a build with CUDA LibTorch");
    TESSERA_CHECK_AS(ConfigError, p.device() == collected[0].tensor.device(), "FullyShardStrategy: parameter '",
                     np.name, "' is on ", p.device(), ", '", collected[0].name, "' on ", collected[0].tensor.device(),
                     ": all parameters must be on one device");
    TESSERA_CHECK_AS(ConfigError, p.device().is_cpu() || !fsdp_.activationCheckpointing,
                     "FullyShardStrategy: activation checkpointing replays the CPU generator only; parameter '",
                     np.name, "' is on ", p.device());
    TESSERA_CHECK_AS(ConfigError, seen.insert(p.unsafeGetTensorImpl()).second, "FullyShardStrategy: parameter '",
                     np.name, "' is the same tensor as another parameter (tied weights are not supported)");
  }
}

std::vector<std::vector<size_t>> FullyShardStrategy::buildUnits() {
  const std::vector<FoundUnit> found = findUnits(module_, options_.wrap, fsdp_.minUnitParams);
  std::vector<at::Tensor> tensors;
  for (const NamedTensor& np : moduleParams()) tensors.push_back(np.tensor);
  const std::vector<size_t> owner = assignOwners(found, tensors);
  for (const FoundUnit& f : found) state_->addUnit(f.name, f.module, /*isRoot=*/false);
  state_->addUnit("", &module_, /*isRoot=*/true);
  std::vector<std::vector<size_t>> members(found.size() + 1);
  for (size_t i = 0; i < owner.size(); ++i) members[owner[i]].push_back(i);
  return members;
}

// Each unit's fp32 masters are the slots of one chunk, which is exactly this rank's chunk
// of the unit's flat gather buffer. A deferred parameter's slot gets the initial values of
// this rank's rows only: no rank ever holds a whole deferred parameter.
void FullyShardStrategy::shardUnit(FsdpUnit& u, const std::vector<size_t>& members,
                                   std::vector<std::pair<at::Tensor, dtensor::ShardSpec>>& shards) const {
  const auto& collected = moduleParams();
  std::vector<dtensor::ShardSpec> specs;
  std::vector<bool> trainable;
  for (size_t i : members) {
    specs.emplace_back(collected[i].tensor.sizes().vec(), at::kFloat, shardComm_->worldSize(), shardComm_->rank());
    trainable.push_back(collected[i].tensor.requires_grad());
  }
  const at::Device device = collected.empty() ? at::Device(at::kCPU) : collected[0].tensor.device();
  u.setLayout(specs, trainable, device);
  c10::NoGradGuard noGrad;
  for (size_t k = 0; k < members.size(); ++k) {
    const NamedTensor& np = collected[members[k]];
    const dtensor::ShardSpec& spec = specs[k];
    at::Tensor slot = u.masterSlot(k);
    if (dtensor::hasNoStorage(np.tensor)) {
      const auto [begin, end] = spec.localRowRange();
      initialRows(np.name, begin, slot.view({spec.chunkRows(), spec.rowNumel()}).narrow(0, 0, end - begin));
    } else {
      slot.copy_(spec.shardOf(np.tensor.detach().to(at::kFloat)));
    }
    shards[members[k]] = {slot, spec};
  }
}

// ---- ShardingStrategy over the units --------------------------------------------------

size_t FullyShardStrategy::unitCount() const { return state_->units().size(); }
const std::string& FullyShardStrategy::unitName(size_t i) const { return state_->units().at(i)->name(); }
std::vector<std::string> FullyShardStrategy::unitParamNames(size_t i) const {
  std::vector<std::string> names;
  for (const dtensor::ShardedParam* p : state_->units().at(i)->params()) names.push_back(p->name);
  return names;
}
int64_t FullyShardStrategy::unitGatherBytes(size_t i) const { return state_->units().at(i)->gatherBytes(); }
int64_t FullyShardStrategy::unitParamBytes(size_t i) const { return state_->units().at(i)->paramBytes(); }
int64_t FullyShardStrategy::unshardedParamBytes() const { return state_->unshardedBytes(); }
int64_t FullyShardStrategy::peakUnshardedParamBytes() const { return state_->peakBytes(); }
void FullyShardStrategy::resetPeak() { state_->resetPeak(); }
void FullyShardStrategy::setRequiresGradientSync(bool sync) { state_->setGradientSync(sync); }
void FullyShardStrategy::setReshardAfterBackward(bool reshard) { state_->setReshardRootAfterBackward(reshard); }

void FullyShardStrategy::gatherFullParameters() {
  for (const auto& u : state_->units()) u->unshard();
  for (const auto& u : state_->units()) u->waitForUnshard();
}

void FullyShardStrategy::publishParameters() {
  for (const auto& u : state_->units()) u->reshard();
  if (offload_) offload_->finishCopies();  // the host may write the masters from here
}

void FullyShardStrategy::zeroGrad() {
  state_->drainReductions();
  if (offload_) offload_->finishCopies();
  ShardingStrategy::zeroGrad();
  for (const auto& u : state_->units()) u->clearGradients();
}

void FullyShardStrategy::withSwappedParameters(const std::function<at::Tensor(const dtensor::ShardedParam&)>& ownedValue,
                                               const std::function<void()>& fn) {
  std::vector<at::Tensor> masters;
  for (const dtensor::ShardedParam& p : params()) masters.push_back(p.master);
  if (offload_) offload_->finishCopies();  // the swap writes the masters
  // fn's gathers may still be uploading the swapped values when it returns or throws: the
  // restore waits for them.
  const auto fenced = [&] {
    struct Fence {
      HostOffload* offload;
      ~Fence() {
        if (offload == nullptr) return;
        try {
          offload->finishCopies();
        } catch (...) {  // already unwinding or failing: the device error surfaces elsewhere
        }
      }
    } fence{offload_.get()};
    fn();
  };
  withValuesSwapped(
      masters, [&](size_t i) { return ownedValue(params()[i]); }, [this] { publishParameters(); }, fenced);
}

std::vector<ShardingStrategy::GradGroup> FullyShardStrategy::gradGroups() const {
  std::vector<GradGroup> groups;
  for (const auto& u : state_->units()) {
    if (u->trainableCount() == 0) continue;
    GradGroup g;
    g.layout = &u->gradLayout();
    for (size_t j = 0; j < u->trainableCount(); ++j) g.params.push_back(u->trainableParam(j));
    g.options = u->reduceOptions();
    groups.push_back(std::move(g));
  }
  return groups;
}

void FullyShardStrategy::keepGradientsInParameters() { state_->keepGradientsApart(); }

void FullyShardStrategy::synchronizeGradients() {
  if (deterministic()) {
    // Each unit's canonical sum (canonical_reduce.h) in unit order, taken as its reduction.
    state_->drainReductions();
    const std::vector<GradGroup> groups = gradGroups();
    size_t g = 0;
    for (const auto& u : state_->units()) {
      if (u->trainableCount() == 0) continue;
      u->takeReducedChunk(canonicalGroupSum(g, groups[g], replicaComm_.get()));
      ++g;
    }
  }
  state_->reduceRemaining();
  if (offload_) {
    // From here the host reads the gradient shards and the optimizer writes the masters.
    offload_->finishCopies();
    for (const auto& u : state_->units()) u->addPendingGradients();
  }
  heldGradShards_ = state_->gradShards();
  for (const auto& u : state_->units()) u->exposeGradients();
}

std::unique_ptr<FullyShardStrategy> fullyShard(torch::nn::Module& root, std::shared_ptr<distributed::Communicator> comm,
                                               StrategyOptions options) {
  // The root's parameters are gathered when its forward is entered: a root whose forward
  // is a plain call would compute from freed storage.
  TESSERA_CHECK_AS(UsageError, isUnitModule(root), "fullyShard: the root module is not a sharding::Unit; declare it "
                   "sharding::Unit<YourModel> (its forward then gathers the root's parameters), or build the "
                   "strategy with makeStrategy and enter the root through sharding::unitForward");
  if (options.strategy == StrategyOptions{}.strategy) options.strategy = StrategyKind::kZero3;  // unless hybrid is asked for
  return std::make_unique<FullyShardStrategy>(root, std::move(comm), options);
}

}  // namespace tessera::sharding
