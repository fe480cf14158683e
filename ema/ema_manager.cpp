// ShardedModelEMAManager (see ema_manager.h).
#include "ema/ema_manager.h"

#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <torch/version.h>
#if TORCH_VERSION_MAJOR >= 2
#include <ATen/ops/_foreach_lerp.h>
#endif
#ifdef TESSERA_EMA_CUDA_KERNEL
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>

#include "ema/ema_blend_cuda.h"
#endif

#include <cmath>
#include <cstdio>

#include "common/errors.h"
#include "ema/power_ema.h"

namespace tessera::ema {
namespace {

// e = d*e + w*p over n floats. __restrict and -O3 (set for this file in CMake) let the
// compiler vectorise it, which makes it as fast as one flat add_ over the same bytes
// (docs/benchmarks.md, "EMA update").
void blendKernel(float* __restrict e, const float* __restrict p, float d, float w, int64_t n) {
  for (int64_t i = 0; i < n; ++i) e[i] = d * e[i] + w * p[i];
}

}  // namespace

// e = d*e + (1-d)*p for every pair on an accelerator, in one pass over memory, with one
// multi-tensor launch per decay (torch's foreach lerp, well below copy bandwidth:
// docs/benchmarks.md, "EMA update over 1B parameters").
void ShardedModelEMAManager::blendFused(const std::vector<at::Tensor>& ema, const std::vector<at::Tensor>& live,
                                        double decay) {
  if (ema.empty()) return;
#if TORCH_VERSION_MAJOR >= 2
  at::_foreach_lerp_(ema, live, 1.0 - decay);
#else
  for (size_t i = 0; i < ema.size(); ++i) ema[i].lerp_(live[i], 1.0 - decay);
#endif
}

#ifdef TESSERA_EMA_CUDA_KERNEL
// fp32 EMA rows and fp32 live rows on one CUDA device: Tessera's kernel takes them.
bool ShardedModelEMAManager::kernelTakes(const at::Tensor& emaBuffer, const at::Tensor& live) const {
  return emaBuffer.is_cuda() && emaBuffer.scalar_type() == at::kFloat && live.scalar_type() == at::kFloat &&
         live.device() == emaBuffer.device() && live.is_contiguous() && emaBuffer.is_contiguous();
}

// One kernel launch for every tensor of decay `decayIndex` (`tensors`: EMA rows, live
// rows, real elements). The segment table goes to the device only when the tensors
// changed (never, in a run: shards keep their storage), so the host work per update is a
// comparison of one entry per tensor.
void ShardedModelEMAManager::blendOnGpu(size_t decayIndex, const std::vector<cuda::BlendSegment>& tensors,
                                         at::Device device, double decay) {
  if (tensors.empty()) return;
  if (fusedTables_.size() < numProfiles()) fusedTables_.resize(numProfiles());
  FusedTable& table = fusedTables_[decayIndex];
  const bool same = table.tensors.size() == tensors.size() &&
                    std::memcmp(table.tensors.data(), tensors.data(), tensors.size() * sizeof(cuda::BlendSegment)) == 0;
  if (!same || !table.device.defined() || table.device.device() != device) {
    std::vector<cuda::BlendSegment> segments;
    for (const auto& t : tensors) {
      for (int64_t off = 0; off < t.n; off += cuda::kEmaSegmentElements) {
        segments.push_back({t.ema + off, t.live + off, std::min(cuda::kEmaSegmentElements, t.n - off)});
      }
    }
    const auto bytes = static_cast<int64_t>(segments.size() * sizeof(cuda::BlendSegment));
    at::Tensor host = at::empty({bytes}, at::kByte);
    if (bytes > 0) std::memcpy(host.data_ptr(), segments.data(), static_cast<size_t>(bytes));
    table.device = host.to(device);
    table.segments = static_cast<int64_t>(segments.size());
    table.tensors = tensors;
  }
  const c10::cuda::CUDAGuard guard(device);
  const std::string error =
      cuda::blendSegments(static_cast<const cuda::BlendSegment*>(table.device.data_ptr()), table.segments,
                          static_cast<float>(decay), static_cast<float>(1.0 - decay),
                          c10::cuda::getCurrentCUDAStream(device.index()).stream());
  TESSERA_CHECK(error.empty(), "ShardedModelEMAManager::update: CUDA kernel launch failed: ", error);
}
#endif

ShardedModelEMAManager::ShardedModelEMAManager(EmaOptions o) : options_(std::move(o)) {
  TESSERA_CHECK_AS(ConfigError, !options_.decays.empty(), "ShardedModelEMAManager: no decays given");
  for (double d : options_.decays) {
    TESSERA_CHECK_AS(ConfigError, d >= 0.0 && d < 1.0, "ShardedModelEMAManager: decay ", d, " is not in [0, 1)");
  }
  TESSERA_CHECK_AS(ConfigError, options_.updateEvery >= 1, "ShardedModelEMAManager: update_every must be >= 1");
  TESSERA_CHECK_AS(ConfigError, options_.startStep >= 0, "ShardedModelEMAManager: start_step must be >= 0");
  TESSERA_CHECK_AS(ConfigError, options_.invGamma > 0 && options_.power > 0,
                   "ShardedModelEMAManager: warmup inv_gamma and power must be > 0");
  TESSERA_CHECK_AS(ConfigError, at::isFloatingType(options_.dtype), "ShardedModelEMAManager: EMA dtype must be floating");
  for (size_t i = 0; i < options_.powerStds.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      TESSERA_CHECK_AS(ConfigError, options_.powerStds[i] != options_.powerStds[j],
                       "ShardedModelEMAManager: power-function sigma_rel ", options_.powerStds[i], " given twice");
    }
    powerGammas_.push_back(powerEmaExponent(options_.powerStds[i]));
  }
  names_ = emaProfileNames(options_.prefix, options_.decays, options_.powerStds);
  if (!options_.formerPrefix.empty()) {
    formerNames_ = emaProfileNames(options_.formerPrefix, options_.decays, options_.powerStds);
  }
}

void ShardedModelEMAManager::addParam(const std::string& name, const dtensor::ShardSpec& spec, const at::Tensor& live) {
  TESSERA_CHECK(!params_.count(name) && !buffers_.count(name), "ShardedModelEMAManager::addParam: '", name,
                "' registered twice");
  TESSERA_CHECK(live.defined() && live.is_contiguous(), "ShardedModelEMAManager::addParam: '", name,
                "' must be a defined contiguous tensor");
  const int64_t realNumel = spec.localRows() * spec.rowNumel();
  TESSERA_CHECK(live.numel() == spec.paddedNumel() || live.numel() == realNumel, "ShardedModelEMAManager::addParam: '",
                name, "' has ", live.numel(), " elements; spec ", spec.str(), " needs ", spec.paddedNumel(),
                " (padded) or ", realNumel, " (real rows)");
  // The EMA is always a padded local buffer; the live tensor may be padded too (a shard)
  // or just this rank's real rows (a slice of a replicated parameter).
  at::Tensor liveRows = live.numel() == spec.paddedNumel() ? spec.realRows(live) : live.view({spec.localRows(), spec.rowNumel()});
  // The layout of the parameter, the dtype of the EMA: what checkpoints and exports see.
  const dtensor::ShardSpec emaSpec(spec.globalShape(), options_.dtype, spec.worldSize(), spec.rank(), spec.placement());
  Entry e{emaSpec, liveRows, {}};
  for (size_t i = 0; i < numProfiles(); ++i) {
    at::Tensor buffer = at::zeros({spec.paddedNumel()}, live.options().dtype(options_.dtype)).view(spec.localShape());
    spec.realRows(buffer).copy_(liveRows);
    e.ema.push_back(buffer);
  }
  params_.emplace(name, std::move(e));
  paramNames_.push_back(name);
}

void ShardedModelEMAManager::addBuffer(const std::string& name, const dtensor::ShardSpec& spec,
                                       const at::Tensor& live) {
  TESSERA_CHECK(!params_.count(name) && !buffers_.count(name), "ShardedModelEMAManager::addBuffer: '", name,
                "' registered twice");
  TESSERA_CHECK(live.defined() && spec.placement() == dtensor::Placement::kReplicate &&
                    live.sizes().vec() == spec.globalShape() && live.scalar_type() == spec.dtype(),
                "ShardedModelEMAManager::addBuffer: '", name, "' must be a defined tensor replicated as ", spec.str());
  BufferEntry e{spec, live, {}};
  for (size_t i = 0; i < numProfiles(); ++i) e.ema.push_back(live.detach().clone());
  buffers_.emplace(name, std::move(e));
  bufferNames_.push_back(name);
}

void ShardedModelEMAManager::resetFromLive() {
  c10::NoGradGuard noGrad;
  for (auto& [name, e] : params_) {
    for (auto& t : e.ema) e.spec.realRows(t).copy_(e.live);
  }
  for (auto& [name, b] : buffers_) {
    for (auto& t : b.ema) t.copy_(b.live);
  }
  updates_ = 0;
}

double ShardedModelEMAManager::effectiveDecay(size_t decayIndex, int64_t k) const {
  TESSERA_CHECK(decayIndex < options_.decays.size(), "ShardedModelEMAManager::effectiveDecay: profile ", decayIndex,
                " is not a decay");
  double d = options_.decays[decayIndex];
  if (options_.warmup) d = std::max(std::min(d, warmupDecayCap(options_, k)), 0.0);
  return std::pow(d, static_cast<double>(options_.updateEvery));
}

void ShardedModelEMAManager::blend(at::Tensor& ema, const at::Tensor& live, double decay) const {
  if (ema.device().is_cpu() && ema.scalar_type() == at::kFloat && live.scalar_type() == at::kFloat &&
      ema.is_contiguous() && live.is_contiguous()) {
    // One pass over memory (read e, read p, write e): the update is bandwidth bound, and
    // mul_ + add_ would read and write e twice.
    float* e = ema.data_ptr<float>();
    const float* p = live.data_ptr<float>();
    const float d = static_cast<float>(decay), w = static_cast<float>(1.0 - decay);
    at::parallel_for(0, ema.numel(), 1 << 16,
                     [&](int64_t begin, int64_t end) { blendKernel(e + begin, p + begin, d, w, end - begin); });
    return;
  }
  ema.mul_(decay).add_(live.to(ema.scalar_type()), 1.0 - decay);
}

void ShardedModelEMAManager::update(int64_t step, bool optimizerApplied) {
  if (!optimizerApplied) return;
  c10::NoGradGuard noGrad;
  const bool copyOnly = step < options_.startStep;
  const bool decaysDue = copyOnly || (step % options_.updateEvery) == 0;
  for (size_t i = 0; i < numProfiles(); ++i) {
    if (!isPowerProfile(i) && !decaysDue) continue;
    const double d = isPowerProfile(i) ? powerEmaBeta(powerGamma(i), step) : copyOnly ? 0.0 : effectiveDecay(i, updates_);
    std::vector<at::Tensor> fusedEma, fusedLive;  // accelerator tensors of one dtype
#ifdef TESSERA_EMA_CUDA_KERNEL
    std::vector<cuda::BlendSegment> kernelTensors;
    at::Device kernelDevice = at::kCPU;
#endif
    for (auto& [name, e] : params_) {
#ifdef TESSERA_EMA_CUDA_KERNEL
      // Raw pointers, no tensor views: the EMA's real rows are its buffer's prefix.
      if (kernelTakes(e.ema[i], e.live) && (kernelTensors.empty() || e.live.device() == kernelDevice)) {
        kernelDevice = e.live.device();
        kernelTensors.push_back({e.ema[i].data_ptr<float>(), e.live.data_ptr<float>(), e.live.numel()});
        continue;
      }
#endif
      at::Tensor rows = e.spec.realRows(e.ema[i]);
      if (!rows.device().is_cpu() && rows.scalar_type() == e.live.scalar_type() &&
          rows.device() == e.live.device()) {
        fusedEma.push_back(rows);
        fusedLive.push_back(e.live);
      } else {
        blend(rows, e.live, d);
      }
    }
    blendFused(fusedEma, fusedLive, d);
#ifdef TESSERA_EMA_CUDA_KERNEL
    blendOnGpu(i, kernelTensors, kernelDevice, d);
#endif
    for (auto& [name, b] : buffers_) {
      if (copyOnly || options_.buffers == EmaBuffers::kCopy || !at::isFloatingType(b.live.scalar_type())) {
        b.ema[i].copy_(b.live);
      } else {
        blend(b.ema[i], b.live, d);
      }
    }
  }
  if (!copyOnly && decaysDue) ++updates_;
}

double ShardedModelEMAManager::powerStd(size_t profile) const {
  TESSERA_CHECK(isPowerProfile(profile) && profile < numProfiles(), "ShardedModelEMAManager: profile ", profile,
                " is not a power-function profile");
  return options_.powerStds[profile - options_.decays.size()];
}

double ShardedModelEMAManager::powerGamma(size_t profile) const {
  powerStd(profile);  // checks the index
  return powerGammas_[profile - options_.decays.size()];
}

std::string ShardedModelEMAManager::stateName(size_t decayIndex) const {
  TESSERA_CHECK(decayIndex < numProfiles(), "ShardedModelEMAManager::stateName: profile index ", decayIndex);
  return names_[decayIndex].state;
}

std::string ShardedModelEMAManager::decayName(size_t decayIndex) const {
  TESSERA_CHECK(decayIndex < numProfiles(), "ShardedModelEMAManager::decayName: profile index ", decayIndex);
  return names_[decayIndex].alias;
}

size_t ShardedModelEMAManager::decayIndexOf(const std::string& name) const {
  for (size_t i = 0; i < numProfiles(); ++i) {
    if (name == stateName(i) || name == decayName(i)) return i;
  }
  throw Error(strCat("ShardedModelEMAManager: no EMA named '", name, "' (have ", stateName(0),
                     numProfiles() > 1 ? ", ..." : "", ")"));
}

std::vector<dtensor::StateEntry> ShardedModelEMAManager::stateEntries(const std::string& prefix) {
  std::vector<dtensor::StateEntry> entries;
  for (size_t d = 0; d < numProfiles(); ++d) {
    for (auto& e : profileEntries(d, prefix)) entries.push_back(std::move(e));
  }
  return entries;
}

std::vector<dtensor::StateEntry> ShardedModelEMAManager::profileEntries(size_t profile, const std::string& prefix) {
  const std::string base = prefix + stateName(profile) + "/";
  const std::string formerBase = formerNames_.empty() ? "" : prefix + formerNames_.at(profile).state + "/";
  std::vector<dtensor::StateEntry> entries;
  auto add = [&](const std::string& name, const dtensor::ShardSpec& spec, const at::Tensor& ema) {
    dtensor::StateEntry entry{base + name, spec, ema};
    if (!formerBase.empty()) entry.formerName = formerBase + name;
    entries.push_back(std::move(entry));
  };
  for (const std::string& name : paramNames_) add(name, params_.at(name).spec, params_.at(name).ema.at(profile));
  for (const std::string& name : bufferNames_) add(name, buffers_.at(name).spec, buffers_.at(name).ema.at(profile));
  return entries;
}

std::map<std::string, std::string> ShardedModelEMAManager::exportAliases(const std::string& prefix) const {
  std::map<std::string, std::string> aliases;
  for (size_t d = 0; d < numProfiles(); ++d) aliases[decayName(d)] = prefix + stateName(d) + "/";
  return aliases;
}

std::vector<dtensor::StateEntry> ShardedModelEMAManager::stateEntries() {
  std::vector<dtensor::StateEntry> entries = stateEntries("");
  updateCount_.fill_(updates_);
  // Replicated over the group the shards are laid out over (every rank holds the count).
  const dtensor::ShardSpec* any = params_.empty() ? nullptr : &params_.begin()->second.spec;
  dtensor::StateEntry count{updateCountName(),
                             dtensor::ShardSpec({}, at::kLong, any ? any->worldSize() : 1, any ? any->rank() : 0,
                                                 dtensor::Placement::kReplicate),
                             updateCount_};
  count.optional = true;
  if (!formerNames_.empty()) count.formerName = formerNames_[0].state + ".updates";
  entries.push_back(std::move(count));
  return entries;
}

void ShardedModelEMAManager::afterLoad() {
  const int64_t count = updateCount_.item<int64_t>();
  TESSERA_CHECK(count >= 0, "ShardedModelEMAManager: loaded update count ", count, " of ", stateName(0),
                " is negative");
  updates_ = count;
}

std::map<std::string, std::string> ShardedModelEMAManager::exportNames() const {
  std::map<std::string, std::string> names = exportAliases("");
  for (size_t d = 0; d < numProfiles(); ++d) {
    names[stateName(d)] = stateName(d) + "/";
    if (formerNames_.empty()) continue;
    names[formerNames_[d].state] = stateName(d) + "/";
    names[formerNames_[d].alias] = stateName(d) + "/";
  }
  return names;
}

std::map<std::string, std::string> ShardedModelEMAManager::componentParts() const {
  std::map<std::string, std::string> parts;
  for (size_t d = 0; d < numProfiles(); ++d) parts[stateName(d)] = stateName(d) + "/";
  return parts;
}

ShardedModelEMAManager::Entry& ShardedModelEMAManager::entry(const std::string& name) {
  auto it = params_.find(name);
  TESSERA_CHECK(it != params_.end(), "ShardedModelEMAManager: no parameter named '", name, "'");
  return it->second;
}

const dtensor::ShardSpec& ShardedModelEMAManager::spec(const std::string& name) const {
  auto it = params_.find(name);
  TESSERA_CHECK(it != params_.end(), "ShardedModelEMAManager: no parameter named '", name, "'");
  return it->second.spec;
}

at::Tensor& ShardedModelEMAManager::emaShard(size_t decayIndex, const std::string& name) {
  return entry(name).ema.at(decayIndex);
}

at::Tensor& ShardedModelEMAManager::emaBuffer(size_t decayIndex, const std::string& name) {
  auto it = buffers_.find(name);
  TESSERA_CHECK(it != buffers_.end(), "ShardedModelEMAManager: no buffer named '", name, "'");
  return it->second.ema.at(decayIndex);
}

const at::Tensor& ShardedModelEMAManager::liveBuffer(const std::string& name) const {
  auto it = buffers_.find(name);
  TESSERA_CHECK(it != buffers_.end(), "ShardedModelEMAManager: no buffer named '", name, "'");
  return it->second.live;
}

int64_t ShardedModelEMAManager::bytes() const {
  int64_t total = 0;
  for (const auto& [name, e] : params_) {
    for (const auto& t : e.ema) total += t.numel() * static_cast<int64_t>(t.element_size());
  }
  for (const auto& [name, b] : buffers_) {
    for (const auto& t : b.ema) total += t.numel() * static_cast<int64_t>(t.element_size());
  }
  return total;
}

}  // namespace tessera::ema
