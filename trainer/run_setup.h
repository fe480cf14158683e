// The set-up of one training run: the parts Trainer::run drives (trainer.cpp), built
// from a TrainConfig in order — data, then each model with its sharding strategy,
// schedule and EMA, then the checkpointer — and resumed from the newest checkpoint when
// there is one.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpointer.h"
#include "checkpoint/local_tier.h"
#include "checkpoint/state.h"
#include "distributed/rank_env.h"
#include "distributed/runtime.h"
#include "ema/ema_manager.h"
#include "optim/lr_schedule.h"
#include "sharding/strategy.h"
#include "models/models.h"
#include "datasets/text_dataset.h"
#include "trainer/train_config.h"
#include "trainer/train_counters.h"

namespace tessera::distributed {
class Communicator;
}

namespace tessera::trainer {

// One model of the run with everything that holds its state.
struct ModelPart {
  ModelEntry cfg;                                    // its keys and state names
  std::shared_ptr<models::TrainModel> model;
  std::unique_ptr<sharding::ShardingStrategy> strategy;
  std::unique_ptr<optim::LrSchedule> schedule;    // null for a frozen model
  std::unique_ptr<ema::ShardedModelEMAManager> ema;  // null without an EMA

  // Its components as the run's checkpoint holds them (checkpoint/state.h): the strategy
  // (fp32 masters, buffers) under cfg.names.weights ("model" | "<name>"), the optimizer
  // (exp_avg, exp_avg_sq, momentum_buffer, step counts) under cfg.names.optimizer ("optim"
  // | "optim/<name>"; none for a frozen model), the EMA under "ema" (its profiles by name:
  // generator_ema, generator_ema_0.999, ...). Loading the same names with another run's
  // specs reshards them.
  checkpoint::StateMap states();
};

struct RunParts {
  TrainConfig cfg;
  std::string resolvedYaml;                         // saved as <run.dir>/config.resolved.yaml
  std::shared_ptr<distributed::Communicator> comm;  // the world: parameters and gradients (gloo or nccl)
  // comm's host twin (gloo): checkpoints, exports, metrics and every agreement on CPU tensors.
  std::shared_ptr<distributed::Communicator> hostComm;
  std::filesystem::path runDir;
  at::Device device = at::kCPU;                     // run.device: the CPU or this rank's GPU

  std::unique_ptr<datasets::Dataset> data;
  std::unique_ptr<datasets::DistributedSampler> sampler;      // global batch of a step -> this rank's samples
  int64_t microBatches = 1;                         // passes per rank and step (gradient accumulation)
  // run.deterministic: the step's micro-batches over the ranks (sharding/canonical_reduce.h).
  std::optional<sharding::MicroBatchPlan> plan;
  // What each micro-batch's mean loss is divided by: this rank's micro-batches, or under
  // run.deterministic the step's (their canonical sum is then the step's mean).
  int64_t lossDivisor = 1;
  // This rank's positions [begin, end) in every global batch, in micro-batch order.
  std::pair<int64_t, int64_t> samplePositions() const;
  // The models, in the order the config names them; the single-model form has one,
  // named "model".
  std::vector<ModelPart> models;
  // On the ranks that write checkpoints and exports: all, but hybrid's first replica group only.
  std::optional<checkpoint::Checkpointer> checkpointer;
  std::optional<checkpoint::Checkpointer> posthocWriter;  // ema.posthoc: snapshots in <run.dir>/posthoc/
  std::optional<checkpoint::LocalCheckpointer> localCheckpointer;  // checkpoint.local.every_steps

  TrainerCounters counters;                         // what trainer_state.json holds
  int64_t startStep = 0;                            // steps done before this invocation (resume)

  // The model named `name` (tessera::Error if there is none).
  ModelPart& model(const std::string& name);
  // Every model's components together: the run's checkpoint.
  checkpoint::StateMap states();
  // The strategies in one line for logs and the checkpoint ("zero3", or
  // "generator:zero3 critic:zero2 teacher:zero3").
  std::string strategies() const;
};

// How this rank's Runtime starts for `cfg`: the backend of run.backend (auto: nccl when
// run.device is cuda, the build has nccl and this node has a GPU per rank; else gloo).
// ConfigError naming run.backend when nccl is asked for and cannot work here.
distributed::RuntimeOptions runtimeOptions(const TrainConfig& cfg, const distributed::RankEnv& env);

// The flight recorder as diagnostics.* says: its size, its dump files
// (<run.dir>/flight/rank_<r>.json, and the launcher's copy), its SIGUSR1/SIGTERM dumps and
// the dump on an uncaught error. Call once, before the runtime starts.
void startFlightRecorder(const TrainConfig& cfg, const distributed::RankEnv& env);

// Builds every part and resumes (checkpoint.resume): every rank loads its own shards,
// resharding as needed, and the counters continue where the checkpoint left off. A fresh
// run starts from its initial distribution (each rank initialising only what it holds), or
// from each model's init_from / ema.init_from. Collective: the strategies materialise the
// models, the resume agrees on the checkpoint.
std::unique_ptr<RunParts> setUpRun(TrainConfig config, std::string resolvedYaml,
                                   std::shared_ptr<distributed::Communicator> comm);

// fault.survive: the run's parts over `comm`, the world that went on after a replica group
// was lost, after `stepsDone` steps, with this rank's state taken from `previous` (its parts
// before the loss) and no file read: no claim of run.dir, no resume, no initialisation. The
// global batch is kept (fitBatchToWorld). Throws tessera::Error when a state's layout differs
// on the new world.
std::unique_ptr<RunParts> setUpRunFrom(RunParts& previous, int64_t stepsDone,
                                       std::shared_ptr<distributed::Communicator> comm);

// fault.survive, on a rank rejoining the world of `comm` after `stepsDone` steps
// (`skippedSteps` of them skipped): the run's parts with no state of their own yet (no file
// read); shareState() gives them their counterpart's.
std::unique_ptr<RunParts> setUpRunToJoin(TrainConfig config, std::string resolvedYaml, int64_t stepsDone,
                                         int64_t skippedSteps, std::shared_ptr<distributed::Communicator> comm);

// After a rejoin, collective over `counterparts` (one rank per replica group, each holding the
// same place in it): every state entry of `run` broadcast from `root`, a live rank, to the
// joining ones. tessera::Error when the two sides' entries differ.
void shareState(RunParts& run, distributed::Communicator& counterparts, int root);

}  // namespace tessera::trainer
