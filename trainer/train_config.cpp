// Binds TrainConfig's fields to YAML keys (docs and constraints live here, next to
// the key they describe) and loads a run config with overrides.
#include "trainer/train_config.h"

#include <algorithm>
#include <cmath>

#include "common/config.h"
#include "common/errors.h"
#include "common/limits.h"
#include "ema/power_ema.h"
#include "checkpoint/formats_1_2.h"
#include "dtensor/stateful.h"
#include "ema/profile_names.h"
#include "sharding/mixed_precision.h"
#include "models/architecture.h"
#include "trainer/recipe_spec.h"

namespace tessera::trainer {

namespace {

constexpr double kMaxBucketMiB = 1 << 20;  // 1 TiB: sharding.bucket_mib

}  // namespace

namespace {

// optim.*: the library's optimizer options, its learning-rate schedule, gradient clipping.
void bindOptimKeys(config::ConfigSchema& s, const std::string& p, ModelEntry& m) {
  optim::OptimizerOptions& o = m.sharding.optimizer;
  s.add(p + "name", config::choiceOf(&o.kind, optim::kOptimizerKindNames), "Optimizer");
  s.add(p + "lr", &m.schedule.baseLr, "Learning rate").greaterThan(0.0);
  s.add(p + "betas", config::PairTarget{&o.beta1, &o.beta2}, "Adam betas (beta1, beta2)").min(0.0).lessThan(1.0);
  s.add(p + "eps", &o.eps, "Adam epsilon").greaterThan(0.0);
  s.add(p + "weight_decay", &o.weightDecay, "Weight decay (decoupled for adamw)").min(0.0);
  s.add(p + "no_decay", &o.noDecay,
        "Parameter-name patterns ('*' wildcards, e.g. wte.*) without weight decay, besides every parameter of fewer "
        "than 2 dimensions (biases, norm weights), which never decays");
  s.add(p + "lr_scale", &o.lrScale,
        "Learning-rate multipliers by parameter-name pattern, e.g. {wte.*: 0.1} (the longest pattern that matches "
        "wins)")
      .greaterThan(0.0);
  s.add(p + "momentum", &o.momentum, "SGD momentum").min(0.0).lessThan(1.0);
  s.add(p + "nesterov", &o.nesterov, "SGD Nesterov momentum (needs momentum > 0)");
  s.add(p + "muon.momentum", &o.muon.momentum, "muon: momentum of its hidden 2-D weights").min(0.0).lessThan(1.0);
  s.add(p + "muon.nesterov", &o.muon.nesterov, "muon: Nesterov momentum");
  s.add(p + "muon.ns_steps", &o.muon.nsSteps, "muon: Newton-Schulz iterations").min(1).max(100);
  s.add(p + "muon.adamw_lr", &m.muonAdamwLr,
        "muon: learning rate of the parameters AdamW steps (embeddings, norms, biases, heads); 0 = optim.lr")
      .min(0.0);
  s.add(p + "muon.exclude", &o.muon.exclude,
        "muon: patterns ('*' wildcards) of 2-D parameters AdamW steps besides embeddings and heads");
  s.add(p + "muon.ns_dtype", config::choiceOf(&o.muon.nsDtype, sharding::kFloatDtypeNames),
        "muon: dtype of the Newton-Schulz iteration (bf16 on a GPU)");
  s.add(p + "grad_clip", &m.sharding.gradClip, "Clip gradients to this global L2 norm; 0 = off").min(0.0);
  s.add(p + "schedule.kind", config::choiceOf(&m.schedule.kind, optim::kScheduleKindNames), "LR schedule");
  s.add(p + "schedule.warmup_steps", &m.schedule.warmupSteps, "Linear warmup steps").min(0);
  s.add(p + "schedule.min_lr", &m.schedule.minLr, "Floor of cosine and linear decay").min(0.0);
  s.add(p + "schedule.step_size", &m.schedule.stepSize, "Step decay: period in steps").min(1);
  s.add(p + "schedule.gamma", &m.schedule.gamma, "Step decay: factor per period").greaterThan(0.0).max(1.0);
}

// sharding.*: the library's strategy options.
void bindShardingKeys(config::ConfigSchema& s, const std::string& p, ModelEntry& m) {
  sharding::StrategyOptions& o = m.sharding;
  s.add(p + "strategy", config::choiceOf(&o.strategy, sharding::kStrategyKindNames), "Data-parallel strategy");
  s.add(p + "bucket_mb", config::ScaledTarget{&o.bucketBytes, 1024.0 * 1024.0},
        "Gradient bucket size in MiB (fewer, larger messages)")
      .greaterThan(0.0).max(kMaxBucketMiB);
  s.add(p + "param_dtype", config::choiceOf(&o.paramDtype, sharding::kFloatDtypeNames),
        "Compute dtype of the parameters (masters stay fp32)");
  s.add(p + "reduce_dtype", config::choiceOf(&o.reduceDtype, sharding::kFloatDtypeNames),
        "Dtype gradients are reduced in");
  s.add(p + "buffer_sync", config::choiceOf(&o.bufferSync, sharding::kBufferSyncNames),
        "How module buffers stay equal across ranks");
  s.add(p + "reshard_after_forward", &o.fullyShard.reshardAfterForward,
        "zero3/hybrid: free each unit's parameters after its forward and gather again in backward");
  s.add(p + "prefetch", &o.fullyShard.prefetch, "zero3/hybrid: units gathered ahead of use (0 = off)").min(0).max(16);
  s.add(p + "activation_checkpointing", &o.fullyShard.activationCheckpointing,
        "zero3/hybrid: recompute each block's forward in backward instead of keeping activations");
  s.add(p + "reduce_every_micro_batch", &m.reduceEveryMicroBatch,
        "With gradient accumulation: reduce every micro-batch's gradients during its backward (false: keep full "
        "gradients, reduce once at the last micro-batch)");
  s.add(p + "shard_size", &o.fullyShard.shardSize,
        "hybrid: ranks per shard group, dividing the world size (0 = all ranks)").min(0).max(kMaxWorldSize);
  s.add(p + "min_unit_params", &o.fullyShard.minUnitParams,
        "zero3/hybrid: wrapped modules with fewer parameters stay part of their parent unit (0 = all units)")
      .min(0);
  s.add(p + "cpu_offload", &o.fullyShard.cpuOffload,
        "zero3/hybrid: keep fp32 masters, gradient shards and optimizer state in host memory, the optimizer "
        "stepping there (FSDP2's CPUOffloadPolicy; for run.device cuda)");
  s.add(p + "wrap", &o.wrap,
        "zero3/hybrid: submodules that become units, by name ('layers.*' = each child of layers); "
        "empty = the model's blocks");
}

// ema.*: the library's EMA options and the trainer's keys around them.
void bindEmaKeys(config::ConfigSchema& s, const std::string& p, ModelEntry& m) {
  ema::EmaOptions& e = m.ema.options;
  s.add(p + "enabled", &m.ema.enabled, "Keep an EMA of the parameters");
  s.add(p + "decays", &e.decays,
        "EMA decays; the first is the EMA's name (<model>_ema; generator_ema for a diffusion model), each also "
        "<that name>_<decay>")
      .min(0.0).lessThan(1.0).nonEmpty();
  s.add(p + "dtype", config::choiceOf(&e.dtype, ema::kEmaDtypeNames), "EMA dtype");
  s.add(p + "start_step", &e.startStep, "Steps before this copy the parameters instead of averaging").min(0);
  s.add(p + "update_every", &e.updateEvery, "Update every k steps with decay^k").min(1);
  s.add(p + "warmup", &e.warmup, "Warmup: decay = min(decay, 1 - (1 + k/inv_gamma)^-power)");
  s.add(p + "inv_gamma", &e.invGamma, "Warmup inv_gamma").greaterThan(0.0);
  s.add(p + "power", &e.power, "Warmup power").greaterThan(0.0);
  s.add(p + "buffers", config::choiceOf(&e.buffers, ema::kEmaBuffersNames),
        "Buffers (e.g. BatchNorm statistics): copied or averaged");
  s.add(p + "init_from", &m.ema.initFrom,
        "Safetensors file or sharded export (e.g. an exported generator_ema) to start every EMA from; "
        "default: the model's start");
  s.add(p + "posthoc.stds", &e.powerStds,
        "Post-hoc EMA: sigma_rel of the power-function profiles to track (e.g. [0.05, 0.10]; empty: off); "
        "reconstruct any sigma_rel afterwards with tessera-export --posthoc-ema (docs/ema.md)")
      .min(ema::kMinPowerEmaStd).lessThan(ema::kMaxPowerEmaStd);
  s.add(p + "posthoc.snapshot_every", &m.ema.snapshotEvery,
        "Post-hoc EMA: steps between snapshots of the profiles in <run.dir>/posthoc/, and one at the last step "
        "(kept whatever checkpoint.keep_last says)").min(0);
}

// A models: entry: the model keys at its top level, then its own sections; what it does
// not set it inherits from the top-level sections (finishTrainConfig).
void bindModelEntry(config::ConfigSchema& s, ModelEntry& entry) {
  const std::string p = "models." + entry.name + ".";
  models::bindModelKeys(s, p, entry.model);
  s.add(p + "trainable", &entry.trainable,
        "false: a frozen model (no optimizer, no EMA; sharded and checkpointed all the same)");
  bindShardingKeys(s, p + "sharding.", entry);
  bindOptimKeys(s, p + "optim.", entry);
  bindEmaKeys(s, p + "ema.", entry);
}

// run.*: the run's identity, length, seed, device and recipe.
void bindRunKeys(config::ConfigSchema& s, RunOptions& run) {
  s.describeSection("run", "Identity, length and seed of the run");
  s.add("run.name", &run.name, "Run name, shown in the log and on the loss curve").nonEmpty();
  s.add("run.dir", &run.dir, "Run directory: resolved config, metrics, logs, checkpoints, exports").nonEmpty();
  s.add("run.seed", &run.seed, "Seed for model init, data order and dropout").min(0);
  s.add("run.steps", &run.steps, "Optimizer steps to run").min(1).max(kMaxSteps);
  s.add("run.log_every", &run.log_every, "Print and record metrics every N steps").min(1);
  s.add("run.stop_after_steps", &run.stop_after_steps,
        "Stop with a checkpoint after this many steps of this invocation (time-limited jobs); 0 = run to the end")
      .min(0);
  s.add("run.eval_every", &run.eval_every, "Held-out loss with live and EMA weights every N steps (0: at the end only)")
      .min(0);
  s.add("run.device", &run.device, "Where the model trains: cpu, or cuda (each rank's GPU: LOCAL_RANK modulo the GPUs)")
      .oneOf({"cpu", "cuda"});
  s.add("run.backend", &run.backend,
        "How parameters and gradients travel: auto (nccl for cuda when each rank of a node has a GPU of its own; "
        "on the CPU, shm when every rank runs on one host, else gloo), nccl (cuda only), shm (cpu only, every rank "
        "on one host: shared memory), or gloo (TCP); checkpoints and agreement go over shm or gloo")
      .oneOf({"auto", "nccl", "shm", "gloo"});
  std::string recipes;
  std::vector<std::string> recipeNames;
  for (const RecipeSpec* spec : recipeSpecs()) {
    recipes += strCat(recipes.empty() ? "" : ", ", spec->name, " (", spec->description, ")");
    recipeNames.push_back(spec->name);
  }
  s.add("run.recipe", &run.recipe, "What a step trains: " + recipes).oneOf(recipeNames);
  s.add("run.peak_flops", &run.peak_flops,
        "A rank's peak FLOP/s that MFU is reported against (e.g. 989e12 for an H100's dense bf16); 0 = measured at "
        "start by a matrix-product probe on the run's device and compute dtype")
      .min(0.0);
  s.add("run.matmul_dtype", &run.matmul_dtype,
        "What the fp32 Linear layers (and the convnet's convolutions) of the built-in models multiply in on the CPU: fp32, or bf16 (bf16 copies of "
        "inputs and weights through oneDNN, accumulated and returned in fp32; masters, optimizer and everything "
        "else stay fp32; about 2x the products' speed on cores with AVX512-BF16 or AMX)")
      .oneOf({"fp32", "bf16"});
  s.add("run.deterministic", &run.deterministic,
        "Every tensor of the run (parameters, optimizer state, EMA, losses) a function of the config and the data "
        "alone, bit for bit, whatever the world size, the strategy, or where it was stopped and resumed: each "
        "data.micro_batch computed whole on one rank, gradients and losses summed in one fixed tree over the "
        "micro-batches, the gradient norm exact, one intra-op thread per rank. Needs data.micro_batch set, dividing "
        "data.global_batch into at least as many micro-batches as ranks");
}

// log.*: level, per-rank files, TensorBoard.
void bindLogKeys(config::ConfigSchema& s, LogSection& log) {
  s.describeSection("log", "Logging");
  s.add("log.level", &log.level, "Log level; the TESSERA_LOG_LEVEL environment variable overrides it")
      .oneOf({"trace", "debug", "info", "warn", "error", "off"});
  s.add("log.per_rank_files", &log.per_rank_files, "Also write <run.dir>/logs/rank_N.log per rank");
  s.add("log.tensorboard", &log.tensorboard,
        "Write every metrics.jsonl figure and every sample grid as TensorBoard events in <run.dir>/tb/");
  s.add("log.loss_scale", &log.loss_scale, "The y axis of <run.dir>/loss.svg (every loss of the run): linear or log")
      .oneOf({"linear", "log"});
}

// model.*: the single model (or every models: entry's defaults), and its samples.
void bindTopLevelModelKeys(config::ConfigSchema& s, models::ModelOptions& model) {
  s.describeSection("model", "The model to train (models: form: the defaults of every model)");
  models::bindModelKeys(s, "model.", model);
  s.add("model.samples", &model.samples,
        "diffusion: samples drawn with generator_ema (DDPM) at the end, written to <run.dir>/samples.safetensors")
      .min(0).max(kMaxBatch);
}

// The top-level optim.*, sharding.* and ema.* sections: the defaults of every model.
void bindDefaultSections(config::ConfigSchema& s, ModelEntry& defaults) {
  s.describeSection("optim", "Optimizer");
  bindOptimKeys(s, "optim.", defaults);
  s.describeSection("sharding", "How training state is split over the ranks");
  bindShardingKeys(s, "sharding.", defaults);
  s.describeSection("ema", "Exponential moving average of the parameters (<model>_ema; generator_ema for a diffusion model)");
  bindEmaKeys(s, "ema.", defaults);
}

// checkpoint.*: when to save, what to keep, resume and export.
void bindCheckpointKeys(config::ConfigSchema& s, CheckpointSection& checkpoint) {
  s.describeSection("checkpoint", "Sharded checkpoints, resume and export");
  s.add("checkpoint.every_steps", &checkpoint.every_steps, "Save every N steps (0: only at the end)").min(0);
  s.add("checkpoint.at_end", &checkpoint.at_end, "Save when the run ends or is preempted (SIGTERM)");
  s.add("checkpoint.keep_last", &checkpoint.writer.keepLast, "Newest complete checkpoints to keep (0: all)").min(0);
  s.add("checkpoint.async", &checkpoint.writer.async, "Write checkpoints in a background thread");
  s.add("checkpoint.local.every_steps", &checkpoint.local.every_steps,
        "Save to the node-local tier every N steps (0: off): a lost node costs the steps since the last one")
      .min(0);
  s.add("checkpoint.local.dir", &checkpoint.local.tier.dir,
        "This node's directory for the local tier (empty: /dev/shm/tessera-<uid>/<a hash of run.dir>)");
  s.add("checkpoint.local.replicas", &checkpoint.local.tier.replicas,
        "Copies of each rank's local checkpoint on the next nodes (a node: the ranks sharing a host and dir)")
      .min(0);
  s.add("checkpoint.local.keep_last", &checkpoint.local.tier.keepLast, "Complete local steps each node keeps").min(1);
  s.add("checkpoint.resume", &checkpoint.resume, "auto (latest complete checkpoint of run.dir), none, or a directory")
      .nonEmpty();
  s.add("checkpoint.export", &checkpoint.export_what,
        "Exported as <run.dir>/export/<name>.safetensors at the end: generator_ema, generator_ema_<decay>, model "
        "(models: form: a model's name, <name>_ema, <name>_ema_<decay>)");
  s.add("checkpoint.export_dtype", config::choiceOf(&checkpoint.export_dtype, sharding::kFloatDtypeNames),
        "Dtype of exported floating tensors");
}

// models: the named section whose entries become c.models, in order of appearance.
void bindModelsSection(config::ConfigSchema& s, TrainConfig& c) {
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

}  // namespace

// eval.*: the sample grids an image denoiser's run draws.
void bindEvalKeys(config::ConfigSchema& s, EvalSection& e) {
  s.describeSection("eval", "Sample grids of image denoisers (diffusion, dit on image data)");
  s.add("eval.sample_every", &e.sample_every,
        "A PNG grid of samples from each EMA and the live model every N steps, in <run.dir>/samples/ (0: at the end "
        "only)")
      .min(0).max(kMaxSteps);
  s.add("eval.sample_per_class", &e.sample_per_class, "Samples of each class in a grid (a row per class)").min(1).max(64);
  s.add("eval.sample_steps", &e.sample_steps, "DDIM steps of the grids' samples (at most model.timesteps)")
      .min(1).max(kMaxWidth);
  s.add("eval.sample_cfg", &e.sample_cfg, "Classifier-free guidance scale of the grids' samples (1: none)")
      .min(0.0).max(100.0);
  s.add("eval.sample_cfg_interval", &e.sample_cfg_interval,
        "FIRST, LAST: the timesteps where eval.sample_cfg applies, the conditional output alone elsewhere (empty: "
        "every timestep)");
  s.add("eval.judge", &e.judge,
        "A classifier export (model.arch mlp on the same images): at the end, its accuracy on generator_ema's samples "
        "and the Frechet distance of its features to the held-out images' (\"\": none)");
  s.add("eval.judge_per_class", &e.judge_per_class, "Samples of each class the judge sees").min(1).max(1 << 16);
}

// profile.*: the timeline of a few steps.
void bindProfileKeys(config::ConfigSchema& s, ProfileSection& p) {
  s.describeSection("profile", "A timeline of a few steps");
  s.add("profile.start_step", &p.start_step,
        "The first step traced into <run.dir>/profile/trace.json (every rank's threads and collectives; Perfetto or "
        "chrome://tracing); 0 = none")
      .min(0);
  s.add("profile.steps", &p.steps, "How many steps are traced").min(1).max(1000);
  s.add("profile.aten_ops", &p.aten_ops,
        "Also trace every LibTorch operator each thread runs (category aten; slows the traced steps)");
}

// diagnostics.*: the flight recorder and the timeouts.
void bindDiagnosticsKeys(config::ConfigSchema& s, DiagnosticsSection& d) {
  s.describeSection("diagnostics", "When a run goes wrong: the flight recorder and the timeouts");
  s.add("diagnostics.flight_entries", &d.runtime.flightEntries,
        "Collectives each communicator remembers for <run.dir>/flight/rank_N.json, written on a timeout, an error, "
        "SIGTERM or SIGUSR1 (tessera-flight reads them); 0 = off")
      .min(0)
      .max(1000000);
  s.add("diagnostics.startup_timeout_s", &d.runtime.rendezvousTimeout,
        "Seconds every rank waits at start for the others (rendezvous, communicator set-up)")
      .min(1.0)
      .max(86400.0);
  s.add("diagnostics.collective_timeout_s", &d.runtime.commTimeout,
        "Seconds a collective of a step may take before the rank gives up, dumps its flight record and exits")
      .min(1.0)
      .max(86400.0);
  s.add("diagnostics.straggler_ratio", &d.straggler_ratio,
        "A rank whose steps keep it busy (time not blocked in collectives) longer than this many times the other "
        "ranks' median is named in rank 0's log while the run goes on; every window records the slowest rank and "
        "its lag in metrics (slowest_rank, slowest_rank_lag_ms). 0: never named; otherwise at least 1")
      .min(0.0)
      .max(100.0);
  s.add("diagnostics.check_collectives", &d.runtime.checkCollectives,
        "Before every collective the ranks compare what each issues (op, dtype, size) and stop with an error naming "
        "the ranks that disagree; one more small collective each (debugging)");
  s.add("diagnostics.checkpoint_timeout_s", &d.checkpoint_timeout,
        "Seconds a collective of a checkpoint save or load or of an export may take (they wait for file writes)")
      .min(1.0)
      .max(86400.0);
}

// fault.*: a lost rank's replica group leaves, the others go on.
void bindFaultKeys(config::ConfigSchema& s, FaultSection& f) {
  s.describeSection("fault", "A lost rank: its replica group leaves the run and the others go on");
  s.add("fault.survive", &f.survive,
        "When a rank is lost (its process exits or is killed), its replica group (hybrid: its shard group; no_shard, zero1, "
        "zero2: its node's ranks) leaves the run and the other groups redo the step in-process with the same global batch, "
        "without a restart or a checkpoint read (under run.deterministic the same bits). Needs the CPU collectives (shm or gloo), "
        "run.recipe standard and any strategy but zero3; the group of rank 0 (the store's host) must live");
  s.add("fault.quorum_wait_s", &f.quorum_wait,
        "Seconds rank 0 waits for the live ranks to report after a loss before it names the groups that go on")
      .min(0.05)
      .max(600.0);
  s.add("fault.lost_after_s", &f.lost_after,
        "Seconds a rank may be stopped or send no heartbeat before it is lost (over shm its heartbeats may be late "
        "twice this): longer on an overloaded host, where a live rank's heartbeats come late")
      .min(0.2)
      .max(600.0);
}

// The sections in this order: the resolved config lists keys in registration order.
void bindTrainConfig(config::ConfigSchema& s, TrainConfig& c) {
  bindRunKeys(s, c.run);
  bindLogKeys(s, c.log);
  bindProfileKeys(s, c.profile);
  bindDiagnosticsKeys(s, c.diagnostics);
  bindFaultKeys(s, c.fault);
  bindEvalKeys(s, c.eval);
  bindTopLevelModelKeys(s, c.defaults.model);
  datasets::bindDataKeys(s, c.data);
  bindDefaultSections(s, c.defaults);
  bindCheckpointKeys(s, c.checkpoint);
  for (const RecipeSpec* spec : recipeSpecs()) {
    if (spec->bindKeys) spec->bindKeys(s, c);
  }
  bindModelsSection(s, c);
}

namespace {

// The names a model's state and exports go by (see ModelStateNames). A single denoiser's
// EMA is "generator_ema", what users of a diffusion run export for inference; any other
// single model's follows the model ("model_ema", checkpoint/formats_1_2.h for its old name).
ModelStateNames stateNames(const ModelEntry& m, bool singleModelForm) {
  if (!singleModelForm) return {m.name, "optim/" + m.name, m.name + "_ema", ""};
  if (m.model.isDenoiser()) return {"model", "optim", "generator_ema", ""};
  return {"model", "optim", "model_ema", checkpoint::kFormerSingleModelEma};
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
void validateModel(const ModelKeys& k, TrainConfig& c, int worldSize) {
  const ModelEntry& m = k.entry;
  const optim::OptimizerOptions& o = m.sharding.optimizer;
  if (!m.trainable && !m.model.init_from) {
    // Never trained: without weights to start from it would be its random initial values.
    k.fail("init_from", "a frozen model (trainable: false) must be loaded: give init_from (an export, or a sharded "
                        "export's *.index.json)",
           /*modelKey=*/true);
  }
  if (o.nesterov && o.momentum <= 0) k.fail("optim.nesterov", "needs optim.momentum > 0");
  if (o.kind == optim::OptimizerKind::kMuon && o.muon.nsDtype == at::kHalf) {
    k.fail("optim.muon.ns_dtype", "fp16: the iteration runs in fp32 or bf16");
  }
  if (o.kind == optim::OptimizerKind::kMuon && o.muon.nsDtype == at::kBFloat16 && c.run.device != "cuda") {
    k.fail("optim.muon.ns_dtype", strCat("bf16 is for the iteration on a GPU (run.device cuda); on run.device ",
                                         c.run.device, " use fp32"));
  }
  if (o.kind != optim::OptimizerKind::kMuon) {
    // Muon's keys set to other than their defaults under another optimizer would be ignored
    // without a word (a resolved config lists them all, at their defaults).
    const optim::MuonOptions defaults;
    const std::vector<std::pair<const char*, bool>> changed = {
        {"momentum", o.muon.momentum != defaults.momentum}, {"nesterov", o.muon.nesterov != defaults.nesterov},
        {"ns_steps", o.muon.nsSteps != defaults.nsSteps},   {"adamw_lr", m.muonAdamwLr != 0},
        {"exclude", !o.muon.exclude.empty()},               {"ns_dtype", o.muon.nsDtype != defaults.nsDtype}};
    for (const auto& [key, differs] : changed) {
      if (differs) {
        k.fail(strCat("optim.muon.", key),
               strCat("applies to optim.name muon, not ", enumName(optim::kOptimizerKindNames, o.kind)));
      }
    }
  }
  const bool decaysToEnd = m.schedule.kind == optim::ScheduleKind::kCosine ||
                           m.schedule.kind == optim::ScheduleKind::kLinear;
  if (decaysToEnd && m.schedule.warmupSteps >= c.run.steps) {
    k.fail("optim.schedule.warmup_steps", strCat(m.schedule.warmupSteps, " must be below run.steps (", c.run.steps, ")"));
  }
  if (m.schedule.minLr > m.schedule.baseLr) {
    k.fail("optim.schedule.min_lr", strCat(m.schedule.minLr, " is above optim.lr (", m.schedule.baseLr, ")"));
  }
  if (m.sharding.bucketBytes < 1) k.fail("sharding.bucket_mb", "is less than one byte");
  const ema::EmaOptions& e = m.ema.options;
  if (!e.powerStds.empty() && !m.ema.enabled) k.fail("ema.posthoc.stds", "tracks power-function EMA profiles: needs ema.enabled");
  if (!e.powerStds.empty() && m.ema.snapshotEvery <= 0) {
    k.fail("ema.posthoc.snapshot_every", "must be > 0 when ema.posthoc.stds is set (the snapshots are what is reconstructed)");
  }
  if (m.ema.enabled && e.warmup) {
    // The warmup's decay at the run's last update (count updates - 1): a decay above it is
    // never reached, and its EMA is the warmup's alone.
    const int64_t updates = std::max<int64_t>(1, (c.run.steps - e.startStep) / e.updateEvery);
    const double reached = ema::warmupDecayCap(e, updates - 1);
    std::string unreached;
    int count = 0;
    for (double d : e.decays) {
      if (d <= reached) continue;
      unreached += strCat(count++ == 0 ? "" : ", ", d);
    }
    // One such decay is the warmup's EMA, as asked; two are the same tensors kept twice.
    if (count > 1) {
      c.warnings.push_back(strCat(m.sectionKeys, "ema.decays ", unreached, " are never reached in run.steps ",
                                  c.run.steps, " with ema.warmup (its decay is ", reached,
                                  " at the last update): their EMAs are the warmup's alone, the same tensors kept "
                                  "and exported twice (set ema.warmup: false, or a higher ema.power, for the decays "
                                  "to apply)"));
    }
  }
  const bool fullyShards = m.sharding.strategy == sharding::StrategyKind::kZero3 ||
                           m.sharding.strategy == sharding::StrategyKind::kHybrid;
  if (m.sharding.fullyShard.cpuOffload && !fullyShards) {
    k.fail("sharding.cpu_offload", strCat("needs sharding.strategy zero3 or hybrid, not ",
                                          enumName(sharding::kStrategyKindNames, m.sharding.strategy)));
  }
  const int shardSize = m.sharding.fullyShard.shardSize;
  if (m.sharding.strategy == sharding::StrategyKind::kHybrid && shardSize > 0 && worldSize % shardSize != 0) {
    k.fail("sharding.shard_size", strCat(shardSize, " does not divide the world size (", worldSize, ")"));
  }
  // The architecture's own checks, and its keys: one that it does not read, set to other
  // than its default, is a mistake (model.loss_weighting on an mlp), not a value to ignore.
  // One exception: model.arch switched by --set on a config written for another
  // architecture (a classifier trained from a DiT's config) leaves that config's keys
  // behind; they are named in a warning and ignored.
  std::vector<std::string> changed;
  for (const std::string& key : k.schema.changedKeys(m.modelKeys)) changed.push_back(key.substr(m.modelKeys.size()));
  const models::ArchitectureContext context{c.data.kind, m.modelKeys};
  const auto fromSet = [&](const std::string& key) {
    return k.schema.locationOf(m.modelKeys + key).source.rfind("--set", 0) == 0;
  };
  std::vector<std::string> leftBehind;
  for (const models::KeyProblem& p : models::architectureProblems(m.model, context, changed)) {
    if (!p.unread || !fromSet("arch")) k.fail(p.key, p.what, /*modelKey=*/true);
    leftBehind.push_back(m.modelKeys + p.key);
  }
  if (!leftBehind.empty()) {
    std::string keys;
    for (const std::string& key : leftBehind) keys += (keys.empty() ? "" : ", ") + key;
    c.warnings.push_back(strCat(m.modelKeys, "arch ", m.model.arch, " (--set) does not read ", keys,
                                ", which the config sets for another architecture: they are ignored"));
  }
}

// checkpoint.export names what the run has (runExportNames): a model (single-model form:
// "model") or one of the EMA profiles, by any of its names. Checked before training, not
// when the exports are written at the end.
void checkExportNames(const config::ConfigSchema& s, const TrainConfig& c) {
  const std::vector<ExportName> names = runExportNames(c);
  // Two things under one name (a model "generator_ema" beside the generator's EMA) would
  // export one as the other.
  for (size_t i = 0; i < names.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (names[j].name != names[i].name) continue;
      throw ConfigError(strCat("two things this run can export are named '", names[i].name, "' (models, their EMAs and ",
                               "the EMAs' <name>_<decay> names must all differ): rename the model or change the decay"));
    }
  }
  for (const auto& what : c.checkpoint.export_what) {
    if (std::any_of(names.begin(), names.end(), [&](const ExportName& n) { return n.name == what; })) continue;
    std::string list;
    for (const ExportName& n : names) list += (list.empty() ? "" : ", ") + n.name;
    const bool emaOff = c.singleModelForm && what.find("_ema") != std::string::npos && !c.models.front().hasEma();
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
    if (name == dtensor::kModelKey || name == dtensor::kOptimizerKey || name == dtensor::kEmaKey) {
      // Named at a key the user wrote (with its file and line), not at one they did not.
      const std::vector<std::string> written = entry.changedKeys(p);
      throw ConfigError(entry.errorMessage(written.empty() ? p + "trainable" : written.front(),
                                           strCat("'", name, "' is reserved (the checkpoint's ", name,
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

// The models: entries take the top-level sections' values for the keys they do not set
// ("models.g.optim.lr" <- "optim.lr", "models.g.arch" <- "model.arch"). A frozen model
// inherits no optimizer or EMA keys: it has neither, and its resolved config must load
// back (checkEntriesAsWritten refuses changed ones).
void inheritTopLevel(config::ConfigSchema& s, TrainConfig& c) {
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
}

// The run's models, each with its names and keys: the single-model form becomes the one
// entry "model" here, so that everything after reads one list.
void settleModels(TrainConfig& c) {
  c.singleModelForm = c.models.empty();
  if (c.singleModelForm) c.models.push_back(c.defaults);
  for (ModelEntry& m : c.models) {
    if (!m.trainable) m.ema.enabled = false;  // a frozen model keeps none: its resolved config says so
    m.names = stateNames(m, c.singleModelForm);
    m.displayName = c.singleModelForm ? "model" : "model " + m.name;
    m.seedSalt = c.singleModelForm ? "" : m.name;
    m.modelKeys = c.singleModelForm ? "model." : "models." + m.name + ".";
    m.sectionKeys = c.singleModelForm ? "" : m.modelKeys;
    m.schedule.totalSteps = c.run.steps;
    optim::MuonOptions& muon = m.sharding.optimizer.muon;
    muon.adamwLrScale = m.muonAdamwLr > 0 ? m.muonAdamwLr / m.schedule.baseLr : 1.0;
    m.ema.options.prefix = m.names.ema;
    m.ema.options.formerPrefix = m.names.formerEma;
  }
}

// The image keys against each other and the data kind.
void checkImageData(const config::ConfigSchema& s, const TrainConfig& c) {
  const datasets::DataOptions& d = c.data;
  const bool images = datasets::isImageKind(d.kind);
  if (d.channels == 2) throw ConfigError(s.errorMessage("data.channels", "2: images have 1 (gray) or 3 (RGB) channels"));
  if (d.channels != 0 && d.kind != "image_folder" && d.kind != "webdataset") {
    throw ConfigError(s.errorMessage("data.channels", strCat("applies to data.kind image_folder or webdataset, not ", d.kind)));
  }
  if (d.kind == "idx" && d.labels.empty()) {
    throw ConfigError(s.errorMessage("data.labels", "data.kind idx needs the labels file (idx1) of data.path"));
  }
  if (!d.eval_path.empty() && !images) {
    throw ConfigError(s.errorMessage("data.eval_path", strCat("applies to image data (idx, image_folder, webdataset), not ", d.kind)));
  }
  if (d.kind == "idx" && !d.eval_path.empty() && d.eval_labels.empty()) {
    throw ConfigError(s.errorMessage("data.eval_labels", "data.eval_path needs its labels file"));
  }
  for (const auto& [key, set] : {std::pair{"data.labels", !d.labels.empty()}, {"data.eval_labels", !d.eval_labels.empty()}}) {
    if (set && d.kind != "idx") {
      throw ConfigError(s.errorMessage(key, strCat("applies to data.kind idx, not ", d.kind, " (clear it: --set ", key, "=)")));
    }
  }
  if (!c.eval.judge.empty() && (!images || !recipeSpec(c.run.recipe).judgesSamples ||
                                 !c.models.front().model.isDenoiser() || !c.models.front().hasEma())) {
    throw ConfigError(s.errorMessage("eval.judge", "judges generator_ema's samples: needs a denoiser (diffusion, dit) "
                                                   "with ema.enabled on image data (idx, image_folder, webdataset), run.recipe "
                                                   "standard"));
  }
  if ((d.image_size != 0 || d.hflip) && !images) {
    throw ConfigError(s.errorMessage(d.hflip ? "data.hflip" : "data.image_size",
                                     strCat("applies to image data (idx, image_folder, webdataset), not ", d.kind)));
  }
}

// model.samples: the recipe's sampling model (RecipeSpec::samplingModel) draws them with
// its EMA, so it must be a denoiser that keeps one.
void checkSamples(const config::ConfigSchema& s, const TrainConfig& c) {
  if (c.defaults.model.samples <= 0) return;
  const std::string sampler = recipeSpec(c.run.recipe).samplingModel;
  for (const ModelEntry& m : c.models) {
    if (m.name != sampler || (m.model.isDenoiser() && m.hasEma())) continue;
    throw ConfigError(s.errorMessage("model.samples", strCat("draws samples with ", m.names.ema, ": needs ",
                                                             m.modelKeys, "arch diffusion or dit and ", m.sectionKeys,
                                                             "ema.enabled")));
  }
}

}  // namespace

std::vector<ExportName> runExportNames(const TrainConfig& c) {
  std::vector<ExportName> out;
  for (const ModelEntry& m : c.models) {
    out.push_back({m.names.weights, dtensor::statePrefix(m.names.weights)});
    if (!m.hasEma()) continue;
    const ema::EmaOptions& e = m.ema.options;
    const auto profiles = ema::emaProfileNames(m.names.ema, e.decays, e.powerStds);
    const auto former = m.names.formerEma.empty() ? decltype(profiles){}
                                                  : ema::emaProfileNames(m.names.formerEma, e.decays, e.powerStds);
    for (size_t i = 0; i < profiles.size(); ++i) {
      const std::string prefix = dtensor::statePrefix(dtensor::kEmaKey) + profiles[i].state + "/";
      for (const ema::EmaProfileName* n : {&profiles[i], former.empty() ? nullptr : &former[i]}) {
        if (n == nullptr) continue;
        out.push_back({n->state, prefix});
        if (n->alias != n->state) out.push_back({n->alias, prefix});
      }
    }
  }
  return out;
}

ModelEntry::ModelEntry() {
  // The trainer's defaults where they differ from the library's: wrapped modules under a
  // million parameters stay with their parent (a tiny unit costs a collective and saves no
  // memory worth having), and step decay every 100 steps.
  sharding.fullyShard.minUnitParams = 1000000;
  schedule.stepSize = 100;
}

DiagnosticsSection::DiagnosticsSection() {
  // The trainer's default where it differs from the library's: a step's collective gives
  // up after 100 s (a stuck rank is named sooner; checkpoints have their own timeout).
  runtime.commTimeout = std::chrono::seconds(100);
}

CheckpointSection::CheckpointSection() {
  // The trainer's defaults where they differ from the library's: the 3 newest checkpoints
  // kept, written in the background (the step stalls only for the staging copy).
  writer.keepLast = 3;
  writer.async = true;
}

namespace {

// The largest divisor of `n` that is at most `limit` (>= 1): a rank's micro-batch.
int64_t largestDivisorUpTo(int64_t n, int64_t limit) {
  int64_t d = std::max<int64_t>(1, std::min(limit, n));
  while (n % d != 0) --d;
  return d;
}

}  // namespace

void finishTrainConfig(config::ConfigSchema& s, TrainConfig& c, int worldSize) {
  TESSERA_CHECK(worldSize >= 1, "finishTrainConfig: world size ", worldSize);
  s.checkRequired();
  checkEntriesAsWritten(s, c);
  inheritTopLevel(s, c);
  if (boundedProduct(c.run.steps, c.data.global_batch, kMaxCounter) < 0) {
    throw ConfigError(s.errorMessage("run.steps", strCat(c.run.steps, " steps of data.global_batch ", c.data.global_batch,
                                                         " samples are more than the ", kMaxCounter,
                                                         " samples a run can count")));
  }
  if (c.diagnostics.straggler_ratio > 0 && c.diagnostics.straggler_ratio < 1) {
    throw ConfigError(s.errorMessage("diagnostics.straggler_ratio",
                                     strCat(c.diagnostics.straggler_ratio, " would name a rank no slower than the others: "
                                                                          "give 0 (never) or a ratio of at least 1")));
  }
  if (c.run.matmul_dtype != "fp32" && c.run.device != "cpu") {
    // On a GPU the products are LibTorch's: refused rather than ignored.
    throw ConfigError(s.errorMessage("run.matmul_dtype", strCat(c.run.matmul_dtype, " Linear products are for run.device "
                                                                "cpu, not ", c.run.device,
                                                                "; on a GPU use sharding.param_dtype: bf16")));
  }
  settleModels(c);
  recipeSpec(c.run.recipe).finish(s, c);
  const auto entries = c.singleModelForm ? std::vector<std::pair<std::string, config::ConfigSchema*>>{}
                                         : s.entries("models");
  for (size_t i = 0; i < c.models.size(); ++i) {
    const ModelKeys keys{c.singleModelForm ? s : *entries[i].second, c.models[i]};
    validateModel(keys, c, worldSize);
    if (c.singleModelForm) continue;
    // One checkpoint holds every model, written over one group: hybrid's replica groups
    // would need one per group.
    if (c.models[i].sharding.strategy == sharding::StrategyKind::kHybrid) {
      keys.fail("sharding.strategy", "hybrid is not supported in a models: run yet (every model must be sharded "
                                     "over all ranks: no_shard, zero1, zero2 or zero3)");
    }
    if (!c.models[i].ema.options.powerStds.empty()) {
      keys.fail("ema.posthoc.stds", "post-hoc EMA snapshots are not supported in a models: run yet");
    }
  }
  if (c.fault.survive) {
    // A group that leaves must leave a whole replica behind: every group holds the full
    // state (no_shard/zero1/zero2: what they shard, sharded inside the group, run_setup.cpp),
    // or its own group's shards of it (hybrid); and the step must be one optimizer update
    // that either happened or did not (standard).
    if (c.run.recipe != "standard") {
      throw ConfigError(s.errorMessage("fault.survive", strCat("needs run.recipe standard, not ", c.run.recipe,
                                                               " (a recipe that updates several models in one step "
                                                               "cannot yet be redone by the survivors)")));
    }
    // A loss must be noticed before the waits on the lost rank time out (over shm its
    // heartbeats may be late twice lost_after_s): a timeout ends the run instead.
    const auto& runtime = c.diagnostics.runtime;
    if (2 * c.fault.lost_after >= std::min(runtime.commTimeout, runtime.rendezvousTimeout)) {
      throw ConfigError(s.errorMessage(
          "fault.lost_after_s",
          strCat(c.fault.lost_after.count() / 1000.0, " s: twice it must be below diagnostics.collective_timeout_s (",
                 runtime.commTimeout.count() / 1000.0, ") and diagnostics.startup_timeout_s (",
                 runtime.rendezvousTimeout.count() / 1000.0, "), or a stopped rank ends the run in a timeout")));
    }
    for (const ModelEntry& m : c.models) {
      const sharding::StrategyKind kind = m.sharding.strategy;
      if (kind == sharding::StrategyKind::kZero3) {
        throw ConfigError(s.errorMessage(
            "fault.survive", "needs a replica in every group: sharding.strategy zero3 shards over every rank, so a "
                             "lost rank takes shards no other rank holds (hybrid is zero3 inside each group)"));
      }
    }
  }
  checkExportNames(s, c);
  checkSamples(s, c);
  checkImageData(s, c);
  for (const ModelEntry& m : c.models) {
    // The default (50) is cut to model.timesteps; a value set above it is a mistake.
    const bool set = !s.locationOf("eval.sample_steps").source.empty();
    if (set && m.model.isDenoiser() && c.eval.sample_steps > m.model.timesteps) {
      throw ConfigError(s.errorMessage("eval.sample_steps", strCat(c.eval.sample_steps, " DDIM steps, more than the ",
                                                                   m.model.timesteps, " of model.timesteps")));
    }
    const std::string interval = models::guidanceIntervalProblem(c.eval.sample_cfg_interval, m.model.timesteps);
    if (m.model.isDenoiser() && !interval.empty()) throw ConfigError(s.errorMessage("eval.sample_cfg_interval", interval));
  }
  if (c.profile.start_step > 0 && c.profile.start_step > c.run.steps - (c.profile.steps - 1)) {
    throw ConfigError(s.errorMessage("profile.start_step",
                                     strCat(c.profile.start_step, " + profile.steps (", c.profile.steps,
                                            ") - 1 is past run.steps (", c.run.steps, ")")));
  }
  c.origins = s.origins();
  if (c.run.deterministic) {
    // run.deterministic: data.micro_batch is the unit of the step's sums, the same on every
    // world size; the ranks take whole micro-batches, as evenly as they go.
    const bool set = c.data.micro_batch != datasets::kAutoMicroBatch;
    if (!set || c.data.micro_batch <= 0 || c.data.global_batch % c.data.micro_batch != 0) {
      throw ConfigError(s.errorMessage(
          "data.micro_batch", strCat(set ? strCat(c.data.micro_batch, " does not divide data.global_batch ",
                                                  c.data.global_batch)
                                         : std::string("not set"),
                                     ": run.deterministic sums whole micro-batches, the same on every world size; "
                                     "set data.micro_batch to a divisor of data.global_batch")));
    }
    const int64_t count = c.data.global_batch / c.data.micro_batch;
    if (worldSize > count) {
      throw ConfigError(s.errorMessage(
          "data.micro_batch", strCat(count, " micro-batches of ", c.data.micro_batch, " per step (data.global_batch ",
                                     c.data.global_batch, "), fewer than the ", worldSize,
                                     " ranks: under run.deterministic every rank computes whole micro-batches; "
                                     "data.micro_batch ", std::max<int64_t>(1, c.data.global_batch / worldSize),
                                     " or less")));
    }
    return;
  }
  // The global batch splits over the ranks; each rank's share into micro-batches of the
  // largest size up to data.micro_batch that divides it (gradient accumulation chosen
  // automatically, so a run resumed on another world size keeps its global batch).
  if (worldSize <= 0 || c.data.global_batch % worldSize != 0) {
    throw ConfigError(s.errorMessage("data.global_batch", strCat(c.data.global_batch,
                                                                 " samples per step do not split evenly over world "
                                                                 "size ",
                                                                 worldSize, " ranks")));
  }
  const int64_t perRank = c.data.global_batch / worldSize;
  if (c.data.micro_batch == datasets::kAutoMicroBatch) {
    c.data.micro_batch = perRank;
  } else if (perRank % c.data.micro_batch != 0) {
    c.data.micro_batch_asked = c.data.micro_batch;
    c.data.micro_batch = largestDivisorUpTo(perRank, c.data.micro_batch);
  }
}

void fitBatchToWorld(TrainConfig& c, int worldSize) {
  TESSERA_CHECK(worldSize >= 1, "fitBatchToWorld: world size ", worldSize);
  if (c.run.deterministic) {
    const int64_t count = c.data.global_batch / c.data.micro_batch;
    if (worldSize > count) {
      throw ConfigError(strCat("data.micro_batch: ", count, " micro-batches per step, fewer than the ", worldSize,
                               " ranks of the world"));
    }
    return;
  }
  if (c.data.global_batch % worldSize != 0) {
    throw ConfigError(strCat("data.global_batch: ", c.data.global_batch, " samples per step do not split evenly over ",
                             worldSize, " ranks"));
  }
  const int64_t perRank = c.data.global_batch / worldSize;
  const int64_t asked = c.data.micro_batch_asked > 0 ? c.data.micro_batch_asked : c.data.micro_batch;
  c.data.micro_batch = largestDivisorUpTo(perRank, asked);
  c.data.micro_batch_asked = c.data.micro_batch == asked ? 0 : asked;
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
