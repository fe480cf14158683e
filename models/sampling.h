// Drawing samples from a denoiser as users ask for them — classes, guidance scale, DDIM or
// DDPM, fixed noise — split over the ranks and gathered, and the picture of them: a PNG
// grid with one row per class. tessera-sample and the training run's sample grids
// (eval.sample_every) both go through here.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "observe/tensorboard_writer.h"
#include "models/diffusion.h"

namespace tessera::distributed {
class Communicator;
}

namespace tessera::models {

struct SampleRequest {
  at::Tensor noise;             // [N, sampleShape...] float32: where each sample starts
  at::Tensor labels;            // [N] int64 classes (= classes: "no class"), or undefined: unconditional
  std::string sampler = "ddim"; // ddim (deterministic) | ddpm
  int64_t steps = 50;           // ddim: denoising steps, evenly spaced (ddimTimesteps) ...
  std::vector<int64_t> timesteps; // ... or these (decreasing; a few-step generator's own)
  double cfg = 1.0;             // classifier-free guidance scale (1: the conditional model alone)
  GuidanceInterval cfgInterval; // the timesteps where cfg applies (default: all)
  int64_t seed = 0;             // ddpm: sample i's step noise comes from noiseSeed(seed, -4, i)
};

// `perClass` labels of each class in `classes`, class by class: a grid's rows.
at::Tensor classRows(const std::vector<int64_t>& classes, int64_t perClass);

// What a run's sample grids show: `perClass` samples of every class of `model` (an
// unconditional model: 8 rows of them), class by class, from noise fixed by `runSeed`, so
// that one grid after another shows the same samples getting better.
SampleRequest gridRequest(const Denoiser& model, int64_t perClass, int64_t runSeed);

// A request that names neither steps nor timesteps, for a model that carries its own (a
// distilled generator's model.sample_timesteps, `own`, read from `source`): samples at
// them, checked against the model's schedule (an error names `source`). Returns whether
// it does (false: `own` is empty, the request keeps its steps). tessera-sample and the
// post-hoc sweep sample a distilled export as it was trained through here.
bool useOwnTimesteps(SampleRequest& request, const Denoiser& model, const std::vector<int64_t>& own,
                     const std::string& source);

// The request's samples, the final iterates before any clamping ([N, sampleShape...]
// float32, CPU, on every rank). With a communicator of several ranks and N >= ranks, rank
// r draws rows [r N / ranks, (r + 1) N / ranks) and the rows are gathered (a sample does
// not depend on which rank draws it); with fewer samples than ranks every rank draws them
// all, so that a sharded model's ranks run the same forwards. Collective over `comm`.
at::Tensor drawSamples(Denoiser& model, const SampleRequest& request, distributed::Communicator* comm,
                       at::Device device);

// Writes `samples` [N, C, H, W] (pixels in [-1, 1]) as a PNG grid of `perRow` per row,
// enlarged so that a small image stays visible. Returns the PNG written and its size.
observe::EncodedImage writeSampleGrid(const std::string& path, const at::Tensor& samples, int64_t perRow);

}  // namespace tessera::models
