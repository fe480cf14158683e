// model.arch diffusion: the residual-MLP denoiser over tensors or images (its code is
// diffusion.cpp), and what every denoiser (diffusion, dit) reads and checks: the noise
// schedule, what it predicts, the loss weighting, the sampler's timesteps.
#include "common/errors.h"
#include "datasets/data_options.h"
#include "datasets/dataset.h"
#include "models/architecture.h"
#include "models/model_options.h"

namespace tessera::models {

std::shared_ptr<TrainModel> makeDiffusionDenoiser(const ModelOptions& options, const datasets::DataSpec& data,
                                                  c10::Device device);

std::vector<std::string> denoiserKeys() {
  return {"timesteps",      "beta_start",    "beta_end",         "noise_schedule", "zero_terminal_snr",
          "prediction",     "loss_weighting", "min_snr_gamma",   "sample_timesteps", "samples",
          "gan_head_block"};
}

void checkDenoiserOptions(const ModelOptions& m, const ArchitectureContext& context, std::vector<KeyProblem>& problems) {
  const std::string& p = context.keyPrefix;
  const std::string timesteps = timestepsProblem(m.sample_timesteps, m.timesteps);
  if (!timesteps.empty()) problems.push_back({"sample_timesteps", timesteps});
  if (m.noise_schedule == "cosine" && m.prediction != "v") {
    problems.push_back({"noise_schedule", strCat("cosine needs ", p, "prediction v, not ", m.prediction,
                                                 ": its last abar (2e-9) makes a noise prediction's clean estimate "
                                                 "multiply every error by 20000")});
  }
  if (m.zero_terminal_snr && m.timesteps < 2) {
    problems.push_back({"zero_terminal_snr", "needs model.timesteps >= 2 (the first timestep keeps its noise level, "
                                             "the last is pure noise)"});
  }
  if (m.zero_terminal_snr && m.prediction != "v") {
    problems.push_back({"zero_terminal_snr", strCat("needs ", p, "prediction v, not ", m.prediction,
                                                    ": at the last timestep the input is pure noise, and a noise "
                                                    "prediction says nothing about the clean sample there")});
  }
  if (m.gan_head_block >= m.layers) {
    problems.push_back({"gan_head_block", strCat(m.gan_head_block, " is not a block of the model (", p, "layers: ",
                                                 m.layers, ", counted from 0)")});
  }
  if (m.beta_start > m.beta_end) {
    problems.push_back({"beta_start", strCat(m.beta_start, " is above ", p, "beta_end (", m.beta_end, ")")});
  }
}

namespace {

std::vector<KeyProblem> checkDiffusion(const ModelOptions& m, const ArchitectureContext& context) {
  std::vector<KeyProblem> problems;
  if (context.dataKind != "tensors" && !datasets::isImageKind(context.dataKind)) {
    problems.push_back({"arch", strCat("diffusion needs data.kind tensors, idx, image_folder or webdataset, not ",
                                       context.dataKind)});
  }
  checkDenoiserOptions(m, context, problems);
  return problems;
}

std::string diffusionFileProblem(const ModelOptions& m, const datasets::DataSpec&, const FileShapes& file) {
  if (m.layers > file.tensors) return strCat("says layers ", m.layers, ", but the file holds only ", file.tensors, " tensors");
  return "";
}

std::vector<std::string> diffusionKeys() {
  std::vector<std::string> keys = {"embed_dim", "layers"};
  for (std::string& key : denoiserKeys()) keys.push_back(std::move(key));
  return keys;
}

}  // namespace

const ArchitectureSpec& diffusionArchitecture() {
  static const ArchitectureSpec spec{"diffusion",
                                     "a residual-MLP denoiser over tensors or images (unconditional)",
                                     "DiffusionDenoiser",
                                     /*denoiser=*/true,
                                     /*predictsEveryPosition=*/false,
                                     diffusionKeys(),
                                     checkDiffusion,
                                     /*resolve=*/nullptr,
                                     diffusionFileProblem,
                                     /*planned=*/nullptr,
                                     TESSERA_MODEL_FACTORY(makeDiffusionDenoiser)};
  return spec;
}

}  // namespace tessera::models
