// One FSDP unit's lifecycle (see fsdp_unit.h).
#include "sharding/fsdp_unit.h"

#include <c10/core/Event.h>
#include <c10/core/GradMode.h>

#include "common/errors.h"
#include "common/trace.h"
#include "distributed/communicator.h"
#include "dtensor/param_init.h"
#include "sharding/host_offload.h"

namespace tessera::sharding {

FsdpUnit::FsdpUnit(std::string name, const torch::nn::Module* module, bool isRoot, const UnitContext& context)
    : ctx_(context), name_(std::move(name)), module_(module), isRoot_(isRoot) {}

FsdpUnit::~FsdpUnit() {
  // An upload still writing the parameters' storage, which the module frees later.
  if (uploaded_) ctx_.offload->waitOn(*uploaded_);
  if (!gather_) return;
  try {
    gather_->wait();
  } catch (...) {
    // Errors are moot now; only the buffers' lifetime matters.
  }
}

void FsdpUnit::setLayout(std::vector<dtensor::ShardSpec> specs, const std::vector<bool>& trainable, at::Device device) {
  std::vector<dtensor::ShardSpec> gradSpecs;
  for (size_t k = 0; k < specs.size(); ++k) {
    if (!trainable[k]) continue;
    trainable_.push_back(k);
    gradSpecs.push_back(specs[k]);
  }
  layout_ = std::make_unique<dtensor::FlatLayout>(std::move(specs));
  gradLayout_ = std::make_unique<dtensor::FlatLayout>(std::move(gradSpecs));
  device_ = device;
  masterChunk_ = at::zeros({layout_->chunkNumel()},
                           ctx_.offload != nullptr ? ctx_.offload->hostOptions() : deviceOptions(at::kFloat));
  // At one rank the masters are cast straight into the parameters: no flat buffer.
  gatherBytes_ = ctx_.shardComm->worldSize() == 1
                     ? 0
                     : layout_->flatNumel() * static_cast<int64_t>(c10::elementSize(ctx_.paramDtype));
  ready_.assign(trainable_.size(), false);
}

at::Tensor FsdpUnit::masterSlot(size_t k) const { return layout_->slot(masterChunk_, k); }

void FsdpUnit::adoptRecords(std::vector<dtensor::ShardedParam*> records) {
  TESSERA_CHECK(records.size() == layout_->size(), "FsdpUnit '", name_, "': ", records.size(), " records for ",
                layout_->size(), " slots");
  params_ = std::move(records);
  c10::NoGradGuard noGrad;
  for (size_t k = 0; k < params_.size(); ++k) {
    const at::Tensor& param = params_[k]->moduleParam;
    if (mastersAreParams()) {
      // The parameter is a view of its master slot, which the optimizer updates in place
      // (its own version counter: autograd does not see those updates, as in a plain loop).
      param.set_data(layout_->slot(masterChunk_, k).view(param.sizes()));
      continue;
    }
    param.set_data(dtensor::deferredTensor(param.sizes().vec(), deviceOptions(ctx_.paramDtype)));
    paramBytes_ += static_cast<int64_t>(storageBytes(k));
  }
}

bool FsdpUnit::mastersAreParams() const {
  return ctx_.shardComm->worldSize() == 1 && ctx_.offload == nullptr && ctx_.paramDtype == at::kFloat;
}

size_t FsdpUnit::storageBytes(size_t k) const {
  return static_cast<size_t>(layout_->paddedFullNumel(k)) * c10::elementSize(ctx_.paramDtype);
}

// ---- lifecycle ------------------------------------------------------------------------

void FsdpUnit::growStorages() {
  for (size_t k = 0; k < params_.size(); ++k) dtensor::setStorageBytes(params_[k]->moduleParam, storageBytes(k));
  if (!paddedViews_.empty()) return;
  // Made once the storages have grown (a view may not outgrow its storage); they stay
  // valid since a storage grows and shrinks in place. Each has its own version counter,
  // so autograd's saved references to a parameter do not see the copy as a modification.
  for (size_t k = 0; k < params_.size(); ++k) {
    const at::Tensor& p = params_[k]->moduleParam;
    paddedViews_.push_back(at::empty({0}, p.options()).set_(p.storage(), 0, {layout_->paddedFullNumel(k)}, {1}));
  }
}

bool FsdpUnit::gatherIsFree() const { return ctx_.shardComm->worldSize() == 1 && ctx_.offload == nullptr; }

void FsdpUnit::unshard() {
  if (sharded_ != ShardedState::kSharded) return;
  if (params_.empty()) {  // e.g. a root whose children are all units: nothing to gather
    sharded_ = ShardedState::kUnsharded;
    return;
  }
  const trace::Tag tag(traceName());
  HostOffload* offload = ctx_.offload;
  if (mastersAreParams()) {
    // The parameters are views of the masters: nothing to gather or copy.
  } else if (ctx_.shardComm->worldSize() == 1) {
    // One rank in the shard group: the shard is the whole flat parameter. Cast straight
    // into the parameters (allocated on the compute stream, which uses them).
    growStorages();
    const HostOffload::UploadScope onUpload(offload);
    layout_->unpackAll(offload != nullptr ? offload->upload(masterChunk_) : masterChunk_, paddedViews_);
    if (offload != nullptr) uploaded_ = std::make_unique<c10::Event>(offload->markUploaded());
  } else {
    flat_ = at::empty({layout_->flatNumel()}, deviceOptions(ctx_.paramDtype));
    at::Tensor chunk = layout_->chunk(flat_, ctx_.shardComm->rank());
    const HostOffload::UploadScope onUpload(offload);
    // Cast to the compute dtype before gathering: half the bytes in bf16. With offload the
    // gather, issued on the upload stream, waits for the upload.
    chunk.copy_(offload != nullptr ? offload->upload(masterChunk_) : masterChunk_);
    gather_ = ctx_.shardComm->allGatherIntoAsync(flat_, chunk);
  }
  sharded_ = ShardedState::kUnsharding;
  ctx_.sample();
}

void FsdpUnit::waitForUnshard() {
  unshard();
  if (sharded_ != ShardedState::kUnsharding) return;
  if (gather_) {
    gather_->wait();
    gather_.reset();
    growStorages();
    layout_->unpackAll(flat_, paddedViews_);
  } else if (uploaded_) {
    ctx_.offload->waitOn(*uploaded_);
    uploaded_.reset();
  }
  sharded_ = ShardedState::kUnsharded;
  ctx_.sample();  // the flat buffer and the full parameters, both alive for this moment
  flat_ = at::Tensor();
}

void FsdpUnit::reshard() {
  if (sharded_ == ShardedState::kUnsharding && gather_) {
    gather_->wait();  // never leave a collective unwaited
    gather_.reset();
    flat_ = at::Tensor();
  } else if (sharded_ != ShardedState::kSharded && !mastersAreParams()) {
    // Storage the upload may still be writing: the compute stream, which reuses freed
    // blocks, waits for it first.
    if (uploaded_) ctx_.offload->waitOn(*uploaded_);
    uploaded_.reset();
    for (const dtensor::ShardedParam* p : params_) dtensor::setStorageBytes(p->moduleParam, 0);
  }
  sharded_ = ShardedState::kSharded;
}

void FsdpUnit::preForward() {
  training_ = TrainingState::kForward;
  waitForUnshard();
  trace::setThreadDetail("forward " + traceName());  // what a flight-recorder dump says this thread does
  spanBeginNs_ = trace::active() ? trace::nowNs() : -1;  // compute only: the wait is a span of its own
}

void FsdpUnit::postForward(bool reshardNow) {
  training_ = TrainingState::kIdle;
  endSpan("forward ");
  if (reshardNow) reshard();
}

bool FsdpUnit::preBackward() {
  waitForUnshard();
  if (gradientsInShard()) attachGradientsToShard();
  if (training_ == TrainingState::kPreBackward || training_ == TrainingState::kPostBackward) return false;
  training_ = TrainingState::kPreBackward;
  trace::setThreadDetail("backward " + traceName());
  spanBeginNs_ = trace::active() ? trace::nowNs() : -1;
  return true;
}

void FsdpUnit::endSpan(const char* phase) {
  trace::setThreadDetail("");
  if (spanBeginNs_ < 0) return;
  trace::record({phase + traceName(), "compute", trace::thisThreadName(), spanBeginNs_, trace::nowNs()});
  spanBeginNs_ = -1;
}

bool FsdpUnit::gradReady(size_t j) {
  if (ready_[j]) return false;
  ready_[j] = true;
  return ++readyCount_ == trainable_.size();
}

void FsdpUnit::postBackward(bool reshardNow) {
  training_ = TrainingState::kPostBackward;
  endSpan("backward ");
  if (reshardNow && !hasFrozenParams()) reshard();
}

bool FsdpUnit::gradientsInShard() const {
  return mastersAreParams() && ctx_.replicaComm == nullptr && ctx_.reduceDtype == at::kFloat && !ctx_.gradientsApart;
}

void FsdpUnit::attachGradientsToShard() {
  if (trainable_.empty()) return;
  c10::NoGradGuard noGrad;
  if (!gradShard_.defined()) {
    gradShard_ = at::zeros({gradLayout_->chunkNumel()}, deviceOptions(at::kFloat));
    attached_.assign(trainable_.size(), false);
    attachedViews_.clear();
  }
  if (attachedViews_.empty()) {
    for (size_t j = 0; j < trainable_.size(); ++j) {
      attachedViews_.push_back(gradLayout_->slot(gradShard_, j).view(trainableParam(j).sizes()));
    }
  }
  for (size_t j = 0; j < trainable_.size(); ++j) {
    const at::Tensor& param = trainableParam(j);
    const at::Tensor& slot = attachedViews_[j];
    const at::Tensor& grad = param.grad();
    if (grad.defined() && grad.data_ptr() == slot.data_ptr()) continue;
    if (grad.defined()) {
      // A gradient that replaced the slot's view (autograd does so with create_graph, or
      // the caller did) holds the slot's sum already; one from before the attach joins it.
      if (attached_[j]) {
        slot.copy_(grad.reshape(slot.sizes()));
      } else {
        slot.add_(grad.reshape(slot.sizes()));
      }
    }
    param.mutable_grad() = slot;
    attached_[j] = true;
  }
}

bool FsdpUnit::reducedInPlace() {
  if (!gradientsInShard()) return false;
  attachGradientsToShard();  // a unit no gradient reached: its shard is zeros, as a reduce would make it
  reduced_ = true;
  return true;
}

ReduceJob FsdpUnit::startReduce() {
  const auto options = deviceOptions(ctx_.reduceDtype);
  ReduceJob job;
  job.unit = this;
  job.flat = at::empty({gradLayout_->flatNumel()}, options);
  {
    c10::NoGradGuard noGrad;
    std::vector<at::Tensor> grads;
    grads.reserve(trainable_.size());
    for (size_t j = 0; j < trainable_.size(); ++j) grads.push_back(trainableParam(j).grad());
    gradLayout_->packAll(job.flat, grads);  // zeros where a gradient is missing
    for (size_t j = 0; j < trainable_.size(); ++j) trainableParam(j).mutable_grad().reset();
  }
  // One rank in the shard group: the reduce-scatter is in place, the packed gradients are
  // the shard's (no second buffer and copy).
  job.local = ctx_.shardComm->worldSize() == 1 ? job.flat : at::empty({gradLayout_->chunkNumel()}, options);
  const trace::Tag tag(traceName());
  job.handle = ctx_.shardComm->reduceScatterAsync(job.local, job.flat, distributed::ReduceOp::kAvg);
  reduced_ = true;
  return job;
}

void FsdpUnit::finishReduce(ReduceJob& job) {
  job.flat = at::Tensor();
  // hybrid: the shard group's average, averaged again over the replica groups.
  if (ctx_.replicaComm != nullptr) ctx_.replicaComm->allReduce(job.local, distributed::ReduceOp::kAvg);
  takeReducedChunk(job.local);
}

void FsdpUnit::takeReducedChunk(const at::Tensor& local) {
  c10::NoGradGuard noGrad;
  if (ctx_.offload != nullptr) {
    const at::Tensor reduced = local.scalar_type() == at::kFloat ? local : local.to(at::kFloat);
    at::Tensor host = at::empty({reduced.numel()}, ctx_.offload->hostOptions());
    ctx_.offload->download(host, reduced);
    if (!gradShard_.defined()) {
      gradShard_ = host;
    } else {  // accumulating micro-batches: added on the host once everything has landed
      pendingHostGrads_.push_back(host);
    }
    return;
  }
  if (!gradShard_.defined()) {
    gradShard_ = local.scalar_type() == at::kFloat ? local : local.to(at::kFloat);
  } else {
    gradShard_.add_(local);
  }
}

void FsdpUnit::addPendingGradients() {
  c10::NoGradGuard noGrad;
  for (const at::Tensor& g : pendingHostGrads_) gradShard_.add_(g);
  pendingHostGrads_.clear();
}

void FsdpUnit::endBackward() {
  std::fill(ready_.begin(), ready_.end(), false);
  readyCount_ = 0;
  reduced_ = false;
  training_ = TrainingState::kIdle;
}

// ---- what it holds --------------------------------------------------------------------

bool FsdpUnit::hasLocalGradients() const {
  for (size_t j = 0; j < trainable_.size(); ++j) {
    if (trainableParam(j).grad().defined()) return true;
  }
  return false;
}

void FsdpUnit::exposeGradients() const {
  if (!gradShard_.defined()) return;
  for (size_t j = 0; j < trainable_.size(); ++j) params_[trainable_[j]]->grad = gradLayout_->slot(gradShard_, j);
}

int64_t FsdpUnit::reduceBytes() const {
  return gradLayout_->flatNumel() * static_cast<int64_t>(c10::elementSize(ctx_.reduceDtype));
}

int64_t FsdpUnit::unshardedBytes() const {
  if (mastersAreParams()) return 0;  // the masters' storage: nothing gathered
  int64_t bytes = 0;
  for (const dtensor::ShardedParam* p : params_) bytes += static_cast<int64_t>(p->moduleParam.storage().nbytes());
  if (flat_.defined()) bytes += static_cast<int64_t>(flat_.storage().nbytes());
  return bytes;
}

}  // namespace tessera::sharding
