// The set-up of one training run: the parts Trainer::run drives (trainer.cpp), built
// from a TrainConfig in order — data, model, sharding strategy, EMA, checkpointer — and
// resumed from the newest checkpoint when there is one.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
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
#include "trainer/train_state.h"

namespace tessera::distributed {
class Communicator;
}

namespace tessera::trainer {

struct RunParts {
  TrainConfig cfg;
  std::string resolvedYaml;                         // saved as <run.dir>/config.resolved.yaml
  std::shared_ptr<distributed::Communicator> comm;  // the world
  std::filesystem::path runDir;
  at::Device device = at::kCPU;                     // run.device: the CPU or this rank's GPU

  std::unique_ptr<Dataset> data;
  std::unique_ptr<DistributedSampler> sampler;      // global batch of a step -> this rank's samples
  int64_t microBatches = 1;                         // per rank and step (gradient accumulation)
  std::shared_ptr<TrainModel> model;
  std::unique_ptr<sharding::ShardingStrategy> strategy;
  std::unique_ptr<sharding::LrSchedule> schedule;
  std::unique_ptr<ema::ShardedModelEMAManager> ema; // null without ema.enabled
  // On the ranks that write checkpoints and exports: all, but hybrid's first replica group only.
  std::optional<checkpoint::Checkpointer> checkpointer;
  std::optional<checkpoint::Checkpointer> posthocWriter;  // ema.posthoc: snapshots in <run.dir>/posthoc/

  TrainerCounters counters;                         // what trainer_state.json holds
  int64_t startStep = 0;                            // steps done before this invocation (resume)
};

// Builds every part and resumes (checkpoint.resume): every rank loads its own shards,
// resharding as needed, and the counters continue where the checkpoint left off. A fresh
// run starts from its initial distribution (each rank initialising only what it holds), or
// from model.init_from / ema.init_from. Collective: the strategy materialises the model,
// the resume agrees on the checkpoint.
std::unique_ptr<RunParts> setUpRun(TrainConfig config, std::string resolvedYaml,
                                   std::shared_ptr<distributed::Communicator> comm);

}  // namespace tessera::trainer
