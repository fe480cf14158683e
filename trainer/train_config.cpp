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

namespace {

// The keys of a model, its sharding, its optimizer and its EMA, bound under prefixes: at
// the top level ("model.", "sharding.", ...) and in every models: entry ("models.<name>.",
// "models.<name>.sharding.", ...), with the same docs and constraints.
void bindModelKeys(config::ConfigSchema& s, const std::string& p, ModelOptions& m) {
  s.add(p + "arch", &m.arch,
        "Model architecture: mlp (token windows or tensors), gpt (tokens), diffusion (a denoiser over tensors)")
      .oneOf({"mlp", "gpt", "diffusion"});
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
  s.add(p + "init_from", &m.init_from,
        "Safetensors file or sharded export (*.index.json) to start the model from (fresh runs; each rank reads "
        "its rows)");
}

void bindOptimKeys(config::ConfigSchema& s, const std::string& p, OptimOptions& o) {
  s.add(p + "name", &o.name, "Optimizer").oneOf({"adamw", "adam", "sgd"});
  s.add(p + "lr", &o.lr, "Learning rate").greaterThan(0.0);
  s.add(p + "betas", &o.betas, "Adam betas (beta1, beta2)").min(0.0).lessThan(1.0).size(2);
  s.add(p + "eps", &o.eps, "Adam epsilon").greaterThan(0.0);
  s.add(p + "weight_decay", &o.weight_decay, "Weight decay (decoupled for adamw)").min(0.0);
  s.add(p + "momentum", &o.momentum, "SGD momentum").min(0.0).lessThan(1.0);
  s.add(p + "nesterov", &o.nesterov, "SGD Nesterov momentum (needs momentum > 0)");
  s.add(p + "grad_clip", &o.grad_clip, "Clip gradients to this global L2 norm; 0 = off").min(0.0);
  s.add(p + "schedule.kind", &o.schedule.kind, "LR schedule").oneOf({"constant", "cosine", "linear", "step"});
  s.add(p + "schedule.warmup_steps", &o.schedule.warmup_steps, "Linear warmup steps").min(0);
  s.add(p + "schedule.min_lr", &o.schedule.min_lr, "Floor of cosine and linear decay").min(0.0);
  s.add(p + "schedule.step_size", &o.schedule.step_size, "Step decay: period in steps").min(1);
  s.add(p + "schedule.gamma", &o.schedule.gamma, "Step decay: factor per period").greaterThan(0.0).max(1.0);
}

void bindShardingKeys(config::ConfigSchema& s, const std::string& p, ShardingOptions& sh) {
  s.add(p + "strategy", &sh.strategy, "Data-parallel strategy")
      .oneOf({"no_shard", "zero1", "zero2", "zero3", "hybrid"});
  s.add(p + "bucket_mb", &sh.bucket_mb, "Gradient bucket size in MiB (fewer, larger messages)")
      .greaterThan(0.0).max(kMaxBucketMiB);
  s.add(p + "param_dtype", &sh.param_dtype, "Compute dtype of the parameters (masters stay fp32)")
      .oneOf({"fp32", "bf16", "fp16"});
  s.add(p + "reduce_dtype", &sh.reduce_dtype, "Dtype gradients are reduced in").oneOf({"fp32", "bf16", "fp16"});
  s.add(p + "buffer_sync", &sh.buffer_sync, "How module buffers stay equal across ranks")
      .oneOf({"broadcast", "average", "none"});
  s.add(p + "reshard_after_forward", &sh.reshard_after_forward,
        "zero3/hybrid: free each unit's parameters after its forward and gather again in backward");
  s.add(p + "prefetch", &sh.prefetch, "zero3/hybrid: units gathered ahead of use (0 = off)").min(0).max(16);
  s.add(p + "activation_checkpointing", &sh.activation_checkpointing,
        "zero3/hybrid: recompute each block's forward in backward instead of keeping activations");
  s.add(p + "reduce_every_micro_batch", &sh.reduce_every_micro_batch,
        "With gradient accumulation: reduce every micro-batch's gradients during its backward (false: keep full "
        "gradients, reduce once at the last micro-batch)");
  s.add(p + "shard_size", &sh.shard_size,
        "hybrid: ranks per shard group, dividing the world size (0 = all ranks)").min(0).max(kMaxWorldSize);
  s.add(p + "min_unit_params", &sh.min_unit_params,
        "zero3/hybrid: wrapped modules with fewer parameters stay part of their parent unit (0 = all units)")
      .min(0);
  s.add(p + "wrap", &sh.wrap,
        "zero3/hybrid: submodules that become units, by name ('layers.*' = each child of layers); "
        "empty = the model's blocks");
}

void bindEmaKeys(config::ConfigSchema& s, const std::string& p, EmaSection& e) {
  s.add(p + "enabled", &e.enabled, "Keep an EMA of the parameters");
  s.add(p + "decays", &e.decays,
        "EMA decays; the first is generator_ema (a models: entry's: <name>_ema), each also <that name>_<decay>")
      .min(0.0).lessThan(1.0).nonEmpty();
  s.add(p + "dtype", &e.dtype, "EMA dtype").oneOf({"fp32", "bf16"});
  s.add(p + "start_step", &e.start_step, "Steps before this copy the parameters instead of averaging").min(0);
  s.add(p + "update_every", &e.update_every, "Update every k steps with decay^k").min(1);
  s.add(p + "warmup", &e.warmup, "Warmup: decay = min(decay, 1 - (1 + k/inv_gamma)^-power)");
  s.add(p + "inv_gamma", &e.inv_gamma, "Warmup inv_gamma").greaterThan(0.0);
  s.add(p + "power", &e.power, "Warmup power").greaterThan(0.0);
  s.add(p + "buffers", &e.buffers, "Buffers (e.g. BatchNorm statistics): copied or averaged").oneOf({"copy", "average"});

  s.add(p + "init_from", &e.init_from,
        "Safetensors file or sharded export (e.g. an exported generator_ema) to start every EMA from; "
        "default: the model's start");
  s.add(p + "posthoc.stds", &e.posthoc.stds,
        "Post-hoc EMA: sigma_rel of the power-function profiles to track (e.g. [0.05, 0.10]; empty: off); "
        "reconstruct any sigma_rel afterwards with tessera-export --posthoc-ema (docs/ema.md)")
      .greaterThan(0.0).lessThan(0.28);
  s.add(p + "posthoc.snapshot_every", &e.posthoc.snapshot_every,
        "Post-hoc EMA: steps between snapshots of the profiles in <run.dir>/posthoc/ (kept whatever "
        "checkpoint.keep_last says)").min(0);
}

// A models: entry: the model keys at its top level, then its own sections; what it does
// not set it inherits from the top-level sections (finishTrainConfig).
void bindModelEntry(config::ConfigSchema& s, ModelEntry& entry) {
  const std::string p = "models." + entry.name + ".";
  bindModelKeys(s, p, entry.model);
  s.add(p + "trainable", &entry.trainable,
        "false: a frozen model (no optimizer, no EMA; sharded and checkpointed all the same)");
  bindShardingKeys(s, p + "sharding.", entry.sharding);
  bindOptimKeys(s, p + "optim.", entry.optim);
  bindEmaKeys(s, p + "ema.", entry.ema);
}

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
  s.add("run.recipe", &c.run.recipe,
        "What a step trains: standard (the model on the data), dmd (distribution-matching distillation of the models "
        "generator, critic and teacher)")
      .oneOf({"standard", "dmd"});

  s.describeSection("log", "Logging");
  s.add("log.level", &c.log.level, "Log level; the TESSERA_LOG_LEVEL environment variable overrides it")
      .oneOf({"trace", "debug", "info", "warn", "error", "off"});
  s.add("log.per_rank_files", &c.log.per_rank_files, "Also write <run.dir>/logs/rank_N.log per rank");

  s.describeSection("model", "The model to train (models: form: the defaults of every model)");
  bindModelKeys(s, "model.", c.model);
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
  bindOptimKeys(s, "optim.", c.optim);
  s.describeSection("sharding", "How training state is split over the ranks");
  bindShardingKeys(s, "sharding.", c.sharding);
  s.describeSection("ema", "Exponential moving average of the parameters (generator_ema)");
  bindEmaKeys(s, "ema.", c.ema);
  s.describeSection("checkpoint", "Sharded checkpoints, resume and export");
  s.add("checkpoint.every_steps", &c.checkpoint.every_steps, "Save every N steps (0: only at the end)").min(0);
  s.add("checkpoint.at_end", &c.checkpoint.at_end, "Save when the run ends or is preempted (SIGTERM)");
  s.add("checkpoint.keep_last", &c.checkpoint.keep_last, "Newest complete checkpoints to keep (0: all)").min(0);
  s.add("checkpoint.async", &c.checkpoint.async, "Write checkpoints in a background thread");
  s.add("checkpoint.resume", &c.checkpoint.resume, "auto (latest complete checkpoint of run.dir), none, or a directory")
      .nonEmpty();
  s.add("checkpoint.export", &c.checkpoint.export_what,
        "Exported as <run.dir>/export/<name>.safetensors at the end: generator_ema, generator_ema_<decay>, model "
        "(models: form: a model's name, <name>_ema, <name>_ema_<decay>)");
  s.add("checkpoint.export_dtype", &c.checkpoint.export_dtype, "Dtype of exported floating tensors")
      .oneOf({"fp32", "bf16", "fp16"});

  s.describeSection("recipe", "run.recipe dmd: distribution-matching distillation");
  s.add("recipe.critic_steps", &c.recipe.critic_steps, "Critic updates per generator update")
      .min(1)
      .max(RecipeOptions::kMaxCriticSteps);
  s.add("recipe.min_t", &c.recipe.min_t,
        "The generator's samples are noised at a timestep drawn in [min_t, max_t] x model.timesteps")
      .min(0.0).lessThan(1.0);
  s.add("recipe.max_t", &c.recipe.max_t, "Upper end of that range").greaterThan(0.0).max(1.0);
  s.add("recipe.regression_weight", &c.recipe.regression_weight,
        "Weight of DMD's regression loss: the generator's sample of a fixed noise against the teacher's "
        "deterministic (DDIM) sample of it, which keeps every mode covered (0: off)")
      .min(0.0).max(1000.0);
  s.add("recipe.regression_pairs", &c.recipe.regression_pairs,
        "Noise -> teacher sample pairs the regression loss uses (made once when the run starts)")
      .min(1).max(1 << 20);
  s.add("recipe.pair_steps", &c.recipe.pair_steps, "DDIM steps the teacher takes for each pair (at most model.timesteps)")
      .min(1).max(kMaxWidth);
  s.addNamedSection("models",
                    "Several models in one run, by name (run.recipe dmd: generator, critic, teacher); each entry has "
                    "the model keys, trainable, and sharding/optim/ema sections, inheriting what it does not set from "
                    "the top-level sections",
                    [&c](config::ConfigSchema& entry, const std::string& name) {
                      c.models.emplace_back();
                      c.models.back().name = name;
                      bindModelEntry(entry, c.models.back());
                    });
}

namespace {

// The names a model's state and exports go by (see ModelStateNames).
ModelStateNames stateNames(const std::string& name, bool singleModelForm) {
  if (singleModelForm) return {"model", "optim", ema::kDefaultEmaPrefix};
  return {name, "optim/" + name, name + "_ema"};
}

// A model's keys as checks see them: the schema that knows where each was set.
struct ModelKeys {
  const config::ConfigSchema& schema;
  const ModelEntry& entry;

  [[noreturn]] void fail(const std::string& key, const std::string& what, bool modelKey = false) const {
    throw ConfigError(schema.errorMessage((modelKey ? entry.modelKeys : entry.sectionKeys) + key, what));
  }
};

// The checks of one model's keys against each other and the run's.
void validateModel(const ModelKeys& k, const TrainConfig& c, int worldSize) {
  const ModelEntry& m = k.entry;
  if (m.optim.nesterov && m.optim.momentum <= 0) k.fail("optim.nesterov", "needs optim.momentum > 0");
  if ((m.optim.schedule.kind == "cosine" || m.optim.schedule.kind == "linear") &&
      m.optim.schedule.warmup_steps >= c.run.steps) {
    k.fail("optim.schedule.warmup_steps",
           strCat(m.optim.schedule.warmup_steps, " must be below run.steps (", c.run.steps, ")"));
  }
  if (m.optim.schedule.min_lr > m.optim.lr) {
    k.fail("optim.schedule.min_lr", strCat(m.optim.schedule.min_lr, " is above optim.lr (", m.optim.lr, ")"));
  }
  if (m.sharding.bucket_mb * 1024 * 1024 < 1) {
    k.fail("sharding.bucket_mb", strCat(m.sharding.bucket_mb, " MiB is less than one byte"));
  }
  if (!m.ema.posthoc.stds.empty() && !m.ema.enabled) {
    k.fail("ema.posthoc.stds", "tracks power-function EMA profiles: needs ema.enabled");
  }
  if (!m.ema.posthoc.stds.empty() && m.ema.posthoc.snapshot_every <= 0) {
    k.fail("ema.posthoc.snapshot_every", "must be > 0 when ema.posthoc.stds is set (the snapshots are what is reconstructed)");
  }
  if (m.sharding.strategy == "hybrid" && m.sharding.shard_size > 0 && worldSize % m.sharding.shard_size != 0) {
    k.fail("sharding.shard_size", strCat(m.sharding.shard_size, " does not divide the world size (", worldSize, ")"));
  }
  if (m.model.arch == "gpt" && m.model.embed_dim % m.model.heads != 0) {
    k.fail("heads", strCat(m.model.heads, " does not divide ", m.modelKeys, "embed_dim (", m.model.embed_dim, ")"), true);
  }
  if (m.model.arch == "gpt" && c.data.kind == "tensors") {
    k.fail("arch", "gpt needs token data (data.kind text or tokens), not tensors", true);
  }
  if (m.model.arch == "diffusion" && c.data.kind != "tensors") {
    k.fail("arch", strCat("diffusion needs data.kind tensors, not ", c.data.kind), true);
  }
  if (m.model.arch == "diffusion" && m.model.beta_start > m.model.beta_end) {
    k.fail("beta_start", strCat(m.model.beta_start, " is above ", m.modelKeys, "beta_end (", m.model.beta_end, ")"), true);
  }
}

// checkpoint.export names what the run has: a model (single-model form: "model") or one
// of the EMA profiles, by either of its names. Checked before training, not when the
// exports are written at the end.
void checkExportNames(const config::ConfigSchema& s, const TrainConfig& c) {
  std::vector<std::string> known;
  for (const ModelEntry& m : runModels(c)) {
    known.push_back(m.names.weights);
    if (!m.trainable || !m.ema.enabled) continue;
    for (const auto& n : ema::emaProfileNames(m.names.ema, m.ema.decays, m.ema.posthoc.stds)) {
      known.push_back(n.state);
      if (n.alias != n.state) known.push_back(n.alias);
    }
  }
  // Two things under one name (a model "generator_ema" beside the generator's EMA) would
  // export one as the other.
  for (size_t i = 0; i < known.size(); ++i) {
    if (std::find(known.begin(), known.begin() + static_cast<std::ptrdiff_t>(i), known[i]) !=
        known.begin() + static_cast<std::ptrdiff_t>(i)) {
      throw ConfigError(strCat("two things this run can export are named '", known[i], "' (models, their EMAs and ",
                               "the EMAs' <name>_<decay> names must all differ): rename the model or change the decay"));
    }
  }
  for (const auto& what : c.checkpoint.export_what) {
    if (std::find(known.begin(), known.end(), what) != known.end()) continue;
    std::string list;
    for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
    const bool emaOff = c.models.empty() && what.rfind(ema::kDefaultEmaPrefix, 0) == 0 && !c.ema.enabled;
    throw ConfigError(s.errorMessage("checkpoint.export", strCat("'", what, "' is not something this run has",
                                                                 emaOff ? " (ema.enabled is false)" : "",
                                                                 "; it can export: ", list)));
  }
}

// The models: entries before they inherit: what an entry may not say. A frozen model has
// no optimizer and no EMA, so changing their keys is a mistake, not a default to ignore
// (ema.enabled false only says so). Names that would collide with the state's own
// prefixes (model/, optim/, ema/) are refused.
void checkEntriesAsWritten(const config::ConfigSchema& s, const TrainConfig& c) {
  constexpr size_t kMaxModels = 16;
  const auto entries = s.entries("models");  // in the order of c.models: both as the entries appeared
  if (entries.size() > kMaxModels) {
    throw ConfigError(entries[kMaxModels].second->errorMessage("models." + entries[kMaxModels].first + ".trainable",
                                                               strCat("more than ", kMaxModels, " models in one run")));
  }
  for (size_t i = 0; i < entries.size(); ++i) {
    const config::ConfigSchema& entry = *entries[i].second;
    const std::string& name = entries[i].first;
    const std::string p = "models." + name + ".";
    if (name == "model" || name == "optim" || name == "ema") {
      throw ConfigError(entry.errorMessage(p + "trainable", strCat("'", name, "' is reserved (the checkpoint's ", name,
                                                                   "/ prefix): name the model otherwise")));
    }
    if (c.models[i].trainable) continue;
    for (const char* section : {"optim", "ema"}) {
      for (const std::string& key : entry.changedKeys(p + section + ".")) {
        if (key == p + "ema.enabled" && !c.models[i].ema.enabled) continue;
        throw ConfigError(entry.errorMessage(key, strCat("set on a frozen model (", p, "trainable: false), which has no ",
                                                         section, ": remove it")));
      }
    }
  }
}

// run.recipe: which models it needs, and what each must be.
void checkRecipe(const config::ConfigSchema& s, const TrainConfig& c) {
  if (c.run.recipe == "standard") {
    if (!c.models.empty()) {
      throw ConfigError(s.errorMessage("run.recipe", "standard trains the single model: section; a models: map needs "
                                                     "a recipe that trains several (dmd)"));
    }
    return;
  }
  // dmd: a generator and a critic trained against a frozen teacher, all denoisers.
  std::string have;
  for (const ModelEntry& m : c.models) have += (have.empty() ? "" : ", ") + m.name;
  for (const char* role : {"generator", "critic", "teacher"}) {
    auto m = std::find_if(c.models.begin(), c.models.end(), [&](const ModelEntry& e) { return e.name == role; });
    if (m == c.models.end()) {
      throw ConfigError(s.errorMessage("run.recipe", strCat("dmd needs a model named '", role, "' under models: (the "
                                                            "config has: ", have.empty() ? "none" : have, ")")));
    }
    const config::ConfigSchema& entry = *s.entries("models")[static_cast<size_t>(m - c.models.begin())].second;
    const std::string p = strCat("models.", role, ".");
    if (m->model.arch != "diffusion") {
      throw ConfigError(entry.errorMessage(p + "arch", strCat("dmd's ", role, " is a denoiser: arch diffusion, not ",
                                                              m->model.arch)));
    }
    if (m->trainable != (std::string(role) != "teacher")) {
      throw ConfigError(entry.errorMessage(p + "trainable", std::string(role) == "teacher"
                                                                ? "dmd's teacher is frozen: trainable false"
                                                                : strCat("dmd trains its ", role, ": trainable true")));
    }
  }
  const auto entries = s.entries("models");
  const ModelEntry* generator = nullptr;
  for (size_t i = 0; i < c.models.size(); ++i) {
    const ModelEntry& m = c.models[i];
    const std::string p = "models." + m.name + ".";
    if (m.name != "generator" && m.name != "critic" && m.name != "teacher") {
      throw ConfigError(entries[i].second->errorMessage(p + "trainable", strCat("dmd trains generator, critic and ",
                                                                                "teacher; '", m.name, "' would never be "
                                                                                "used: remove it")));
    }
    if (m.name == "generator") generator = &m;
  }
  // One noise schedule: the critic's and the teacher's estimates are compared at the
  // generator's timesteps.
  for (size_t i = 0; i < c.models.size(); ++i) {
    const ModelOptions& m = c.models[i].model;
    if (m.timesteps != generator->model.timesteps || m.beta_start != generator->model.beta_start ||
        m.beta_end != generator->model.beta_end) {
      throw ConfigError(entries[i].second->errorMessage(
          "models." + c.models[i].name + ".timesteps", "timesteps, beta_start and beta_end must be the generator's "
                                                       "(dmd compares the models' estimates at the same noise levels)"));
    }
  }
  if (c.recipe.min_t >= c.recipe.max_t) {
    throw ConfigError(s.errorMessage("recipe.min_t", strCat(c.recipe.min_t, " is not below recipe.max_t (",
                                                            c.recipe.max_t, ")")));
  }
  if (c.recipe.regression_weight > 0 && c.recipe.pair_steps > generator->model.timesteps) {
    throw ConfigError(s.errorMessage("recipe.pair_steps", strCat(c.recipe.pair_steps, " is more than the teacher's ",
                                                                 generator->model.timesteps, " timesteps")));
  }
}

}  // namespace

std::vector<ModelEntry> runModels(const TrainConfig& c) {
  if (c.models.empty()) {
    ModelEntry single;
    single.name = "model";
    single.model = c.model;
    single.sharding = c.sharding;
    single.optim = c.optim;
    single.ema = c.ema;
    single.names = stateNames(single.name, true);
    single.modelKeys = "model.";
    return {single};
  }
  std::vector<ModelEntry> out(c.models.begin(), c.models.end());
  for (ModelEntry& m : out) {
    m.names = stateNames(m.name, false);
    m.modelKeys = m.sectionKeys = "models." + m.name + ".";
    if (!m.trainable) m.ema.enabled = false;  // a frozen model's weights are what they are
  }
  return out;
}

void finishTrainConfig(config::ConfigSchema& s, TrainConfig& c, int worldSize) {
  TESSERA_CHECK(worldSize >= 1, "finishTrainConfig: world size ", worldSize);
  s.checkRequired();
  checkEntriesAsWritten(s, c);
  // An entry's unset keys take the top level's values: "models.g.optim.lr" <- "optim.lr",
  // "models.g.arch" <- "model.arch".
  // A frozen model inherits no optimizer or EMA keys: it has neither, and its resolved
  // config must load back (checkEntriesAsWritten refuses changed ones).
  const auto entries = s.entries("models");
  for (size_t i = 0; i < entries.size(); ++i) {
    const std::string p = "models." + entries[i].first + ".";
    const bool frozen = !c.models[i].trainable;
    entries[i].second->inheritUnset(s, [&p, frozen](const std::string& key) {
      const std::string rest = key.substr(p.size());
      for (const char* section : {"sharding.", "optim.", "ema."}) {
        if (rest.rfind(section, 0) != 0) continue;
        return frozen && std::string(section) != "sharding." ? std::string() : rest;
      }
      return "model." + rest;
    });
  }
  if (boundedProduct(c.run.steps, c.data.global_batch, kMaxCounter) < 0) {
    throw ConfigError(s.errorMessage("run.steps", strCat(c.run.steps, " steps of data.global_batch ", c.data.global_batch,
                                                         " samples are more than the ", kMaxCounter,
                                                         " samples a run can count")));
  }
  checkRecipe(s, c);
  if (c.models.empty()) {
    validateModel({s, runModels(c).front()}, c, worldSize);
  } else {
    const auto entries = s.entries("models");
    const std::vector<ModelEntry> models = runModels(c);
    for (size_t i = 0; i < models.size(); ++i) {
      const ModelKeys keys{*entries[i].second, models[i]};
      validateModel(keys, c, worldSize);
      // One checkpoint holds every model, written over one group: hybrid's replica groups
      // would need one per group.
      if (models[i].sharding.strategy == "hybrid") {
        keys.fail("sharding.strategy", "hybrid is not supported in a models: run yet (every model must be sharded "
                                       "over all ranks: no_shard, zero1, zero2 or zero3)");
      }
      if (!models[i].ema.posthoc.stds.empty()) {
        keys.fail("ema.posthoc.stds", "post-hoc EMA snapshots are not supported in a models: run yet");
      }
    }
  }
  checkExportNames(s, c);
  if (c.model.samples > 0) {
    const bool dmd = c.run.recipe == "dmd";
    if (!dmd && (c.model.arch != "diffusion" || !c.ema.enabled)) {
      throw ConfigError(s.errorMessage("model.samples", "draws samples with generator_ema: needs model.arch "
                                                        "diffusion and ema.enabled"));
    }
    for (const ModelEntry& m : runModels(c)) {
      if (dmd && m.name == "generator" && !m.ema.enabled) {
        throw ConfigError(s.errorMessage("model.samples", "draws one-step samples with generator_ema: needs the "
                                                          "generator's ema.enabled"));
      }
    }
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
  finishTrainConfig(schema, out.config, worldSize);
  out.resolvedYaml = schema.toYaml();
  return out;
}

}  // namespace tessera::trainer
