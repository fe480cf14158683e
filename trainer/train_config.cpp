// Binds TrainConfig's fields to YAML keys (docs and constraints live here, next to
// the key they describe) and loads a run config with overrides.
#include "trainer/train_config.h"

#include <algorithm>

#include "common/config.h"
#include "common/errors.h"
#include "common/limits.h"
#include "ema/profile_names.h"

namespace tessera::trainer {

namespace {

// Upper bounds of the sizes a config may ask for. Far above any run this code can do, and
// low enough that the products the trainer forms from two of them (context x embed_dim,
// micro_batch x world size, bucket bytes) stay far from int64 overflow: a product that
// wrapped would pass a divisibility check, divide by zero or allocate a negative size.
constexpr double kMaxSteps = double(int64_t{1} << 40);
constexpr double kMaxVocab = double(int64_t{1} << 31);
constexpr double kMaxWidth = double(int64_t{1} << 24);
constexpr double kMaxLayers = 1 << 16;
constexpr double kMaxBatch = double(int64_t{1} << 31);
constexpr double kMaxBucketMiB = 1 << 20;  // 1 TiB

}  // namespace

void bindTrainConfig(config::ConfigSchema& s, TrainConfig& c) {
  s.describeSection("run", "Identity, length and seed of the run");
  s.add("run.name", &c.run.name, "Run name, shown in the log and on the loss curve").nonEmpty();
  s.add("run.dir", &c.run.dir, "Run directory: resolved config, metrics, logs, checkpoints, exports").nonEmpty();
  s.add("run.seed", &c.run.seed, "Seed for model init, data order and dropout").min(0);
  s.add("run.steps", &c.run.steps, "Optimizer steps to run").min(1).max(kMaxSteps);
  s.add("run.log_every", &c.run.log_every, "Print and record metrics every N steps").min(1);
  s.add("run.stop_after_steps", &c.run.stop_after_steps,
        "Stop with a checkpoint after this many steps of this invocation (time-limited jobs); 0 = run to the end")
      .min(0);
  s.add("run.eval_every", &c.run.eval_every, "Held-out loss with live and EMA weights every N steps (0: at the end only)")
      .min(0);
  s.add("run.device", &c.run.device, "Where the model trains: cpu, or cuda (each rank's GPU: LOCAL_RANK modulo the GPUs)")
      .oneOf({"cpu", "cuda"});

  s.describeSection("log", "Logging");
  s.add("log.level", &c.log.level, "Log level; the TESSERA_LOG_LEVEL environment variable overrides it")
      .oneOf({"trace", "debug", "info", "warn", "error", "off"});
  s.add("log.per_rank_files", &c.log.per_rank_files, "Also write <run.dir>/logs/rank_N.log per rank");

  s.describeSection("model", "The model to train");
  s.add("model.arch", &c.model.arch,
        "Model architecture: mlp (token windows or tensors), gpt (tokens), diffusion (a denoiser over tensors)")
      .oneOf({"mlp", "gpt", "diffusion"});
  s.add("model.vocab_size", &c.model.vocab_size, "Vocabulary size (256 for byte-level text)").min(2).max(kMaxVocab);
  s.add("model.context", &c.model.context, "Context length in tokens").min(1).max(kMaxWidth);
  s.add("model.embed_dim", &c.model.embed_dim, "Token embedding width; diffusion: the denoiser's width").min(1).max(kMaxWidth);
  s.add("model.hidden", &c.model.hidden, "Hidden layer widths of the MLP").min(1).max(kMaxWidth).nonEmpty();
  s.add("model.activation", &c.model.activation, "Activation between MLP layers").oneOf({"relu", "gelu"});
  s.add("model.layers", &c.model.layers, "gpt: decoder blocks; diffusion: denoiser blocks").min(1).max(kMaxLayers);
  s.add("model.heads", &c.model.heads, "gpt: attention heads; must divide model.embed_dim").min(1).max(kMaxWidth);
  s.add("model.tie_head", &c.model.tie_head, "gpt: compute the logits with wte.weight instead of an lm_head");
  s.add("model.timesteps", &c.model.timesteps, "diffusion: noise levels T of the forward process").min(1).max(kMaxWidth);
  s.add("model.beta_start", &c.model.beta_start, "diffusion: first beta of the linear noise schedule")
      .greaterThan(0.0).lessThan(1.0);
  s.add("model.beta_end", &c.model.beta_end, "diffusion: last beta of the linear noise schedule")
      .greaterThan(0.0).lessThan(1.0);
  s.add("model.init_from", &c.model.init_from,
        "Safetensors file or sharded export (*.index.json) to start the model from (fresh runs; each rank reads "
        "its rows)");
  s.add("model.samples", &c.model.samples,
        "diffusion: samples drawn with generator_ema (DDPM) at the end, written to <run.dir>/samples.safetensors")
      .min(0).max(kMaxBatch);

  s.describeSection("data", "Training data");
  s.add("data.kind", &c.data.kind,
        "Dataset kind: text (bytes), tokens (flat binary token ids) or tensors (safetensors 'inputs' and 'targets')")
      .oneOf({"text", "tokens", "tensors"});
  s.add("data.path", &c.data.path,
        "Input file (text: any file, read as bytes; tokens: little-endian ids; tensors: a safetensors file with "
        "'inputs' [N, ...] and optional 'targets': integer class ids [N] for cross-entropy, floats for "
        "mean-squared error)")
      .required()
      .nonEmpty();
  s.add("data.token_dtype", &c.data.token_dtype, "tokens: width of each id in the file").oneOf({"uint16", "uint32"});
  s.add("data.global_batch", &c.data.global_batch, "Samples per optimizer step over all ranks").min(1).max(kMaxBatch);
  s.add("data.micro_batch", &c.data.micro_batch, "Samples per forward/backward on one rank").min(1).max(kMaxBatch);
  s.add("data.shuffle", &c.data.shuffle, "Seeded shuffle per epoch; false reads samples in file order");
  s.add("data.eval_fraction", &c.data.eval_fraction, "Fraction at the end of the file held out for evaluation")
      .min(0.0).lessThan(1.0);

  s.describeSection("optim", "Optimizer");
  s.add("optim.name", &c.optim.name, "Optimizer").oneOf({"adamw", "adam", "sgd"});
  s.add("optim.lr", &c.optim.lr, "Learning rate").greaterThan(0.0);
  s.add("optim.betas", &c.optim.betas, "Adam betas (beta1, beta2)").min(0.0).lessThan(1.0).size(2);
  s.add("optim.eps", &c.optim.eps, "Adam epsilon").greaterThan(0.0);
  s.add("optim.weight_decay", &c.optim.weight_decay, "Weight decay (decoupled for adamw)").min(0.0);
  s.add("optim.momentum", &c.optim.momentum, "SGD momentum").min(0.0).lessThan(1.0);
  s.add("optim.nesterov", &c.optim.nesterov, "SGD Nesterov momentum (needs momentum > 0)");
  s.add("optim.grad_clip", &c.optim.grad_clip, "Clip gradients to this global L2 norm; 0 = off").min(0.0);
  s.add("optim.schedule.kind", &c.optim.schedule.kind, "LR schedule").oneOf({"constant", "cosine", "linear", "step"});
  s.add("optim.schedule.warmup_steps", &c.optim.schedule.warmup_steps, "Linear warmup steps").min(0);
  s.add("optim.schedule.min_lr", &c.optim.schedule.min_lr, "Floor of cosine and linear decay").min(0.0);
  s.add("optim.schedule.step_size", &c.optim.schedule.step_size, "Step decay: period in steps").min(1);
  s.add("optim.schedule.gamma", &c.optim.schedule.gamma, "Step decay: factor per period").greaterThan(0.0).max(1.0);

  s.describeSection("sharding", "How training state is split over the ranks");
  s.add("sharding.strategy", &c.sharding.strategy, "Data-parallel strategy")
      .oneOf({"no_shard", "zero1", "zero2", "zero3", "hybrid"});
  s.add("sharding.bucket_mb", &c.sharding.bucket_mb, "Gradient bucket size in MiB (fewer, larger messages)")
      .greaterThan(0.0).max(kMaxBucketMiB);
  s.add("sharding.param_dtype", &c.sharding.param_dtype, "Compute dtype of the parameters (masters stay fp32)")
      .oneOf({"fp32", "bf16", "fp16"});
  s.add("sharding.reduce_dtype", &c.sharding.reduce_dtype, "Dtype gradients are reduced in").oneOf({"fp32", "bf16", "fp16"});
  s.add("sharding.buffer_sync", &c.sharding.buffer_sync, "How module buffers stay equal across ranks")
      .oneOf({"broadcast", "average", "none"});
  s.add("sharding.reshard_after_forward", &c.sharding.reshard_after_forward,
        "zero3/hybrid: free each unit's parameters after its forward and gather again in backward");
  s.add("sharding.prefetch", &c.sharding.prefetch, "zero3/hybrid: units gathered ahead of use (0 = off)").min(0).max(16);
  s.add("sharding.activation_checkpointing", &c.sharding.activation_checkpointing,
        "zero3/hybrid: recompute each block's forward in backward instead of keeping activations");
  s.add("sharding.reduce_every_micro_batch", &c.sharding.reduce_every_micro_batch,
        "With gradient accumulation: reduce every micro-batch's gradients during its backward (false: keep full "
        "gradients, reduce once at the last micro-batch)");
  s.add("sharding.shard_size", &c.sharding.shard_size,
        "hybrid: ranks per shard group, dividing the world size (0 = all ranks)").min(0).max(kMaxWorldSize);
  s.add("sharding.min_unit_params", &c.sharding.min_unit_params,
        "zero3/hybrid: wrapped modules with fewer parameters stay part of their parent unit (0 = all units)")
      .min(0);
  s.add("sharding.wrap", &c.sharding.wrap,
        "zero3/hybrid: submodules that become units, by name ('layers.*' = each child of layers); "
        "empty = the model's blocks");

  s.describeSection("ema", "Exponential moving average of the parameters (generator_ema)");
  s.add("ema.enabled", &c.ema.enabled, "Keep an EMA of the parameters");
  s.add("ema.decays", &c.ema.decays, "EMA decays; the first is generator_ema, each also generator_ema_<decay>")
      .min(0.0).lessThan(1.0).nonEmpty();
  s.add("ema.dtype", &c.ema.dtype, "EMA dtype").oneOf({"fp32", "bf16"});
  s.add("ema.start_step", &c.ema.start_step, "Steps before this copy the parameters instead of averaging").min(0);
  s.add("ema.update_every", &c.ema.update_every, "Update every k steps with decay^k").min(1);
  s.add("ema.warmup", &c.ema.warmup, "Warmup: decay = min(decay, 1 - (1 + k/inv_gamma)^-power)");
  s.add("ema.inv_gamma", &c.ema.inv_gamma, "Warmup inv_gamma").greaterThan(0.0);
  s.add("ema.power", &c.ema.power, "Warmup power").greaterThan(0.0);
  s.add("ema.buffers", &c.ema.buffers, "Buffers (e.g. BatchNorm statistics): copied or averaged").oneOf({"copy", "average"});

  s.add("ema.init_from", &c.ema.init_from,
        "Safetensors file or sharded export (e.g. an exported generator_ema) to start every EMA from; "
        "default: the model's start");
  s.add("ema.posthoc.stds", &c.ema.posthoc.stds,
        "Post-hoc EMA: sigma_rel of the power-function profiles to track (e.g. [0.05, 0.10]; empty: off); "
        "reconstruct any sigma_rel afterwards with tessera-export --posthoc-ema (docs/ema.md)")
      .greaterThan(0.0).lessThan(0.28);
  s.add("ema.posthoc.snapshot_every", &c.ema.posthoc.snapshot_every,
        "Post-hoc EMA: steps between snapshots of the profiles in <run.dir>/posthoc/ (kept whatever "
        "checkpoint.keep_last says)").min(0);
  s.describeSection("checkpoint", "Sharded checkpoints, resume and export");
  s.add("checkpoint.every_steps", &c.checkpoint.every_steps, "Save every N steps (0: only at the end)").min(0);
  s.add("checkpoint.at_end", &c.checkpoint.at_end, "Save when the run ends or is preempted (SIGTERM)");
  s.add("checkpoint.keep_last", &c.checkpoint.keep_last, "Newest complete checkpoints to keep (0: all)").min(0);
  s.add("checkpoint.async", &c.checkpoint.async, "Write checkpoints in a background thread");
  s.add("checkpoint.resume", &c.checkpoint.resume, "auto (latest complete checkpoint of run.dir), none, or a directory")
      .nonEmpty();
  s.add("checkpoint.export", &c.checkpoint.export_what,
        "Exported as <run.dir>/export/<name>.safetensors at the end: generator_ema, generator_ema_<decay>, model");
  s.add("checkpoint.export_dtype", &c.checkpoint.export_dtype, "Dtype of exported floating tensors")
      .oneOf({"fp32", "bf16", "fp16"});
}

namespace {

// checkpoint.export names what the run has: "model" or one of its EMA profiles, by either
// of its names. Checked before training, not when the exports are written at the end.
void checkExportNames(const config::ConfigSchema& s, const TrainConfig& c) {
  std::vector<std::string> known = {"model"};
  if (c.ema.enabled) {
    for (const auto& n : ema::emaProfileNames(ema::kDefaultEmaPrefix, c.ema.decays, c.ema.posthoc.stds)) {
      known.push_back(n.state);
      if (n.alias != n.state) known.push_back(n.alias);
    }
  }
  for (const auto& what : c.checkpoint.export_what) {
    if (std::find(known.begin(), known.end(), what) != known.end()) continue;
    std::string list;
    for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
    const char* why = what.rfind(ema::kDefaultEmaPrefix, 0) == 0 && !c.ema.enabled ? " (ema.enabled is false)" : "";
    throw ConfigError(s.errorMessage("checkpoint.export", strCat("'", what, "' is not something this run has", why,
                                                                 "; it can export: ", list)));
  }
}

}  // namespace

void validateTrainConfig(const config::ConfigSchema& s, const TrainConfig& c, int worldSize) {
  TESSERA_CHECK(worldSize >= 1, "validateTrainConfig: world size ", worldSize);
  if (boundedProduct(c.run.steps, c.data.global_batch, kMaxCounter) < 0) {
    throw ConfigError(s.errorMessage("run.steps", strCat(c.run.steps, " steps of data.global_batch ", c.data.global_batch,
                                                         " samples are more than the ", kMaxCounter,
                                                         " samples a run can count")));
  }
  if (c.optim.nesterov && c.optim.momentum <= 0) {
    throw ConfigError(s.errorMessage("optim.nesterov", "needs optim.momentum > 0"));
  }
  if ((c.optim.schedule.kind == "cosine" || c.optim.schedule.kind == "linear") &&
      c.optim.schedule.warmup_steps >= c.run.steps) {
    throw ConfigError(s.errorMessage("optim.schedule.warmup_steps",
                                     strCat(c.optim.schedule.warmup_steps, " must be below run.steps (", c.run.steps, ")")));
  }
  if (c.optim.schedule.min_lr > c.optim.lr) {
    throw ConfigError(s.errorMessage("optim.schedule.min_lr", strCat(c.optim.schedule.min_lr, " is above optim.lr (", c.optim.lr, ")")));
  }
  checkExportNames(s, c);
  if (c.sharding.bucket_mb * 1024 * 1024 < 1) {
    throw ConfigError(s.errorMessage("sharding.bucket_mb", strCat(c.sharding.bucket_mb, " MiB is less than one byte")));
  }
  if (!c.ema.posthoc.stds.empty() && !c.ema.enabled) {
    throw ConfigError(s.errorMessage("ema.posthoc.stds", "tracks power-function EMA profiles: needs ema.enabled"));
  }
  if (!c.ema.posthoc.stds.empty() && c.ema.posthoc.snapshot_every <= 0) {
    throw ConfigError(s.errorMessage("ema.posthoc.snapshot_every",
                                     "must be > 0 when ema.posthoc.stds is set (the snapshots are what is reconstructed)"));
  }
  if (c.sharding.strategy == "hybrid" && c.sharding.shard_size > 0 && worldSize % c.sharding.shard_size != 0) {
    throw ConfigError(s.errorMessage("sharding.shard_size", strCat(c.sharding.shard_size, " does not divide the world size (",
                                                                   worldSize, ")")));
  }
  if (c.model.arch == "gpt" && c.model.embed_dim % c.model.heads != 0) {
    throw ConfigError(s.errorMessage("model.heads", strCat(c.model.heads, " does not divide model.embed_dim (",
                                                            c.model.embed_dim, ")")));
  }
  if (c.model.arch == "gpt" && c.data.kind == "tensors") {
    throw ConfigError(s.errorMessage("model.arch", "gpt needs token data (data.kind text or tokens), not tensors"));
  }
  if (c.model.arch == "diffusion" && c.data.kind != "tensors") {
    throw ConfigError(s.errorMessage("model.arch", strCat("diffusion needs data.kind tensors, not ", c.data.kind)));
  }
  if (c.model.arch == "diffusion" && c.model.beta_start > c.model.beta_end) {
    throw ConfigError(s.errorMessage("model.beta_start", strCat(c.model.beta_start, " is above model.beta_end (",
                                                                 c.model.beta_end, ")")));
  }
  if (c.model.samples > 0 && (c.model.arch != "diffusion" || !c.ema.enabled)) {
    throw ConfigError(s.errorMessage("model.samples", "draws samples with generator_ema: needs model.arch diffusion "
                                                      "and ema.enabled"));
  }
  // Products of bounded keys, still checked: a world size comes from outside the config.
  const int64_t perStep = boundedProduct(c.data.micro_batch, worldSize, c.data.global_batch);
  if (perStep <= 0 || c.data.global_batch % perStep != 0) {
    throw ConfigError(s.errorMessage(
        "data.global_batch",
        strCat(c.data.global_batch, " is not a multiple of data.micro_batch (", c.data.micro_batch,
               ") x world size (", worldSize, ")")));
  }
}

LoadedConfig loadTrainConfig(const std::string& file, const std::vector<std::string>& overrides, int worldSize) {
  LoadedConfig out;
  config::ConfigSchema schema;
  bindTrainConfig(schema, out.config);
  if (!file.empty()) schema.loadFile(file);
  for (const auto& o : overrides) schema.applyOverride(o);
  schema.checkRequired();
  validateTrainConfig(schema, out.config, worldSize);
  out.resolvedYaml = schema.toYaml();
  return out;
}

}  // namespace tessera::trainer
