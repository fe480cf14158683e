// The diffusion generator: a denoiser over vectors or images (any per-sample shape,
// flattened), trained with DDPM's noise-prediction loss, and its ancestral sampler.
//
// Forward process (Ho et al. 2020): with a linear schedule beta_1..beta_T from
// model.beta_start to model.beta_end and abar_t = prod_{s<=t} (1 - beta_s), a clean
// sample x0 and noise eps ~ N(0, I) give x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps.
// The loss of a sample is mean((eps_theta(x_t, t) - eps)^2) for a uniform t.
// The timestep and noise of each sample come from Batch::noiseSeeds, so they depend on the
// run seed, the step and the sample only: sharded training sees the draws an unsharded
// run sees, and a resumed run the draws of an uninterrupted one.
//
// Denoiser (width W = model.embed_dim, model.layers blocks; names as the equivalent
// PyTorch modules):
//   time_embed   Sequential(Linear(W, W), SiLU, Linear(W, W)) over the sinusoidal
//                embedding of t: time_embed.0.*, time_embed.2.*
//   input_proj   Linear(D, W) of the flattened x_t (D features)
//   blocks.<i>   h + fc2(silu(fc1(norm(h) + time_proj(silu(temb))))), fc1: W -> 4W;
//                names blocks.<i>.norm, .time_proj, .fc1, .fc2. Each block is a unit
//                (sharding::Unit).
//   out_norm     LayerNorm(W), then output_proj Linear(W, D): the predicted noise.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "sharding/unit.h"
#include "trainer/models.h"

namespace tessera::trainer {

// The linear beta schedule and its cumulative products (double precision, CPU).
struct NoiseSchedule {
  NoiseSchedule(int64_t timesteps, double betaStart, double betaEnd);
  int64_t timesteps;
  std::vector<double> betas, alphaBars;
};

class DenoiserBlock : public torch::nn::Module {
 public:
  DenoiserBlock(int64_t width, at::Device device);
  at::Tensor forward(const at::Tensor& h, const at::Tensor& timeEmbedding);

 private:
  layers::LayerNorm norm_{nullptr};
  layers::Linear timeProj_{nullptr}, fc1_{nullptr}, fc2_{nullptr};
};

class DiffusionDenoiser : public TrainModel {
 public:
  // sampleShape: one sample's shape (e.g. [2] for points, [C, H, W] for images).
  DiffusionDenoiser(const ModelOptions& options, std::vector<int64_t> sampleShape, at::Device device = at::kCPU);

  // Noisy samples x_t [batch, sampleShape...] at timesteps t [batch] (int64) -> the noise
  // predicted in them, same shape as x_t.
  at::Tensor forward(const at::Tensor& noisy, const at::Tensor& timesteps);
  // Per-sample noise-prediction loss of clean samples batch.inputs (one noise seed each).
  at::Tensor losses(const Batch& batch) override;

  const NoiseSchedule& schedule() const { return schedule_; }
  const std::vector<int64_t>& sampleShape() const { return sampleShape_; }

 private:
  at::Tensor timeEmbedding(const at::Tensor& timesteps) const;
  ModelOptions options_;
  std::vector<int64_t> sampleShape_;
  int64_t features_;
  NoiseSchedule schedule_;
  torch::nn::Sequential timeEmbed_{nullptr};
  layers::Linear inputProj_{nullptr}, outputProj_{nullptr};
  sharding::UnitList<DenoiserBlock> blocks_{nullptr};
  layers::LayerNorm outNorm_{nullptr};
};

// The denoiser's noise prediction eps(x_t, t) with its root entered as a unit (zero3/hybrid
// gather the root's parameters there; a plain call under the other strategies).
at::Tensor predictNoiseInUnits(DiffusionDenoiser& model, const at::Tensor& noisy, const at::Tensor& timesteps);

// DDPM ancestral sampling of `count` samples from pure noise drawn with `seed`:
// x_{t-1} = (x_t - beta_t / sqrt(1 - abar_t) eps) / sqrt(1 - beta_t) + sqrt(beta_t) z.
// `predictNoise(x_t, t)` is the denoiser's forward (the trainer routes it through the
// sharding units). Returns [count, sampleShape...] on `device`.
at::Tensor sampleDdpm(const NoiseSchedule& schedule, const std::vector<int64_t>& sampleShape, int64_t count,
                      uint64_t seed, at::Device device,
                      const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& predictNoise);

// Deterministic DDIM sampling (Song et al. 2021, eta = 0) from the noise `noise` [n,
// sampleShape...] in `steps` steps over timesteps T-1 ... 0 evenly spaced:
// x0 = (x_t - sqrt(1 - abar_t) eps) / sqrt(abar_t), x_s = sqrt(abar_s) x0 + sqrt(1 - abar_s) eps
// for the next timestep s (x0 itself after t = 0). The same noise gives the same sample:
// the teacher's noise -> sample pairs of DMD's regression loss.
at::Tensor sampleDdim(const NoiseSchedule& schedule, const at::Tensor& noise, int64_t steps,
                      const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& predictNoise);

}  // namespace tessera::trainer
