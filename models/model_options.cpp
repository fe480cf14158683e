// model.*: the keys of a built-in model and the rule for DDIM timesteps (model_options.h).
#include "models/model_options.h"

#include "common/config.h"
#include "common/errors.h"
#include "common/limits.h"
#include "datasets/dataset.h"
#include "models/architecture.h"

namespace tessera::models {

std::string timestepsProblem(const std::vector<int64_t>& timesteps, int64_t scheduleSteps) {
  for (size_t k = 0; k < timesteps.size(); ++k) {
    if (timesteps[k] < 0 || timesteps[k] >= scheduleSteps) {
      return strCat("timestep ", timesteps[k], " is outside the schedule's [0, ", scheduleSteps - 1, "]");
    }
    if (k > 0 && timesteps[k] >= timesteps[k - 1]) {
      return strCat("timesteps must decrease (", timesteps[k - 1], " then ", timesteps[k], ")");
    }
  }
  return "";
}

std::string guidanceIntervalProblem(const std::vector<int64_t>& interval, int64_t scheduleSteps) {
  if (interval.empty()) return "";
  if (interval.size() != 2 || interval[0] < 0 || interval[0] > interval[1] || interval[1] >= scheduleSteps) {
    std::string given;
    for (size_t k = 0; k < interval.size(); ++k) given += (k > 0 ? "," : "") + std::to_string(interval[k]);
    return strCat("[", given, "] is not FIRST,LAST with 0 <= FIRST <= LAST <= ", scheduleSteps - 1,
                  " (the schedule's timesteps)");
  }
  return "";
}

std::string guidanceIntervalText(const std::vector<int64_t>& interval) {
  return interval.size() == 2 ? strCat(" at t in [", interval[0], ", ", interval[1], "]") : "";
}

bool ModelOptions::isDenoiser() const {
  const ArchitectureSpec* spec = findArchitecture(arch);
  return spec != nullptr && spec->denoiser;
}

void bindModelKeys(config::ConfigSchema& s, const std::string& p, ModelOptions& m) {
  std::string doc = "Model architecture:";
  std::vector<std::string> names;
  for (const ArchitectureSpec* spec : architectures()) {
    doc += strCat(names.empty() ? " " : "; ", spec->name, " (", spec->description, ")");
    names.push_back(spec->name);
  }
  s.add(p + "arch", &m.arch, doc).oneOf(names);
  s.add(p + "vocab_size", &m.vocab_size, "Vocabulary size (256 for byte-level text)").min(2).max(kMaxVocab);
  s.add(p + "context", &m.context, "Context length in tokens").min(1).max(kMaxWidth);
  s.add(p + "embed_dim", &m.embed_dim, "Token embedding width; diffusion: the denoiser's width").min(1).max(kMaxWidth);
  s.add(p + "hidden", &m.hidden, "Hidden layer widths of the MLP").min(1).max(kMaxWidth).nonEmpty();
  s.add(p + "activation", &m.activation, "Activation between MLP layers").oneOf({"relu", "gelu"});
  s.add(p + "layers", &m.layers, "gpt: decoder blocks; diffusion: denoiser blocks").min(1).max(kMaxLayers);
  s.add(p + "heads", &m.heads, "gpt: attention heads; must divide model.embed_dim").min(1).max(kMaxWidth);
  s.add(p + "tie_head", &m.tie_head, "gpt: compute the logits with wte.weight instead of an lm_head");
  s.add(p + "timesteps", &m.timesteps, "diffusion: noise levels T of the forward process").min(1).max(kMaxWidth);
  s.add(p + "beta_start", &m.beta_start, "diffusion: first beta of the linear noise schedule")
      .greaterThan(0.0).lessThan(1.0);
  s.add(p + "beta_end", &m.beta_end, "diffusion: last beta of the linear noise schedule")
      .greaterThan(0.0).lessThan(1.0);
  s.add(p + "noise_schedule", &m.noise_schedule,
        "diffusion: the betas: linear (from beta_start to beta_end, DDPM's) or cosine (Nichol & Dhariwal 2021: "
        "abar follows cos^2; beta_start and beta_end unused)")
      .oneOf({"linear", "cosine"});
  s.add(p + "zero_terminal_snr", &m.zero_terminal_snr,
        "diffusion: rescale the schedule so that its last timestep is pure noise (abar = 0, Lin et al. 2024), where "
        "samplers and one-step generators start; needs prediction v");
  s.add(p + "prediction", &m.prediction,
        "diffusion: what the denoiser outputs: eps (the noise) or v (the velocity sqrt(abar) eps - sqrt(1 - abar) "
        "x0, Salimans & Ho 2022); exports without it are eps")
      .oneOf({"eps", "v"});
  s.add(p + "loss_weighting", &m.loss_weighting,
        "diffusion: how each timestep's loss counts in training: uniform (the squared error of the output as it is) "
        "or min_snr (Hang et al. 2023: weighted so that the clean-sample error counts min(SNR, min_snr_gamma) "
        "times, which keeps the near-clean timesteps from dominating the gradient)")
      .oneOf({"uniform", "min_snr"});
  s.add(p + "min_snr_gamma", &m.min_snr_gamma, "diffusion: the SNR at which loss_weighting min_snr clamps")
      .greaterThan(0.0).max(1e6);
  s.add(p + "patch_size", &m.patch_size, "dit: patch side in pixels (divides the image size)").min(1).max(kMaxWidth);
  s.add(p + "mlp_ratio", &m.mlp_ratio, "dit: width of each block's MLP over model.embed_dim").greaterThan(0.0).max(64.0);
  s.add(p + "final_conv", &m.final_conv,
        "dit: add a 3x3 convolution (zero-initialised, residual) over the unpatchified output, as U-ViT does, so that "
        "neighbouring patches' pixels inform each other: it smooths the seams between patches");
  s.add(p + "patch_overlap", &m.patch_overlap,
        "dit: pixels by which each patch's output window reaches into its neighbours on every side (0: none); the "
        "final linear predicts (patch_size + 2 overlap)^2 pixels per patch and overlapping windows are blended with "
        "weights that fall linearly to their edges, so that no seam is left between patches. At most "
        "model.patch_size / 2")
      .min(0).max(kMaxWidth);
  s.add(p + "classes", &m.classes,
        "dit: class labels the model is conditioned on (0: the data's classes; unconditional without labels)")
      .min(0).max(1 << 20);
  s.add(p + "class_dropout", &m.class_dropout,
        "dit: probability a training label is replaced by the 'no class' label (classifier-free guidance)")
      .min(0.0).lessThan(1.0);
  s.add(p + "sample_timesteps", &m.sample_timesteps,
        "diffusion, dit: the timesteps DDIM samples at when not told the steps (decreasing, each below "
        "model.timesteps; empty: 50 evenly spaced); in run.recipe dmd, the generator's own steps")
      .min(0).max(kMaxWidth);
  s.add(p + "gan_head_block", &m.gan_head_block,
        "diffusion, dit: a GAN classification head (gan_head.*) reads the output of this block and tells real "
        "samples from generated ones (DMD2's discriminator on the critic's features; run.recipe dmd sets it on its "
        "critic from recipe.gan_block); -1: no head")
      .min(-1).max(kMaxWidth);
  s.add(p + "init_from", &m.init_from,
        "Safetensors file or sharded export (*.index.json) to start the model from (fresh runs; each rank reads "
        "its rows)");
}

const std::vector<std::string>& modelKeyNames() {
  static const std::vector<std::string> names = [] {
    config::ConfigSchema schema;
    ModelOptions unused;
    bindModelKeys(schema, "", unused);
    std::vector<std::string> out;
    for (const auto& field : schema.fields()) out.push_back(field.path);
    return out;
  }();
  return names;
}

int64_t conditioningClasses(const ModelOptions& options, const datasets::DataSpec& data) {
  if (options.classes == 0) return data.classes;
  TESSERA_CHECK_AS(ConfigError, options.classes >= data.classes, "model.classes ", options.classes,
                   " is below the data's ", data.classes, " classes (labels up to ", data.classes - 1, ")");
  return options.classes;
}

}  // namespace tessera::models
