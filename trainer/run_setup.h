// The set-up of one training run: the parts Trainer::run drives (trainer.cpp), built
// from a TrainConfig in order — data, then each model with its sharding strategy,
// schedule and EMA, then the checkpointer — and resumed from the newest checkpoint when
// there is one.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpointer.h"
#include "ema/ema_manager.h"
#include "sharding/lr_schedule.h"
#include "sharding/strategy.h"
#include "trainer/models.h"
#include "trainer/text_dataset.h"
#include "trainer/train_config.h"
#include "trainer/train_counters.h"

namespace tessera::distributed {
class Communicator;
}

namespace tessera::trainer {

// One model of the run with everything that holds its state.
struct ModelPart {
  ModelEntry cfg;                                    // its keys and state names
  std::shared_ptr<TrainModel> model;
  std::unique_ptr<sharding::ShardingStrategy> strategy;
  std::unique_ptr<sharding::LrSchedule> schedule;    // null for a frozen model
  std::unique_ptr<ema::ShardedModelEMAManager> ema;  // null without an EMA

  // Its tensors as checkpoint entries, each collected from the part that owns it (the
  // checkpoint's tensor names; exports strip the prefix back to the module's names):
  //   <weights><param>, <weights><buffer>   the strategy: fp32 masters, buffers
  //   <optimizer><state>/<param>            the optimizer: exp_avg, exp_avg_sq, momentum_buffer
  //   <optimizer>step/<param>               its step count (int64, replicated)
  //   ema/<ema name>/<param>                the EMA: generator_ema, generator_ema_0.999, ...
  // with <weights> = "model/", <optimizer> = "optim/" for the single-model form and
  // "<name>/", "optim/<name>/" for a models: entry (cfg.names). Frozen models have no
  // optimizer state. Loading the same names with another run's specs reshards them.
  std::vector<checkpoint::StateEntry> stateEntries();
  // Export names -> tensor-name prefixes: the model's name and its EMA's names.
  std::map<std::string, std::string> exportAliases() const;
};

struct RunParts {
  TrainConfig cfg;
  std::string resolvedYaml;                         // saved as <run.dir>/config.resolved.yaml
  std::shared_ptr<distributed::Communicator> comm;  // the world
  std::filesystem::path runDir;
  at::Device device = at::kCPU;                     // run.device: the CPU or this rank's GPU

  std::unique_ptr<Dataset> data;
  std::unique_ptr<DistributedSampler> sampler;      // global batch of a step -> this rank's samples
  int64_t microBatches = 1;                         // per rank and step (gradient accumulation)
  // The models, in the order the config names them; the single-model form has one,
  // named "model".
  std::vector<ModelPart> models;
  // On the ranks that write checkpoints and exports: all, but hybrid's first replica group only.
  std::optional<checkpoint::Checkpointer> checkpointer;
  std::optional<checkpoint::Checkpointer> posthocWriter;  // ema.posthoc: snapshots in <run.dir>/posthoc/

  TrainerCounters counters;                         // what trainer_state.json holds
  int64_t startStep = 0;                            // steps done before this invocation (resume)

  // The model named `name` (tessera::Error if there is none).
  ModelPart& model(const std::string& name);
  // Every model's checkpoint entries and export aliases together: the run's checkpoint.
  std::vector<checkpoint::StateEntry> stateEntries();
  std::map<std::string, std::string> exportAliases() const;
  // The strategies in one line for logs and the checkpoint ("zero3", or
  // "generator:zero3 critic:zero2 teacher:zero3").
  std::string strategies() const;
};

// Builds every part and resumes (checkpoint.resume): every rank loads its own shards,
// resharding as needed, and the counters continue where the checkpoint left off. A fresh
// run starts from its initial distribution (each rank initialising only what it holds), or
// from each model's init_from / ema.init_from. Collective: the strategies materialise the
// models, the resume agrees on the checkpoint.
std::unique_ptr<RunParts> setUpRun(TrainConfig config, std::string resolvedYaml,
                                   std::shared_ptr<distributed::Communicator> comm);

}  // namespace tessera::trainer
