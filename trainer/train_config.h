// The run configuration of tessera-train: typed options with in-class defaults, bound
// to YAML keys by bindTrainConfig(). configs/README.md documents every key (a test
// checks that), and configs/default.yaml is the main job's config.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

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
  std::string recipe = "standard";  // standard (the one `model`) | dmd (models generator, critic, teacher)
};

struct LogSection {
  std::string level = "info";  // trace|debug|info|warn|error|off; TESSERA_LOG_LEVEL overrides when set
  bool per_rank_files = true;  // also write <run.dir>/logs/rank_N.log
};

struct ModelOptions {
  std::string arch = "mlp";             // mlp | gpt | diffusion
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
  int64_t samples = 0;                  // diffusion: samples drawn with generator_ema at the end (0: none)
  std::optional<std::string> init_from; // safetensors file or *.index.json to start from (fresh runs)
};

struct DataOptions {
  std::string kind = "text";   // text (byte-level) | tokens (flat uint16/uint32 ids) | tensors (safetensors)
  std::string path = "";       // input file; required
  std::string token_dtype = "uint16";  // tokens: uint16 | uint32
  int64_t global_batch = 32;   // samples per optimizer step over all ranks
  int64_t micro_batch = 16;    // samples per forward/backward on one rank
  bool shuffle = true;         // seeded shuffle per epoch; false reads in file order
  double eval_fraction = 0.05; // tail of the file held out for evaluation
};

struct ScheduleOptions {
  std::string kind = "constant";  // constant | cosine | linear | step
  int64_t warmup_steps = 0;
  double min_lr = 0.0;            // floor of cosine / linear decay
  int64_t step_size = 100;        // step decay period
  double gamma = 0.1;             // step decay factor
};

struct OptimOptions {
  std::string name = "adamw";              // adamw | adam | sgd
  double lr = 3.0e-4;
  std::vector<double> betas = {0.9, 0.999};
  double eps = 1.0e-8;
  double weight_decay = 0.01;
  double momentum = 0.0;                   // sgd only
  bool nesterov = false;                   // sgd only
  double grad_clip = 0.0;                  // max global grad norm; 0 = off
  ScheduleOptions schedule;
};

struct ShardingOptions {
  std::string strategy = "no_shard";  // no_shard | zero1 | zero2 | zero3 | hybrid
  double bucket_mb = 25.0;            // gradient bucket size in MiB
  std::string param_dtype = "fp32";   // compute dtype: fp32 | bf16 | fp16
  std::string reduce_dtype = "fp32";  // gradient reduction dtype
  std::string buffer_sync = "broadcast";  // broadcast | average | none
  // zero3 / hybrid
  bool reshard_after_forward = true;
  int64_t prefetch = 1;
  bool activation_checkpointing = false;
  bool reduce_every_micro_batch = true;  // false: accumulate full gradients, reduce at the last micro-batch
  int64_t shard_size = 0;         // hybrid: ranks per shard group (0 = all)
  std::vector<std::string> wrap;  // unit name patterns; empty = the model's blocks
  int64_t min_unit_params = 1000000;  // wrapped modules smaller than this are not units
};

struct EmaSection {
  bool enabled = true;
  std::vector<double> decays = {0.999};
  std::string dtype = "fp32";   // fp32 | bf16
  int64_t start_step = 0;
  int64_t update_every = 1;
  bool warmup = false;
  double inv_gamma = 1.0;
  double power = 2.0 / 3.0;
  std::string buffers = "copy";  // copy | average
  std::optional<std::string> init_from;  // safetensors file or *.index.json every EMA starts from (fresh runs)
  struct Posthoc {
    std::vector<double> stds;     // sigma_rel of the power-function profiles tracked (empty: off)
    int64_t snapshot_every = 0;   // steps between snapshots in <run.dir>/posthoc/
  } posthoc;
};

struct CheckpointSection {
  int64_t every_steps = 0;       // save every N steps (0: only at the end)
  bool at_end = true;            // save when the run finishes (or is preempted by SIGTERM)
  int64_t keep_last = 3;         // newest complete checkpoints kept (0: all)
  bool async = true;             // write in a background thread
  std::string resume = "auto";   // auto | none | a checkpoint directory
  std::vector<std::string> export_what = {"generator_ema"};  // exported at the end of the run
  std::string export_dtype = "fp32";  // fp32 | bf16 | fp16
};

// run.recipe dmd: distribution-matching distillation (trainer/dmd_recipe.h).
struct RecipeOptions {
  static constexpr int64_t kMaxCriticSteps = 1000;
  int64_t critic_steps = 1;  // critic updates per generator update, at most kMaxCriticSteps
  double min_t = 0.02;       // the generator's samples are noised at t in [min_t, max_t] x T
  double max_t = 0.98;
  double regression_weight = 0.25;  // weight of DMD's regression loss to the teacher's samples (0: off)
  int64_t regression_pairs = 1024;  // noise -> teacher sample pairs it regresses on
  int64_t pair_steps = 50;          // DDIM steps the teacher takes for each pair
};

// Where a model's state lives in checkpoints (the keys of its components, sharding/
// stateful.h) and the names it is exported under. The single-model form keeps the names
// runs always had; a models: entry gets its own.
struct ModelStateNames {
  std::string weights;    // its weights' key, also its export name: "model" | "<name>"
  std::string optimizer;  // its optimizer state's key: "optim" | "optim/<name>"
  std::string ema;        // its EMA's name: "generator_ema" | "<name>_ema"
};

// One model of a run: a models: entry (its sections default to the top-level ones), or the
// single-model form's top-level sections under the name "model".
struct ModelEntry {
  std::string name;
  ModelOptions model;
  bool trainable = true;  // false: frozen (no optimizer, no EMA); its weights are sharded and saved all the same
  ShardingOptions sharding;
  OptimOptions optim;
  EmaSection ema;
  ModelStateNames names;  // set by runModels()
  // Its keys as messages name them, set by runModels(): model keys are modelKeys + key
  // ("model.arch" | "models.<name>.arch"), section keys sectionKeys + key ("optim.lr" |
  // "models.<name>.optim.lr").
  std::string modelKeys, sectionKeys;
};

struct TrainConfig {
  RunOptions run;
  LogSection log;
  ModelOptions model;
  DataOptions data;
  OptimOptions optim;
  ShardingOptions sharding;
  EmaSection ema;
  CheckpointSection checkpoint;
  RecipeOptions recipe;
  std::deque<ModelEntry> models;  // the models: form (empty: the single-model form); a deque keeps the keys' bindings valid
};

// The models the run trains, each with its state names: the models: entries in the order
// the config names them, or the single-model form as one entry named "model".
std::vector<ModelEntry> runModels(const TrainConfig& config);

// Registers every key of `config` with `schema` (the variables are bound by pointer).
void bindTrainConfig(config::ConfigSchema& schema, TrainConfig& config);

// What follows loading the file and the overrides: the required keys, the models:
// entries inheriting what they do not set from the top-level sections, and the checks
// across keys (e.g. global_batch divisible by micro_batch x world size, the models a
// recipe needs); throws ConfigError naming the keys and where they were set.
void finishTrainConfig(config::ConfigSchema& schema, TrainConfig& config, int worldSize);

// Loads `file` (if not empty), then each "a.b=c" override, then checks required keys.
// Returns the resolved YAML text alongside the config.
struct LoadedConfig {
  TrainConfig config;
  std::string resolvedYaml;
};
LoadedConfig loadTrainConfig(const std::string& file, const std::vector<std::string>& overrides, int worldSize);

}  // namespace tessera::trainer
