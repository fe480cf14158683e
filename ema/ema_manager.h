// ShardedModelEMAManager: exponential moving averages of a model's parameters, held as
// shards that mirror the train model's sharding (docs/design.md, "EMA"): every EMA tensor
// has the ShardSpec of the live tensor it follows, so EMA memory per rank is 1/N of the
// model under every strategy and the update needs no communication.
//
// Update (after the optimizer step; skipped when the optimizer skipped it), k the updates
// applied so far: e = d * e + (1 - d) * p in the EMA dtype; before start_step e = p;
// warmup: d = min(decay, 1 - (1 + k / inv_gamma)^(-power)); update_every m: every m-th
// step, with d^m. Several decays each get their own shards, named "<prefix>" (the first)
// and "<prefix>_<d>" (%g); power-function profiles for post-hoc EMA (options.powerStds,
// docs/ema.md) are further shards, "<prefix>_phema<sigma_rel>". Buffers follow the model,
// copied or averaged (options.buffers). It is a Stateful component of a checkpoint (its
// profiles and its update count); ema/strategy_ema.h makes it follow a strategy.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/enum_names.h"
#include "ema/profile_names.h"
#include "dtensor/sharded_param.h"
#include "dtensor/stateful.h"
#ifdef TESSERA_EMA_CUDA_KERNEL
#include "ema/ema_blend_cuda.h"
#endif

namespace tessera::ema {

enum class EmaBuffers { kCopy, kAverage };
inline constexpr std::array<EnumName<EmaBuffers>, 2> kEmaBuffersNames = {
    {{"copy", EmaBuffers::kCopy}, {"average", EmaBuffers::kAverage}}};

// The dtypes an EMA may be kept in.
inline constexpr std::array<EnumName<at::ScalarType>, 2> kEmaDtypeNames = {{{"fp32", at::kFloat}, {"bf16", at::kBFloat16}}};

struct EmaOptions {
  std::vector<double> decays = {0.999};
  at::ScalarType dtype = at::kFloat;
  int64_t startStep = 0;      // steps before this copy the parameters
  int64_t updateEvery = 1;    // update every k-th step with decay^k
  bool warmup = false;        // use the warmup formula above
  double invGamma = 1.0;
  double power = 2.0 / 3.0;
  EmaBuffers buffers = EmaBuffers::kCopy;  // how buffers (e.g. BN running stats) follow the model
  std::string prefix = kDefaultEmaPrefix;
  // The name this EMA had in older checkpoints ("" = none): its tensors are read under it
  // when a checkpoint lacks the current names, and its profiles export under it too.
  std::string formerPrefix;
  // Power-function EMA profiles to track, by sigma_rel in (0, 0.28) (empty: none).
  std::vector<double> powerStds;
};

// ema.warmup's cap on the decay at update count k (0-based): 1 - (1 + k / inv_gamma)^-power,
// never below 0. One formula for the manager and the config's check of unreached decays
// (inline: the config's readers link without the manager).
inline double warmupDecayCap(const EmaOptions& options, int64_t k) {
  return std::max(0.0, 1.0 - std::pow(1.0 + static_cast<double>(k) / options.invGamma, -options.power));
}

class ShardedModelEMAManager : public dtensor::Stateful {
 public:
  // Throws tessera::ConfigError for decays outside [0, 1), updateEvery < 1, an empty
  // decay list.
  explicit ShardedModelEMAManager(EmaOptions options);

  // Registers a live parameter shard to follow. `live` is read at every update (it is the
  // tensor the optimizer updates in place: an fp32 master shard, or a bf16 compute slice):
  // either the padded local buffer of `spec`, or only its real rows (e.g. this rank's
  // rows of a replicated parameter, a contiguous view). The EMA is a padded buffer of
  // `spec` in the EMA dtype, starting as a copy of `live`.
  void addParam(const std::string& name, const dtensor::ShardSpec& spec, const at::Tensor& live);
  // Registers a buffer (e.g. BatchNorm running_mean; `spec` Replicate, the buffer's shape
  // and dtype): copied or averaged according to options.buffers. Integer buffers
  // (num_batches_tracked) are always copied.
  void addBuffer(const std::string& name, const dtensor::ShardSpec& spec, const at::Tensor& live);

  // Re-initialises every EMA from the live tensors (the default start).
  void resetFromLive();
  // Called once per optimizer step with the step just completed (1-based: the first call
  // is step 1) and whether the optimizer applied it.
  void update(int64_t step, bool optimizerApplied = true);

  // The decay the next update would use, for update count k (already raised to
  // updateEvery), for decay set i (a decay, not a power profile).
  double effectiveDecay(size_t decayIndex, int64_t k) const;

  // Profiles: the decays, then the power-function profiles. Every per-profile call
  // below takes an index in [0, numProfiles()).
  size_t numProfiles() const { return options_.decays.size() + powerGammas_.size(); }
  bool isPowerProfile(size_t profile) const { return profile >= options_.decays.size(); }
  // sigma_rel and gamma of power profile `profile`.
  double powerStd(size_t profile) const;
  double powerGamma(size_t profile) const;
  std::string stateName(size_t decayIndex) const;  // "model_ema", "model_ema_0.9999"
  // "<prefix>_<decay>" (%g), the name every decay answers to, e.g. "model_ema_0.999";
  // "<prefix>_phema<sigma_rel>" for a power profile.
  std::string decayName(size_t decayIndex) const;
  // Index of a profile by any of its names; throws for an unknown name.
  size_t decayIndexOf(const std::string& name) const;
  int64_t updateCount() const { return updates_; }
  void setUpdateCount(int64_t k) { updates_ = k; }

  // Registered names, in order, and their specs / local EMA shards.
  const std::vector<std::string>& paramNames() const { return paramNames_; }
  bool follows(const std::string& name) const { return params_.count(name) > 0; }
  const std::vector<std::string>& bufferNames() const { return bufferNames_; }
  const dtensor::ShardSpec& spec(const std::string& name) const;
  at::Tensor& emaShard(size_t decayIndex, const std::string& name);
  at::Tensor& emaBuffer(size_t decayIndex, const std::string& name);
  // The model's buffer a registered buffer follows.
  const at::Tensor& liveBuffer(const std::string& name) const;

  // Every EMA tensor as a checkpoint entry that saves and loads in place:
  // <prefix><stateName(d)>/<name> for each decay d, parameters (their spec) and buffers
  // (replicated).
  std::vector<dtensor::StateEntry> stateEntries(const std::string& prefix);
  // The entries of one profile only (<prefix><stateName(profile)>/<name>).
  std::vector<dtensor::StateEntry> profileEntries(size_t profile, const std::string& prefix);
  // Export names -> checkpoint prefixes: decayName(d) -> "<prefix><stateName(d)>/" for
  // every decay (stateName itself resolves without an alias).
  std::map<std::string, std::string> exportAliases(const std::string& prefix) const;

  // Stateful (dtensor/stateful.h): every profile's tensors (stateEntries("")) and the
  // update count as an int64 scalar, "<stateName(0)>.updates" (optional: checkpoints older
  // than it keep the count in trainer_state.json); a load restores the count; exported
  // under every profile's names.
  std::vector<dtensor::StateEntry> stateEntries() override;
  void afterLoad() override;
  std::map<std::string, std::string> exportNames() const override;
  std::string componentKind() const override { return "ema"; }
  // Each profile: stateName(d) -> "<stateName(d)>/".
  std::map<std::string, std::string> componentParts() const override;
  // The count entry's name ("model_ema.updates").
  std::string updateCountName() const { return stateName(0) + ".updates"; }

  // Bytes of EMA state on this rank (all decays).
  int64_t bytes() const;

 private:
  struct Entry {
    dtensor::ShardSpec spec;
    at::Tensor live;              // the live real rows, [localRows, rowNumel]
    std::vector<at::Tensor> ema;  // one padded buffer per profile
  };
  struct BufferEntry {
    dtensor::ShardSpec spec;
    at::Tensor live;
    std::vector<at::Tensor> ema;
  };
  Entry& entry(const std::string& name);
  void blend(at::Tensor& ema, const at::Tensor& live, double decay) const;
  void blendFused(const std::vector<at::Tensor>& ema, const std::vector<at::Tensor>& live, double decay);
#ifdef TESSERA_EMA_CUDA_KERNEL
  bool kernelTakes(const at::Tensor& emaBuffer, const at::Tensor& live) const;
  void blendOnGpu(size_t decayIndex, const std::vector<cuda::BlendSegment>& tensors, at::Device device,
                   double decay);
#endif

  EmaOptions options_;
  std::vector<double> powerGammas_;  // per power profile, from options_.powerStds
  std::vector<EmaProfileName> names_;  // per profile: emaProfileNames(options_)
  std::vector<EmaProfileName> formerNames_;  // the same under options_.formerPrefix (empty without one)
  std::vector<std::string> paramNames_, bufferNames_;
  std::map<std::string, Entry> params_;
  std::map<std::string, BufferEntry> buffers_;
  int64_t updates_ = 0;
  at::Tensor updateCount_ = at::zeros({}, at::kLong);  // updates_ as a checkpoint entry
  // Per decay: the GPU kernel's segment table (CUDA builds only; see blendOnGpu).
#ifdef TESSERA_EMA_CUDA_KERNEL
  struct FusedTable {
    std::vector<cuda::BlendSegment> tensors;  // what the table was built from
    at::Tensor device;                        // the segment table, in device memory
    int64_t segments = 0;
  };
  std::vector<FusedTable> fusedTables_;
#endif
};

}  // namespace tessera::ema
