// The shared half of every sharding strategy: parameter registry, initial broadcast,
// the step template (clip, non-finite skip, optimizer), buffer sync, byte accounting,
// and the factory (see strategy.h).
#include "sharding/strategy.h"

#include <c10/core/GradMode.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <sstream>
#include <unordered_set>

#include "common/errors.h"
#include "common/trace.h"
#include "common/logging.h"
#include "distributed/communicator.h"
#include "sharding/data_parallel.h"
#include "sharding/fully_shard.h"
#include "optim/grad_clip.h"
#include "sharding/mixed_precision.h"
#include "sharding/tensor_sync.h"

namespace tessera::sharding {

StrategyKind parseStrategyKind(const std::string& name) {
  return parseEnum(kStrategyKindNames, name, "sharding strategy");
}

const char* strategyKindName(StrategyKind kind) { return enumName(kStrategyKindNames, kind); }

std::string ResidentBytes::str() const {
  std::ostringstream s;
  s << "params " << params << " B, grads " << grads << " B, optimizer " << optimizer << " B, buffers " << buffers
    << " B, total " << total() << " B";
  return s.str();
}

ShardingStrategy::ShardingStrategy(torch::nn::Module& module, std::shared_ptr<distributed::Communicator> comm,
                                   StrategyOptions options)
    : module_(module),
      comm_(std::move(comm)),
      shardComm_(comm_),
      options_(std::move(options)),
      kind_(options_.strategy),
      bufferSync_(options_.bufferSync),
      optimizer_(options_.optimizer) {
  TESSERA_CHECK_AS(UsageError, comm_ != nullptr, "ShardingStrategy: no communicator");
  checkFloatDtype(options_.paramDtype, "sharding param dtype");
  checkFloatDtype(options_.reduceDtype, "sharding reduce dtype");
  TESSERA_CHECK_AS(ConfigError, options_.bucketBytes > 0, "ShardingStrategy: bucket size must be > 0 bytes, got ",
                   options_.bucketBytes);
  TESSERA_CHECK_AS(ConfigError, options_.gradClip >= 0, "ShardingStrategy: grad clip must be >= 0 (0 = off), got ",
                   options_.gradClip);

  std::vector<at::Tensor> valued;  // what rank 0 broadcasts: parameters with values, buffers
  for (const auto& item : module_.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    TESSERA_CHECK(p.defined() && p.is_floating_point(), "ShardingStrategy: parameter '", item.key(),
                  "' must be a defined floating-point tensor");
    TESSERA_CHECK(!heldByFullyShard(p), "ShardingStrategy: parameter '", item.key(),
                  "' is already sharded by another live zero3/hybrid strategy");
    if (dtensor::hasNoStorage(p)) {
      TESSERA_CHECK_AS(ConfigError, options_.initializer != nullptr, "ShardingStrategy: parameter '", item.key(),
                       "' is deferred (no storage yet) and StrategyOptions::initializer is not set");
    } else {
      valued.push_back(p);
    }
    collected_.push_back({item.key(), p});
  }
  for (const auto& item : module_.named_buffers(/*recurse=*/true)) {
    if (!item.value().defined()) continue;
    TESSERA_CHECK(!dtensor::hasNoStorage(item.value()), "ShardingStrategy: buffer '", item.key(), "' has no storage");
    buffers_.push_back({item.key(), item.value()});
    valued.push_back(item.value());
  }
  // Identical start on every rank, whatever each rank's init did; deferred parameters
  // are initialised alike everywhere by construction.
  broadcastCoalesced(valued, *comm_, /*root=*/0, options_.bucketBytes);
  for (const auto& np : collected_) np.tensor.mutable_grad().reset();
  // The records never move: the optimizer, units and callers keep pointers to them.
  params_.reserve(collected_.size());
}

ShardingStrategy::~ShardingStrategy() = default;

dtensor::ShardedParam& ShardingStrategy::registerParam(const std::string& name, const at::Tensor& moduleParam, dtensor::ShardSpec spec,
                                              at::Tensor master) {
  TESSERA_CHECK(!byName_.count(name), "ShardingStrategy::registerParam: parameter '", name, "' registered twice");
  TESSERA_CHECK(params_.size() < params_.capacity(), "ShardingStrategy::registerParam: '", name,
                "' is not one of the parameters collected at construction");
  TESSERA_CHECK(master.defined() && master.scalar_type() == at::kFloat && master.sizes().vec() == spec.localShape(),
                "ShardingStrategy::registerParam: master of '", name, "' must be fp32 with the local shape of ",
                spec.str());
  dtensor::ShardedParam& p = params_.emplace_back();
  p.name = name;
  p.spec = std::move(spec);
  p.master = std::move(master);
  p.moduleParam = moduleParam;
  p.trainable = moduleParam.requires_grad();
  byName_[name] = &p;
  if (p.trainable) {
    const optim::OptimizerOptions& o = options_.optimizer;
    optimizer_.setGroup(shardComm_);  // the group p.spec is laid out over (Muon gathers there)
    optimizer_.addParam(p, optim::decays(o, name, p.spec.globalShape()), optim::lrScaleOf(o, name));
  }
  return p;
}

void ShardingStrategy::initialRows(const std::string& name, int64_t rowBegin, const at::Tensor& rows) const {
  if (rows.numel() == 0) return;
  options_.initializer(name, rowBegin, rows);
}

at::Tensor ShardingStrategy::fullInitialValue(const NamedTensor& param) const {
  const at::Tensor& p = param.tensor;
  if (!dtensor::hasNoStorage(p)) return p.detach();
  return dtensor::fullInitialValue(options_.initializer, param.name, p.sizes(), p.device());
}

const dtensor::ShardedParam& ShardingStrategy::param(const std::string& name) const {
  auto it = byName_.find(name);
  TESSERA_CHECK(it != byName_.end(), "ShardingStrategy: no parameter named '", name, "'");
  return *it->second;
}

std::vector<dtensor::StateEntry> ShardingStrategy::stateEntries(const std::string& prefix) {
  std::vector<dtensor::StateEntry> entries;
  for (const dtensor::ShardedParam& p : params_) entries.push_back({prefix + p.name, p.spec, p.master});
  for (const NamedTensor& b : buffers_) entries.push_back({prefix + b.name, bufferSpec(b.tensor), b.tensor});
  return entries;
}

dtensor::ShardSpec ShardingStrategy::bufferSpec(const at::Tensor& buffer) const {
  return dtensor::ShardSpec(buffer.sizes().vec(), buffer.scalar_type(), shardComm_->worldSize(), shardComm_->rank(),
                   dtensor::Placement::kReplicate);
}

void ShardingStrategy::zeroGrad() {
  if (canonical_) canonical_->clear();
  for (dtensor::ShardedParam& p : params_) {
    p.moduleParam.mutable_grad().reset();
    p.grad.reset();
  }
  heldGradShards_.clear();
}

void ShardingStrategy::setDeterministic(const MicroBatchPlan& plan) {
  TESSERA_CHECK_AS(ConfigError, plan.world == comm_->worldSize() && plan.count >= plan.world,
                   "ShardingStrategy: deterministic mode needs at least one micro-batch per rank: ", plan.count,
                   " micro-batches over ", comm_->worldSize(), " ranks");
  canonical_ = std::make_unique<CanonicalGradients>(plan);
  setRequiresGradientSync(false);
  keepGradientsInParameters();
}

void ShardingStrategy::addMicroBatchGradients(int64_t index) {
  TESSERA_CHECK_AS(UsageError, canonical_ != nullptr, "ShardingStrategy::addMicroBatchGradients: not in deterministic mode");
  c10::NoGradGuard noGrad;
  const std::vector<GradGroup> groups = gradGroups();
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : groups[g].params) grads.push_back(p.grad());
    if (index >= 0) {
      at::Tensor flat = at::empty({groups[g].layout->flatNumel()}, groups[g].options);
      groups[g].layout->packAll(flat, grads);  // zeros where a parameter got no gradient
      canonical_->add(g, index, std::move(flat));
    }
    for (const at::Tensor& p : groups[g].params) p.mutable_grad().reset();
  }
}

at::Tensor ShardingStrategy::canonicalGroupSum(size_t group, const GradGroup& g, distributed::Communicator* replicas) {
  const dtensor::FlatLayout& layout = *g.layout;
  const int world = comm_->worldSize();
  const SliceLayout slices = SliceLayout::ofChunks(layout.chunks(), layout.chunkNumel(), world);
  at::Tensor slice = canonical_->reduce(group, *comm_, slices, layout.flatNumel(), g.options);
  if (layout.chunks() == world) return slice;  // this rank's chunk
  // The slices of one chunk are on the ranks holding it: the chunk's replicas (hybrid's
  // replica group), or every rank (replicated: one chunk).
  TESSERA_CHECK(layout.chunks() == 1 || replicas != nullptr, "ShardingStrategy: a layout of ", layout.chunks(),
                " chunks over ", world, " ranks and no replica group");
  distributed::Communicator& holders = layout.chunks() == 1 ? *comm_ : *replicas;
  at::Tensor gathered = at::empty({holders.worldSize() * slices.sliceNumel}, g.options);
  holders.allGatherInto(gathered, slice);
  return gathered.narrow(0, 0, layout.chunkNumel());
}

void ShardingStrategy::setRequiresGradientSync(bool /*sync*/) {}
void ShardingStrategy::setReshardAfterBackward(bool /*reshard*/) {}

void ShardingStrategy::withSwappedParameters(const std::function<at::Tensor(const dtensor::ShardedParam&)>& ownedValue,
                                             const std::function<void()>& fn) {
  // The module holds full parameters: one full tensor is gathered at a time into it.
  std::vector<at::Tensor> targets;
  for (const dtensor::ShardedParam& p : params_) targets.push_back(p.moduleParam.variable_data());
  withValuesSwapped(
      targets,
      [&](size_t i) {
        const at::Tensor owned = ownedValue(params_[i]);
        return owned.defined() ? params_[i].ownedSpec().fullTensor(owned, *shardComm_) : at::Tensor();
      },
      [] {}, fn);
}

void withValuesSwapped(const std::vector<at::Tensor>& targets, const std::function<at::Tensor(size_t)>& value,
                       const std::function<void()>& refresh, const std::function<void()>& fn) {
  std::vector<at::Tensor> live(targets.size());  // undefined where value(i) was undefined
  {
    c10::NoGradGuard noGrad;  // only around the copies: fn runs in the caller's grad mode
    for (size_t i = 0; i < targets.size(); ++i) {
      const at::Tensor v = value(i);
      if (!v.defined()) continue;
      live[i] = targets[i].clone();
      targets[i].copy_(v.view(targets[i].sizes()));
    }
  }
  refresh();
  auto restore = [&] {
    {
      c10::NoGradGuard noGrad;
      for (size_t i = 0; i < targets.size(); ++i) {
        if (live[i].defined()) targets[i].copy_(live[i]);
      }
    }
    refresh();
  };
  try {
    fn();
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

void StepSums::add(const std::string& name, double value) {
  TESSERA_CHECK_AS(UsageError, !summed_, "StepSums::add: '", name, "' added after the step summed these values; "
                   "use a new StepSums for each step");
  for (size_t i = 0; i < names_.size(); ++i) {
    if (names_[i] == name) {
      values_[i] += value;
      return;
    }
  }
  names_.push_back(name);
  values_.push_back(value);
}

void StepSums::takeSums(const at::Tensor& sums) {
  if (sums.defined()) std::copy_n(sums.data_ptr<double>(), values_.size(), values_.begin());
  summed_ = true;
}

double StepSums::operator[](const std::string& name) const {
  for (size_t i = 0; i < names_.size(); ++i) {
    if (names_[i] == name) return values_[i];
  }
  throw UsageError(strCat("StepSums: no value named '", name, "'"));
}

StepResult ShardingStrategy::step(double lr, StepSums* sums) {
  return stepWith([&] { optimizer_.step(lr); }, sums);
}

// Every tensor `optimizer` steps must be one of the shards (an optimizer built over
// model->parameters(), as in FSDP2, would find no gradients under zero3 and step nothing);
// a shard in none of its groups is trained by nobody.
void ShardingStrategy::checkOptimizerTensors(torch::optim::Optimizer& optimizer) {
  std::unordered_map<const c10::TensorImpl*, size_t> shardIndex;
  const std::vector<NamedTensor>& shards = shardedParameters();
  for (size_t i = 0; i < shards.size(); ++i) shardIndex.emplace(shards[i].tensor.unsafeGetTensorImpl(), i);
  std::vector<bool> stepped(shards.size(), false);
  for (const auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      auto it = shardIndex.find(p.unsafeGetTensorImpl());
      TESSERA_CHECK_AS(UsageError, it != shardIndex.end(), "ShardingStrategy::step: the optimizer holds a tensor of "
                       "shape ", p.sizes(), " that is not one of this strategy's shardedParameters(); build its "
                       "parameter groups from strategy.shardedParameters(), not model->parameters()");
      stepped[it->second] = true;
    }
  }
  for (size_t i = 0; i < shards.size(); ++i) {
    if (!stepped[i]) TLOG_WARN0("ShardingStrategy::step: no optimizer group holds '" << shards[i].name << "'; it is not trained");
  }
  checkedOptimizer_ = &optimizer;
}

StepResult ShardingStrategy::step(torch::optim::Optimizer& optimizer, StepSums* sums) {
  if (checkedOptimizer_ != &optimizer) checkOptimizerTensors(optimizer);
  const std::vector<NamedTensor>& shards = shardedParameters();
  return stepWith(
      [&] {
        for (size_t i = 0; i < shards.size(); ++i) {
          const dtensor::ShardedParam& p = *shardRecords_[i];
          at::Tensor& grad = shards[i].tensor.mutable_grad();
          grad = p.grad.defined() ? p.grad.reshape(p.master.sizes()).to(at::kFloat) : at::Tensor();
        }
        optimizer.step();
        for (const NamedTensor& shard : shards) shard.tensor.mutable_grad().reset();
      },
      sums);
}

const std::vector<ShardingStrategy::NamedTensor>& ShardingStrategy::shardedParameters() {
  if (shards_.empty()) {
    for (dtensor::ShardedParam& p : params_) {
      if (!p.trainable) continue;
      // A tensor object of its own (its .grad() is the optimizer's), sharing the master's storage.
      shards_.push_back({p.name, p.master.detach()});
      shardRecords_.push_back(&p);
    }
  }
  return shards_;
}

StepResult ShardingStrategy::stepWith(const std::function<void()>& update, StepSums* sums) {
  const at::Tensor sumAlongside =
      sums != nullptr && !sums->values_.empty() ? at::tensor(sums->values_, at::kDouble) : at::Tensor();
  const bool alongside = sumAlongside.defined();
  {
    const trace::Span span("optimizer", "gradient sync");
    synchronizeGradients();
  }
  StepResult result;
  // The norm's all-reduce spans the world unless hybrid's is over its shard group only.
  const bool normOverWorld = shardComm_.get() == comm_.get();
  const trace::Span normSpan("optimizer", "gradient norm and clipping");
  const trace::Tag normTag("gradient norm");
  const optim::GradNorm norm = optim::clipGradNorm(params_, options_.gradClip, *shardComm_,
                                     normOverWorld && alongside ? sumAlongside : at::Tensor(), deterministic());
  if (!normOverWorld && alongside) distributed::allReduceHostTensor(*comm_, sumAlongside, distributed::ReduceOp::kSum);
  result.gradNorm = norm.norm;
  result.clipCoef = norm.clipCoef;
  if (!norm.finite()) {
    // Same norm on every rank (one all-reduce, or identical replicated gradients), so
    // every rank skips: parameters stay identical and no collective is left unmatched.
    result.skipped = true;
    zeroGrad();
    ++stepsSkipped_;
    synchronizeBuffers();
    if (sums != nullptr) sums->takeSums(sumAlongside);
    return result;
  }
  {
    const trace::Span span("optimizer", "optimizer update");
    update();
  }
  // The records' gradients live for one step; transient gradient shards (zero1) are freed
  // here, what zero2/zero3 keep until zeroGrad() is in heldGradShards_.
  for (dtensor::ShardedParam& p : params_) p.grad.reset();
  const trace::Span span("optimizer", "publish parameters");
  publishParameters();
  synchronizeBuffers();
  ++stepsApplied_;
  if (sums != nullptr) sums->takeSums(sumAlongside);
  return result;
}

void ShardingStrategy::synchronizeBuffers() {
  if (buffers_.empty() || comm_->worldSize() == 1) return;
  switch (bufferSync_) {
    case BufferSync::kNone:
      return;
    case BufferSync::kBroadcast: {
      std::vector<at::Tensor> all;
      for (const NamedTensor& b : buffers_) all.push_back(b.tensor);
      broadcastCoalesced(all, *comm_, 0, options_.bucketBytes);
      return;
    }
    case BufferSync::kAverage: {
      std::vector<at::Tensor> floating, other;
      for (const NamedTensor& b : buffers_) (b.tensor.is_floating_point() ? floating : other).push_back(b.tensor);
      allReduceCoalesced(floating, *comm_, distributed::ReduceOp::kAvg, options_.bucketBytes);
      broadcastCoalesced(other, *comm_, 0, options_.bucketBytes);  // e.g. num_batches_tracked
      return;
    }
  }
}

namespace {

// Sums storage bytes, each storage once.
class StorageCounter {
 public:
  int64_t add(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return 0;
    const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    if (!seen_.insert(storage).second) return 0;
    return static_cast<int64_t>(storage->nbytes());
  }

 private:
  std::unordered_set<const c10::StorageImpl*> seen_;
};

}  // namespace

ResidentBytes ShardingStrategy::residentBytes() const {
  ResidentBytes bytes;
  StorageCounter counter;
  const auto parameters = module_.parameters(/*recurse=*/true);
  const auto countMasters = [&] {
    for (const dtensor::ShardedParam& p : params_) (p.trainable ? bytes.optimizer : bytes.params) += counter.add(p.master);
  };
  // zero3's masters are the optimizer's, also where (one rank, fp32) the module's
  // parameters are views of them; data parallel's fp32 masters are the parameters.
  const bool mastersFirst = kind_ == StrategyKind::kZero3 || kind_ == StrategyKind::kHybrid;
  if (mastersFirst) countMasters();
  for (const at::Tensor& p : parameters) bytes.params += counter.add(p);
  for (const at::Tensor& p : parameters) bytes.grads += counter.add(p.grad());
  for (const at::Tensor& g : heldGradShards_) bytes.grads += counter.add(g);
  if (!mastersFirst) countMasters();
  for (const dtensor::ShardedParam& p : params_) {
    if (!p.trainable) continue;
    for (const std::string& key : optimizer_.stateNames()) bytes.optimizer += counter.add(optimizer_.state(p, key));
  }
  for (const at::Tensor& b : module_.buffers(/*recurse=*/true)) bytes.buffers += counter.add(b);
  return bytes;
}

bool ShardingStrategy::firstReplica() const { return comm_->rank() < shardComm_->worldSize(); }

std::unique_ptr<ShardingStrategy> makeStrategy(torch::nn::Module& module,
                                               std::shared_ptr<distributed::Communicator> comm,
                                               const StrategyOptions& options) {
  switch (options.strategy) {
    case StrategyKind::kNoShard:
    case StrategyKind::kZero1:
    case StrategyKind::kZero2:
      return std::make_unique<DataParallelStrategy>(module, std::move(comm), options);
    case StrategyKind::kZero3:
    case StrategyKind::kHybrid:
      return std::make_unique<FullyShardStrategy>(module, std::move(comm), options);
  }
  throw ConfigError(strCat("makeStrategy: unknown strategy ", static_cast<int>(options.strategy)));
}

}  // namespace tessera::sharding
