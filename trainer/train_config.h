// The run configuration of tessera-train: typed options with in-class defaults, bound
// to YAML keys by bindTrainConfig(). configs/README.md documents every key (a test
// checks that), and configs/default.yaml is the main job's config.
#pragma once

#include <any>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpointer.h"
#include "checkpoint/local_tier.h"
#include "common/key_origins.h"
#include "distributed/runtime.h"
#include "ema/ema_manager.h"
#include "optim/lr_schedule.h"
#include "sharding/strategy.h"
#include "datasets/data_options.h"
#include "models/model_options.h"

namespace tessera::config {
class ConfigSchema;
}

namespace tessera::trainer {

struct RunOptions {
  std::string name = "demo";      // shown in the log and on the loss curve
  std::string dir = "runs/demo";  // run directory: resolved config, metrics, logs, checkpoints
  int64_t seed = 1234;            // seeds model init, data order and dropout
  int64_t steps = 200;            // optimizer steps to run
  int64_t log_every = 10;         // metrics every N steps
  int64_t stop_after_steps = 0;   // stop (with a checkpoint) after this many steps of this invocation; 0 = run to the end
  int64_t eval_every = 0;         // held-out loss (live and EMA weights) every N steps; 0 = at the end only
  std::string device = "cpu";     // cpu | cuda (this rank's GPU: LOCAL_RANK modulo the GPUs visible)
  std::string backend = "auto";   // auto | nccl | shm | gloo: how parameters and gradients travel (runtimeOptions)
  std::string recipe = "standard";  // standard (the one `model`) | dmd (models generator, critic, teacher)
  double peak_flops = 0;          // a rank's peak FLOP/s for MFU; 0 = measured at start by a matrix-product probe
  std::string matmul_dtype = "fp32";  // fp32 | bf16: what fp32 Linear layers multiply in on the CPU (kernels/cpu_matmul.h)
  // The same bits on any world size and strategy (sharding/canonical_reduce.h): whole
  // micro-batches per rank, gradients and losses summed in one fixed tree, an exact norm,
  // one intra-op thread per rank.
  bool deterministic = false;
};

// Pictures during training (image denoisers: diffusion or dit on idx / image_folder data).
struct EvalSection {
  int64_t sample_every = 0;      // a sample grid every N steps (0: at the end only)
  int64_t sample_per_class = 8;  // grid columns: samples of each class (unconditional: the whole grid / 10 rows)
  int64_t sample_steps = 50;     // DDIM steps
  double sample_cfg = 1.5;       // classifier-free guidance scale
  std::vector<int64_t> sample_cfg_interval;  // [first, last] timesteps where it applies (empty: all)
  std::string judge;             // a classifier export: judge generator_ema's samples at the end ("": no)
  int64_t judge_per_class = 100; // samples of each class it judges
};

struct LogSection {
  std::string level = "info";  // trace|debug|info|warn|error|off; TESSERA_LOG_LEVEL overrides when set
  bool per_rank_files = true;  // also write <run.dir>/logs/rank_N.log
  bool tensorboard = true;     // TensorBoard event files in <run.dir>/tb/ (rank 0)
  std::string loss_scale = "linear";  // loss.svg's y axis: linear | log
};

// A timeline of a few steps (docs/observability.md): steps start_step .. start_step + steps - 1.
struct ProfileSection {
  int64_t start_step = 0;  // the first step traced (as the log counts them, from 1); 0 = no profile
  int64_t steps = 2;       // how many
  bool aten_ops = false;   // also every LibTorch operator each thread runs (category "aten")
};

// When a run goes wrong (docs/troubleshooting.md): the flight recorder and the timeouts.
struct DiagnosticsSection {
  DiagnosticsSection();
  double straggler_ratio = 1.3;   // a rank busy longer than this times the others is named (0: never)
  // startup_timeout_s (rendezvous and set-up: every rank arrived), collective_timeout_s
  // (one collective of a step, and every other one not below; the trainer's 100 s: see the
  // constructor), check_collectives (agree on every collective before it runs) and
  // flight_entries (collectives each communicator remembers for a dump; 0 = off), bound
  // into the runtime's options; its backend follows run.backend (runtimeOptions()).
  distributed::RuntimeOptions runtime;
  // checkpoint_timeout_s: a collective of a checkpoint save or load, or of an export (they
  // wait for file writes), and how long rank 0 waits for the others' parts of a save.
  std::chrono::milliseconds checkpoint_timeout = std::chrono::seconds(600);
};

// fault.*: a lost rank under fault.survive (docs/troubleshooting.md, "A lost replica group").
struct FaultSection {
  // A lost rank's replica group (hybrid: its shard group; no_shard: its node) leaves the run
  // and the other groups go on in-process with the same global batch: no restart, no
  // checkpoint read (trainer/replica_groups.h).
  bool survive = false;
  // How long rank 0 waits for the live ranks to report after a loss before it names who
  // goes on (a lost group never reports, so every recovery waits this long).
  std::chrono::milliseconds quorum_wait = std::chrono::milliseconds(500);
  // A rank stopped (SIGSTOP, a frozen host) or silent this long is lost: shm's collectives
  // see a stopped peer's process after it, the heartbeats (1 per 100 ms) of a silent one
  // after it over gloo and after twice it over shm, where they are the backstop.
  std::chrono::milliseconds lost_after = std::chrono::milliseconds(1000);
};

// A model's EMA: the library's options (ema/ema_manager.h) and what the trainer does
// around it.
struct EmaConfig {
  bool enabled = true;                    // ema.enabled
  ema::EmaOptions options;                // ema.decays, dtype, ..., posthoc.stds (prefix: the model's EMA name)
  std::optional<std::string> initFrom;    // ema.init_from: safetensors every profile starts from (fresh runs)
  int64_t snapshotEvery = 0;              // ema.posthoc.snapshot_every: steps between post-hoc snapshots (and the last)
};

// checkpoint.local: the node-local tier (checkpoint/local_tier.h).
struct LocalTierSection {
  int64_t every_steps = 0;  // save to the node-local tier every N steps (0: no local tier)
  // checkpoint.local.dir ("": /dev/shm/tessera-<uid>/<run.dir's hash>), replicas and
  // keep_last, bound into the library's options (the run fills in the rest: localTierOptions).
  checkpoint::LocalTierOptions tier;
};

struct CheckpointSection {
  CheckpointSection();
  int64_t every_steps = 0;       // save every N steps (0: only at the end)
  bool at_end = true;            // save when the run finishes (or is preempted by SIGTERM)
  // checkpoint.keep_last and checkpoint.async, bound into the library's options (the
  // trainer keeps 3 and writes in the background: see the constructor); its commitTimeout
  // is diagnostics.checkpoint_timeout_s.
  checkpoint::CheckpointOptions writer;
  std::string resume = "auto";   // auto | none | a checkpoint directory
  LocalTierSection local;        // checkpoint.local.*
  std::vector<std::string> export_what = {"generator_ema"};  // exported at the end of the run
  at::ScalarType export_dtype = at::kFloat;  // fp32 | bf16 | fp16
};

// Where a model's state lives in checkpoints (the keys of its components, sharding/
// stateful.h) and the names it is exported under. The single-model form keeps the names
// runs always had; a models: entry gets its own.
struct ModelStateNames {
  std::string weights;    // its weights' key, also its export name: "model" | "<name>"
  std::string optimizer;  // its optimizer state's key: "optim" | "optim/<name>"
  std::string ema;        // its EMA's name: "<name>_ema", "generator_ema" for a single diffusion model
  // The name the single-model form's EMA had before it followed the model ("generator_ema"),
  // kept as an export alias and read from older checkpoints; "" when it is the name.
  std::string formerEma;
};

// One model of a run. The sharding, optim and ema sections bind the library's own option
// structs; where the trainer's defaults differ from the library's, the constructor says so.
struct ModelEntry {
  ModelEntry();
  std::string name = "model";
  models::ModelOptions model;                    // model.* (arch and its shape)
  bool trainable = true;                 // false: frozen (no optimizer, no EMA); sharded and saved all the same
  sharding::StrategyOptions sharding;    // sharding.*; optim.* but lr and schedule (sharding.optimizer);
                                         // optim.grad_clip (sharding.gradClip)
  bool reduceEveryMicroBatch = true;     // sharding.reduce_every_micro_batch
  optim::LrScheduleOptions schedule;  // optim.lr, optim.schedule.* (totalSteps: run.steps)
  double muonAdamwLr = 0;                // optim.muon.adamw_lr (0: optim.lr); into muon.adamwLrScale
  EmaConfig ema;                         // ema.*
  ModelStateNames names;                 // set when the config is finished
  // Set with the names: how the log names it ("model" | "model <name>"), and what the seed
  // of its initial values is salted with ("" for the single-model form, which starts
  // from run.seed as runs always had; its name for a models: entry, so that two models of
  // one architecture do not start equal).
  std::string displayName, seedSalt;
  // Whether it keeps an EMA: ema.enabled, and trainable (a frozen model's weights are what
  // they are, whatever its inherited ema.enabled says).
  bool hasEma() const { return trainable && ema.enabled; }
  // Its keys as messages name them: model keys modelKeys + key ("model.arch" |
  // "models.<name>.arch"), section keys sectionKeys + key ("optim.lr" | "models.<name>.optim.lr").
  std::string modelKeys = "model.", sectionKeys;
};

struct TrainConfig {
  RunOptions run;
  LogSection log;
  ProfileSection profile;
  DiagnosticsSection diagnostics;
  FaultSection fault;
  EvalSection eval;
  datasets::DataOptions data;
  CheckpointSection checkpoint;
  // Each recipe's own keys, bound by its RecipeSpec::bindKeys into a struct of the
  // recipe's, kept here by recipe name (recipeOptions<T>(): a checked cast).
  std::map<std::string, std::any> recipeKeys;
  // The top-level model, sharding, optim and ema sections: the one model of the
  // single-model form, or the defaults every models: entry inherits.
  ModelEntry defaults;
  // The models the run trains, in the order the config names them, each with its names set
  // (finishTrainConfig): the models: entries, or the single-model form as one entry named
  // "model". A deque keeps the entries' key bindings valid.
  std::deque<ModelEntry> models;
  bool singleModelForm = true;  // the config has no models: section
  // Where each key's value was written (file:line:column or --set), for the checks made
  // once the run starts: a data file that is missing names the line or the --set.
  config::KeyOrigins origins;
  // What the checks found worth saying but not refusing; the run logs them at its start.
  std::vector<std::string> warnings;
};

// The struct recipe `recipe` binds its keys into, made on first use (by its bindKeys).
// std::bad_any_cast when `recipe` keeps another type.
template <typename T>
T& recipeOptions(TrainConfig& config, const std::string& recipe) {
  std::any& slot = config.recipeKeys[recipe];
  if (!slot.has_value()) slot = T{};
  return std::any_cast<T&>(slot);
}
// The same, read-only; its defaults when the recipe bound no keys into this config.
template <typename T>
const T& recipeOptions(const TrainConfig& config, const std::string& recipe) {
  static const T defaults;
  const auto it = config.recipeKeys.find(recipe);
  return it == config.recipeKeys.end() || !it->second.has_value() ? defaults : std::any_cast<const T&>(it->second);
}

// One thing a run can export (checkpoint.export) and the state prefix its tensors live under:
// a model's weights ("model" -> "model/") or an EMA profile by each of its names
// ("generator_ema", "generator_ema_0.9999" -> "ema/generator_ema/").
struct ExportName {
  std::string name;
  std::string prefix;
};
// Every name the run's config gives its exports, in the models' order: the one list the
// config's checks, the exports at the end, and the export metadata read
// (checkpoint::collectExportNames of the run's components is the same, checked at set-up).
std::vector<ExportName> runExportNames(const TrainConfig& config);

// Registers every key of `config` with `schema` (the variables are bound by pointer),
// each added recipe's own keys too (RecipeSpec::bindKeys).
void bindTrainConfig(config::ConfigSchema& schema, TrainConfig& config);

// What follows loading the file and the overrides: the required keys, the models:
// entries inheriting what they do not set from the top-level sections (or the single-model
// form made the one entry), every model's names, and the checks across keys (e.g.
// global_batch divisible by micro_batch x world size, the models the recipe needs); throws
// ConfigError naming the keys and where they were set.
void finishTrainConfig(config::ConfigSchema& schema, TrainConfig& config, int worldSize);

// The data split of `c` for a world of `worldSize` ranks, as finishTrainConfig makes it: the
// global batch kept, data.micro_batch lowered to what divides a rank's share (the size asked
// for first). fault.survive calls it for the world that goes on. ConfigError naming the key
// when the world cannot take the global batch.
void fitBatchToWorld(TrainConfig& c, int worldSize);

// Loads `file` (if not empty), then each "a.b=c" override, then checks required keys.
// Returns the resolved YAML text alongside the config.
struct LoadedConfig {
  TrainConfig config;
  std::string resolvedYaml;
};
LoadedConfig loadTrainConfig(const std::string& file, const std::vector<std::string>& overrides, int worldSize);

}  // namespace tessera::trainer
