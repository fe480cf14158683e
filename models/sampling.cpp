// Sampling requests, split over ranks, and sample grids (see sampling.h).
#include "models/sampling.h"

#include <c10/core/GradMode.h>

#include <numeric>

#include "common/errors.h"
#include "common/file_open.h"
#include "distributed/communicator.h"
#include "imaging/image_io.h"
#include "imaging/image_ops.h"

namespace tessera::models {

at::Tensor classRows(const std::vector<int64_t>& classes, int64_t perClass) {
  TESSERA_CHECK(perClass >= 1, "samples per class: ", perClass);
  std::vector<int64_t> labels;
  for (int64_t c : classes) labels.insert(labels.end(), static_cast<size_t>(perClass), c);
  return at::tensor(labels, at::kLong);
}

SampleRequest gridRequest(const Denoiser& model, int64_t perClass, int64_t runSeed) {
  SampleRequest request;
  std::vector<int64_t> classes(static_cast<size_t>(model.classes()));
  std::iota(classes.begin(), classes.end(), 0);
  if (!classes.empty()) request.labels = classRows(classes, perClass);
  const int64_t count = classes.empty() ? 8 * perClass : request.labels.size(0);
  request.noise = samplingNoise(model.sampleShape(), count, datasets::noiseSeed(runSeed, -5, 0));
  return request;
}

bool useOwnTimesteps(SampleRequest& request, const Denoiser& model, const std::vector<int64_t>& own,
                     const std::string& source) {
  if (own.empty()) return false;
  checkTimesteps(model.schedule(), own, source);
  request.timesteps = own;
  return true;
}

at::Tensor drawSamples(Denoiser& model, const SampleRequest& request, distributed::Communicator* comm,
                       at::Device device) {
  const at::Tensor& noise = request.noise;
  const int64_t n = noise.size(0);
  TESSERA_CHECK(noise.dim() >= 1 && noise.sizes().slice(1).equals(model.sampleShape()), "samples: noise ",
                noise.sizes(), " does not match the model's samples [N, ", at::IntArrayRef(model.sampleShape()), "]");
  TESSERA_CHECK(!request.labels.defined() || (request.labels.dim() == 1 && request.labels.size(0) == n), "samples: ",
                request.labels.defined() ? request.labels.numel() : 0, " labels for ", n, " noise rows");
  if (request.labels.defined() && n > 0) {
    const int64_t lo = request.labels.min().item<int64_t>(), hi = request.labels.max().item<int64_t>();
    TESSERA_CHECK(lo >= 0 && hi <= model.classes(), "samples: labels in [", lo, ", ", hi, "], the model knows ",
                  model.classes(), " classes (label ", model.classes(), ": no class, an unconditional sample)");
  }
  TESSERA_CHECK(request.sampler == "ddim" || request.sampler == "ddpm", "samples: unknown sampler '", request.sampler,
                "' (ddim, ddpm)");
  TESSERA_CHECK_AS(UsageError, request.timesteps.empty() || request.sampler == "ddim",
                   "samples: explicit timesteps are DDIM's; the ddpm sampler takes every timestep");
  const int ranks = comm != nullptr ? comm->worldSize() : 1, rank = comm != nullptr ? comm->rank() : 0;
  const bool split = ranks > 1 && n >= ranks;
  const int64_t begin = split ? n * rank / ranks : 0, end = split ? n * (rank + 1) / ranks : n;

  c10::NoGradGuard noGrad;
  const at::Tensor labels = request.labels.defined() ? request.labels.slice(0, begin, end).to(device) : at::Tensor();
  const PredictFunction predict = guidedPrediction(model, labels, request.cfg, request.cfgInterval);
  const at::Tensor start = noise.slice(0, begin, end).to(device);
  at::Tensor mine;
  if (request.sampler == "ddim") {
    mine = request.timesteps.empty() ? sampleDdim(model.schedule(), start, request.steps, predict)
                                     : sampleDdim(model.schedule(), start, request.timesteps, predict);
  } else {
    std::vector<uint64_t> seeds;
    for (int64_t i = begin; i < end; ++i) seeds.push_back(datasets::noiseSeed(request.seed, -4, i));
    mine = sampleDdpm(model.schedule(), start, seeds, predict);
  }
  if (!split) return mine.cpu();
  // Gathered by a sum of zero-padded rows: exact, and the communicator's own timeout.
  at::Tensor all = at::zeros(noise.sizes(), at::kFloat);
  all.slice(0, begin, end).copy_(mine.cpu());
  comm->allReduce(all, distributed::ReduceOp::kSum);
  return all;
}

observe::EncodedImage writeSampleGrid(const std::string& path, const at::Tensor& samples, int64_t perRow) {
  TESSERA_CHECK(samples.dim() == 4 && (samples.size(1) == 1 || samples.size(1) == 3), "sample grid '", path,
                "': needs images [N, 1 or 3, H, W], got samples ", samples.sizes());
  const int64_t side = std::max(samples.size(2), samples.size(3));
  const int64_t scale = side >= 64 ? 1 : (64 + side - 1) / side;  // small images enlarged to ~64 px
  const at::Tensor grid = imaging::imageGrid(samples.to(at::kFloat), perRow, /*padding=*/2, scale);  // [C, H, W]
  observe::EncodedImage image;
  image.png = imaging::encodePng(grid);
  image.channels = static_cast<int>(grid.size(0));
  image.height = static_cast<int>(grid.size(1));
  image.width = static_cast<int>(grid.size(2));
  replaceFile(path, image.png);
  return image;
}

}  // namespace tessera::models
