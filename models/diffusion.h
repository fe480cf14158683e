// Diffusion denoisers — the residual-MLP denoiser over vectors or images and the DiT
// (models/dit.h) — their shared loss, classifier-free guidance and the DDPM and DDIM
// samplers.
//
// Forward process (Ho et al. 2020): with betas beta_0..beta_{T-1} and abar_t =
// prod_{s<=t} (1 - beta_s), a clean sample x0 and noise eps ~ N(0, I) give
// x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps. The betas (model.noise_schedule): linear
// from model.beta_start to model.beta_end (DDPM's), or cosine (Nichol & Dhariwal 2021);
// model.zero_terminal_snr rescales sqrt(abar) so that abar_{T-1} = 0 (Lin et al. 2024):
// the last timestep is pure noise, where samplers and a one-step generator start.
// What the denoiser outputs (model.prediction): the noise eps (Ho et al.) or the velocity
// v = sqrt(abar_t) eps - sqrt(1 - abar_t) x0 (Salimans & Ho 2022), which stays meaningful
// at abar = 0 (v = -x0 there), where a noise prediction says nothing of x0.
// The loss of a sample is w(t) mean((output(x_t, t, y) - target)^2) for a uniform t, with
// w = 1 (model.loss_weighting uniform) or min-SNR-gamma's weight (minSnrLossWeight). A
// class-conditional denoiser sees its label y replaced by the "no class" label (= classes)
// with probability model.class_dropout, so that one model gives both terms of
// classifier-free guidance (Ho & Salimans 2022): e = e(x, t, none) + cfg (e(x, t, y) - e(x, t, none)).
// The timestep, noise and label drop of each sample come from Batch::noiseSeeds, so they
// depend on the run seed, the step and the sample only: sharded training sees the draws an
// unsharded run sees, and a resumed run the draws of an uninterrupted one.
//
// Residual-MLP denoiser (width W = model.embed_dim, model.layers blocks; names as the
// equivalent PyTorch modules; unconditional: it ignores labels):
//   time_embed   Sequential(Linear(W, W), SiLU, Linear(W, W)) over the sinusoidal
//                embedding of t: time_embed.0.*, time_embed.2.*
//   input_proj   Linear(D, W) of the flattened x_t (D features)
//   blocks.<i>   h + fc2(silu(fc1(norm(h) + time_proj(silu(temb))))), fc1: W -> 4W;
//                names blocks.<i>.norm, .time_proj, .fc1, .fc2. Each block is a unit
//                (sharding::Unit).
//   out_norm     LayerNorm(W), then output_proj Linear(W, D): the prediction.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "sharding/unit.h"
#include "models/layers.h"
#include "models/model_options.h"
#include "models/train_model.h"

namespace tessera::models {

enum class Prediction { kNoise, kVelocity };  // model.prediction: eps | v

// The GAN head's module name (Denoiser::discriminate): its parameters are "gan_head.*".
// A denoiser started from an export of one without a head (a DMD critic from its teacher)
// keeps the head's fresh initialisation.
inline constexpr char kGanHeadModule[] = "gan_head";

// The forward process and what a denoiser outputs: everything the loss, the samplers and
// DMD need to read an output (double precision, CPU).
struct NoiseSchedule {
  // model.timesteps, beta_start, beta_end, noise_schedule, zero_terminal_snr, prediction.
  explicit NoiseSchedule(const ModelOptions& options);
  // DDPM's: linear betas, noise prediction.
  NoiseSchedule(int64_t timesteps, double betaStart, double betaEnd);

  int64_t timesteps;
  std::vector<double> betas, alphaBars;
  Prediction prediction = Prediction::kNoise;

  // The clean sample and the noise a denoiser's output `out` estimates in x_t, with
  // signal = sqrt(abar_t) and spread = sqrt(1 - abar_t): doubles (one timestep for the
  // batch) or tensors that broadcast against x (a timestep per sample).
  at::Tensor cleanEstimate(const at::Tensor& x, const at::Tensor& out, double signal, double spread) const;
  at::Tensor cleanEstimate(const at::Tensor& x, const at::Tensor& out, const at::Tensor& signal,
                           const at::Tensor& spread) const;
  at::Tensor noiseEstimate(const at::Tensor& x, const at::Tensor& out, double signal, double spread) const;
  // What the denoiser learns to output for the clean sample x0 noised by eps.
  at::Tensor target(const at::Tensor& x0, const at::Tensor& eps, const at::Tensor& signal,
                    const at::Tensor& spread) const;
  double signal(int64_t t) const;  // sqrt(abar_t)
  double spread(int64_t t) const;  // sqrt(1 - abar_t)
};

// Min-SNR-gamma's weight of a timestep's loss (Hang et al. 2023) for the output `prediction`
// at abar_t = `alphaBar`: the clean-sample error counts min(SNR, gamma) times, SNR = abar /
// (1 - abar). A velocity's squared error is (SNR + 1) times the clean sample's, a noise's
// SNR times, so the weights are min(SNR, gamma) / (SNR + 1) and min(SNR, gamma) / SNR
// (1 where SNR <= gamma, pure noise included).
double minSnrLossWeight(double alphaBar, Prediction prediction, double gamma);

class DenoiserBlock : public torch::nn::Module {
 public:
  DenoiserBlock(int64_t width, at::Device device);
  at::Tensor forward(const at::Tensor& h, const at::Tensor& timeEmbedding);

 private:
  layers::LayerNorm norm_{nullptr};
  layers::Linear timeProj_{nullptr}, fc1_{nullptr}, fc2_{nullptr};
};

// What the losses, the samplers and DMD need of a denoiser.
class Denoiser : public TrainModel {
 public:
  // sampleShape: one sample's shape (e.g. [2] for points, [C, H, W] for images);
  // classes: the labels it is conditioned on (0: unconditional).
  Denoiser(const ModelOptions& options, std::vector<int64_t> sampleShape, int64_t classes);

  // Noisy samples x_t [batch, sampleShape...] at timesteps t [batch] (int64) with labels
  // [batch] (int64 in [0, classes]; classes = "no class") -> the denoiser's output (the noise
  // or the velocity, schedule().prediction), same shape as x_t, in the compute dtype.
  virtual at::Tensor predict(const at::Tensor& noisy, const at::Tensor& timesteps, const at::Tensor& labels) = 0;
  // Per-sample loss of clean samples batch.inputs (one noise seed each; batch.targets:
  // their labels when the denoiser is conditional): the output's squared error against
  // schedule().target.
  at::Tensor losses(const datasets::Batch& batch) override;

  // DMD2's discriminator: the logit [N] (float32) that x_t at t with `labels` is a real
  // sample, from the GAN head (gan_head.*) on the output of block model.gan_head_block,
  // averaged over a DiT's tokens. Only a model made with a head (hasGanHead()).
  at::Tensor discriminate(const at::Tensor& noisy, const at::Tensor& timesteps, const at::Tensor& labels);
  bool hasGanHead() const { return !ganHead_.is_empty(); }
  int64_t ganHeadBlock() const { return options_.gan_head_block; }
  int64_t layers() const { return options_.layers; }
  const torch::nn::Sequential& ganHead() const { return ganHead_; }

  const NoiseSchedule& schedule() const { return schedule_; }
  const std::vector<int64_t>& sampleShape() const { return sampleShape_; }
  int64_t classes() const { return classes_; }
  // `count` "no class" labels on `device` (what an unconditional sample is asked with).
  at::Tensor noClassLabels(int64_t count, at::Device device) const;

 protected:
  // Registers the GAN head over features of `width` when model.gan_head_block >= 0 (the
  // subclass's constructor, last: its parameters come after the model's own).
  void addGanHead(int64_t width, at::Device device);
  // The output of block `block` for x_t at t with `labels`: [N, W] or [N, tokens, W].
  virtual at::Tensor blockOutput(const at::Tensor& noisy, const at::Tensor& timesteps, const at::Tensor& labels,
                                 int64_t block) = 0;

  ModelOptions options_;
  std::vector<int64_t> sampleShape_;
  int64_t features_;  // elements of one sample

 private:
  NoiseSchedule schedule_;
  int64_t classes_;
  // LayerNorm, Linear(W, W), SiLU, Linear(W, 1): gan_head.0, gan_head.1, gan_head.3.
  torch::nn::Sequential ganHead_{nullptr};
};

class DiffusionDenoiser : public Denoiser {
 public:
  DiffusionDenoiser(const ModelOptions& options, std::vector<int64_t> sampleShape, at::Device device = at::kCPU);

  // x_t [batch, sampleShape...], t [batch] -> the prediction (unconditional).
  at::Tensor forward(const at::Tensor& noisy, const at::Tensor& timesteps);
  at::Tensor predict(const at::Tensor& noisy, const at::Tensor& timesteps, const at::Tensor& labels) override {
    return forward(noisy, timesteps);
  }
  // Every linear sees each sample once.
  // Every linear sees each sample once (the GAN head's are not in a prediction).
  double forwardFlopsPerSample() const override {
    return layers::linearFlops(*this) - (hasGanHead() ? layers::linearFlops(*ganHead()) : 0.0);
  }

 protected:
  at::Tensor blockOutput(const at::Tensor& noisy, const at::Tensor& timesteps, const at::Tensor& labels,
                         int64_t block) override;

 private:
  at::Tensor timeEmbedding(const at::Tensor& timesteps) const;
  torch::nn::Sequential timeEmbed_{nullptr};
  layers::Linear inputProj_{nullptr}, outputProj_{nullptr};
  sharding::UnitList<DenoiserBlock> blocks_{nullptr};
  layers::LayerNorm outNorm_{nullptr};
};

// The denoiser's output with its root entered as a unit (zero3/hybrid gather the root's
// parameters there; a plain call under the other strategies). Undefined labels:
// "no class".
at::Tensor predictInUnits(Denoiser& model, const at::Tensor& noisy, const at::Tensor& timesteps,
                               const at::Tensor& labels = {});

// Denoiser::discriminate with the root entered as a unit (as predictInUnits).
at::Tensor discriminateInUnits(Denoiser& model, const at::Tensor& noisy, const at::Tensor& timesteps,
                               const at::Tensor& labels = {});

// A sampler's view of a denoiser: x_t, t -> its output to step with (float32; read through
// the schedule's cleanEstimate and noiseEstimate).
using PredictFunction = std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>;

// The timesteps [first, last] where guidance applies (Kynkaanniemi et al. 2024, "Applying
// guidance in a limited interval": at the noisiest steps it mostly removes diversity, at
// the cleanest it changes little). The default, [0, max], is every timestep.
struct GuidanceInterval {
  int64_t first = 0;
  int64_t last = std::numeric_limits<int64_t>::max();
  bool contains(int64_t t) const { return t >= first && t <= last; }
};

// The interval [interval[0], interval[1]] (checked by guidanceIntervalProblem); empty: every timestep.
GuidanceInterval makeGuidanceInterval(const std::vector<int64_t>& interval);

// Classifier-free guidance of `model` for `labels` [n] (undefined: unconditional) at scale
// `cfg`: e_u + cfg (e_c - e_u), e_u with the "no class" label, as two forwards (the
// conditional one alone when cfg is 1, the model is unconditional, or the timestep is
// outside `interval`). The samplers step every sample at one timestep: the first sample's
// decides for all.
PredictFunction guidedPrediction(Denoiser& model, const at::Tensor& labels, double cfg,
                                 GuidanceInterval interval = {});

// The same guidance where each sample has a timestep of its own, t [n] (DMD's real score at
// drawn noise levels): sample i is guided where `interval` contains t[i]. Both forwards
// always run, so that every rank makes the same collectives under zero3.
at::Tensor guidedPredictionPerSample(Denoiser& model, const at::Tensor& x, const at::Tensor& t, const at::Tensor& labels,
                                     double cfg, GuidanceInterval interval = {});

// DDPM ancestral sampling from the noise `noise` [n, sampleShape...]: the posterior mean
// of x_{t-1} given x_t and the estimate x0,
// sqrt(abar_{t-1}) beta_t / (1 - abar_t) x0 + sqrt(1 - beta_t) (1 - abar_{t-1}) / (1 - abar_t) x_t
// (for a noise prediction, (x_t - beta_t / sqrt(1 - abar_t) eps) / sqrt(1 - beta_t)), plus
// sqrt(beta_t) z, t = T-1 ... 0 (no z after t = 0), sample i's z drawn from a CPU generator seeded with
// stepSeeds[i]: a sample is the same whichever batch or rank draws it.
at::Tensor sampleDdpm(const NoiseSchedule& schedule, const at::Tensor& noise, const std::vector<uint64_t>& stepSeeds,
                      const PredictFunction& predict);

// DDIM's timesteps: round(linspace(T - 1, 0, steps)), rounding half to even in exact
// integer arithmetic (as numpy's round of the linspace); steps 1: just T - 1.
std::vector<int64_t> ddimTimesteps(int64_t timesteps, int64_t steps);

// Deterministic DDIM sampling (Song et al. 2021, eta = 0) from the noise `noise` [n,
// sampleShape...] in `steps` steps over ddimTimesteps: the estimates x0 (not clipped) and
// eps of the output at x_t (for a noise prediction x0 = (x_t - sqrt(1 - abar_t) eps) /
// sqrt(abar_t)), x_s = sqrt(abar_s) x0 + sqrt(1 - abar_s) eps for the next timestep s, and x0 itself
// after the last (abar = 1). The same noise gives the same sample: the teacher's noise ->
// sample pairs of DMD's regression loss.
at::Tensor sampleDdim(const NoiseSchedule& schedule, const at::Tensor& noise, int64_t steps,
                      const PredictFunction& predict);
// The same over the given timesteps (strictly decreasing, each in [0, T)): a distilled
// few-step generator's own (recipe.generator_timesteps).
at::Tensor sampleDdim(const NoiseSchedule& schedule, const at::Tensor& noise, const std::vector<int64_t>& timesteps,
                      const PredictFunction& predict);

// One of its steps: x at timestep t, with the denoiser's output `out` there, to timestep
// s < t (sqrt(abar_s) x0 + sqrt(1 - abar_s) eps).
at::Tensor sampleDdimStep(const NoiseSchedule& schedule, const at::Tensor& x, int64_t t, int64_t s,
                          const at::Tensor& out);

// Throws naming `what` unless `timesteps` is non-empty and fits the schedule
// (timestepsProblem).
void checkTimesteps(const NoiseSchedule& schedule, const std::vector<int64_t>& timesteps, const std::string& what);

// The standard normal noise of `count` samples of `sampleShape` from `seed` (CPU
// generator, float32): the same on every machine and rank.
at::Tensor samplingNoise(const std::vector<int64_t>& sampleShape, int64_t count, uint64_t seed);

}  // namespace tessera::models
