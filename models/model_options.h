// A built-in model's options (model.* and models.<name>.model.*): its architecture and
// shape, bound to config keys by bindModelKeys() at the top level, in every models: entry
// and in an export's metadata, with the same docs and constraints everywhere.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tessera::config {
class ConfigSchema;
}
namespace tessera::datasets {
struct DataSpec;
}

namespace tessera::models {

struct ModelOptions {
  std::string arch = "mlp";             // an architecture's name (architecture.h): mlp | gpt | diffusion | dit
  int64_t vocab_size = 256;             // byte-level text: 256
  int64_t context = 16;                 // tokens of context the model sees
  int64_t embed_dim = 32;               // token embedding width
  std::vector<int64_t> hidden = {256, 256};  // hidden layer widths of the MLP
  std::string activation = "gelu";      // relu | gelu
  int64_t layers = 2;                   // gpt: decoder blocks
  int64_t heads = 4;                    // gpt: attention heads (divide embed_dim)
  bool tie_head = false;                // gpt: logits through wte.weight (no lm_head)
  int64_t timesteps = 1000;             // diffusion: noise levels T
  double beta_start = 1.0e-4;           // diffusion: linear beta schedule from beta_start ...
  double beta_end = 0.02;               // ... to beta_end
  std::string noise_schedule = "linear"; // diffusion: linear (beta_start..beta_end) | cosine (Nichol & Dhariwal)
  bool zero_terminal_snr = false;       // diffusion: rescale so that the last timestep is pure noise
  std::string prediction = "eps";       // diffusion: the denoiser outputs the noise (eps) or the velocity (v)
  std::string loss_weighting = "uniform"; // diffusion: each timestep's loss as it is, or min_snr (Hang et al. 2023)
  double min_snr_gamma = 5.0;           // diffusion: min_snr's clamp of the signal-to-noise ratio
  int64_t patch_size = 4;               // dit: patch side in pixels (divides the image size)
  double mlp_ratio = 4.0;               // dit: MLP width / embed_dim
  bool final_conv = false;              // dit: a 3x3 convolution over the unpatchified output (U-ViT's)
  int64_t patch_overlap = 0;            // dit: pixels each patch's output window reaches into its neighbours
  int64_t classes = 0;                  // dit: class labels (0: the data's; 0 with unlabelled data: unconditional)
  double class_dropout = 0.1;           // dit: probability a training label is replaced by "no class" (CFG)
  std::vector<int64_t> sample_timesteps; // denoisers: DDIM's timesteps when a sampler is not told the steps
                                        // (a distilled few-step generator's own); empty: 50 evenly spaced
  int64_t samples = 0;                  // diffusion: samples drawn with generator_ema at the end (0: none)
  int64_t gan_head_block = -1;          // denoisers: a GAN head reads this block's output (DMD2; -1: no head)
  std::optional<std::string> init_from; // safetensors file or *.index.json to start from (fresh runs)

  // A diffusion denoiser (diffusion, dit): trained to predict the noise or the velocity,
  // sampled, distilled (its architecture says so; false for a name that is none).
  bool isDenoiser() const;
};

// What is wrong with `timesteps` as DDIM's timesteps over a schedule of `scheduleSteps`
// noise levels (each in [0, scheduleSteps), strictly decreasing), or "" when nothing is:
// the one rule for model.sample_timesteps and the samplers' explicit timesteps.
std::string timestepsProblem(const std::vector<int64_t>& timesteps, int64_t scheduleSteps);
// What is wrong with `interval` as the timesteps [FIRST, LAST] where guidance applies
// (two of them, 0 <= FIRST <= LAST < scheduleSteps; empty: every timestep), or "".
std::string guidanceIntervalProblem(const std::vector<int64_t>& interval, int64_t scheduleSteps);
// " at t in [FIRST, LAST]" for a log line; "" for an empty interval (every timestep).
std::string guidanceIntervalText(const std::vector<int64_t>& interval);

// The keys of a model (arch and its shape) under `prefix`: at the top level ("model."), in
// every models: entry ("models.<name>.model."), and in an export's metadata ("", see
// model_metadata.h), with the same docs and constraints.
void bindModelKeys(config::ConfigSchema& schema, const std::string& prefix, ModelOptions& model);

// The names of the model keys (bindModelKeys' without a prefix: "arch", "embed_dim", ...).
const std::vector<std::string>& modelKeyNames();

// The labels a class-conditional model (dit) is conditioned on: model.classes, or the
// data's when it is 0 (0 for unlabelled data: unconditional). ConfigError when
// model.classes is below the data's.
int64_t conditioningClasses(const ModelOptions& options, const datasets::DataSpec& data);

}  // namespace tessera::models
