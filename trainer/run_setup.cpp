// Builds the parts of a training run and resumes it (see run_setup.h).
#include "trainer/run_setup.h"

#include <torch/cuda.h>
#include <torch/utils.h>

#include <cstdlib>

#include "checkpoint/reader.h"
#include "checkpoint/safetensors.h"
#include "trainer/layers.h"
#include "trainer/metrics.h"
#include "common/errors.h"
#include "common/file_open.h"
#include "common/logging.h"
#include "distributed/communicator.h"
#include "ema/strategy_ema.h"
#include "sharding/mixed_precision.h"

namespace tessera::trainer {
namespace fs = std::filesystem;

namespace {

// run.device: the CPU, or this rank's CUDA device (LOCAL_RANK modulo the devices visible,
// so ranks of a node spread over its GPUs and share them when there are fewer).
at::Device trainingDevice(const TrainConfig& cfg) {
  if (cfg.run.device == "cpu") return at::kCPU;
  TESSERA_CHECK_AS(ConfigError, torch::cuda::is_available(),
                   "run.device: cuda, but no CUDA device is usable here (a CPU-only LibTorch, or no GPU visible); "
                   "build with scripts/gpu-build.sh on a GPU machine, or set run.device: cpu");
  const char* localRank = std::getenv("LOCAL_RANK");
  const int64_t index = (localRank != nullptr ? std::atoll(localRank) : 0) % torch::cuda::device_count();
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
}

sharding::StrategyOptions strategyOptions(const TrainConfig& cfg, const TrainModel& model) {
  sharding::StrategyOptions o;
  o.strategy = cfg.sharding.strategy;
  o.bucketBytes = static_cast<int64_t>(cfg.sharding.bucket_mb * 1024 * 1024);
  o.paramDtype = sharding::parseFloatDtype(cfg.sharding.param_dtype, "sharding.param_dtype");
  o.reduceDtype = sharding::parseFloatDtype(cfg.sharding.reduce_dtype, "sharding.reduce_dtype");
  o.bufferSync = cfg.sharding.buffer_sync;
  o.gradClip = cfg.optim.grad_clip;
  o.optimizer.name = cfg.optim.name;
  o.optimizer.beta1 = cfg.optim.betas[0];
  o.optimizer.beta2 = cfg.optim.betas[1];
  o.optimizer.eps = cfg.optim.eps;
  o.optimizer.weightDecay = cfg.optim.weight_decay;
  o.optimizer.momentum = cfg.optim.momentum;
  o.optimizer.nesterov = cfg.optim.nesterov;
  o.fullyShard.reshardAfterForward = cfg.sharding.reshard_after_forward;
  o.fullyShard.prefetch = static_cast<int>(cfg.sharding.prefetch);
  o.fullyShard.minUnitParams = cfg.sharding.min_unit_params;
  o.fullyShard.activationCheckpointing = cfg.sharding.activation_checkpointing;
  o.fullyShard.shardSize = static_cast<int>(cfg.sharding.shard_size);
  o.wrap = cfg.sharding.wrap.empty() ? defaultUnits(cfg.model) : cfg.sharding.wrap;
  // The model is built deferred: each rank initialises only what it holds, with values
  // that depend on run.seed and the parameter names alone.
  o.initializer = layers::initializerOf(model, static_cast<uint64_t>(cfg.run.seed));
  return o;
}

sharding::LrScheduleOptions scheduleOptions(const TrainConfig& cfg) {
  sharding::LrScheduleOptions o;
  o.kind = cfg.optim.schedule.kind;
  o.baseLr = cfg.optim.lr;
  o.warmupSteps = cfg.optim.schedule.warmup_steps;
  o.totalSteps = cfg.run.steps;
  o.minLr = cfg.optim.schedule.min_lr;
  o.stepSize = cfg.optim.schedule.step_size;
  o.gamma = cfg.optim.schedule.gamma;
  return o;
}

std::unique_ptr<ema::ShardedModelEMAManager> makeEma(const TrainConfig& cfg, const sharding::ShardingStrategy& strategy) {
  if (!cfg.ema.enabled) return nullptr;
  ema::EmaOptions o;
  o.decays = cfg.ema.decays;
  o.dtype = sharding::parseFloatDtype(cfg.ema.dtype, "ema.dtype");
  o.startStep = cfg.ema.start_step;
  o.updateEvery = cfg.ema.update_every;
  o.warmup = cfg.ema.warmup;
  o.invGamma = cfg.ema.inv_gamma;
  o.power = cfg.ema.power;
  o.buffers = cfg.ema.buffers;
  o.powerStds = cfg.ema.posthoc.stds;
  auto manager = std::make_unique<ema::ShardedModelEMAManager>(o);
  ema::followStrategy(*manager, strategy);
  return manager;
}

// Checkpoints are written over the group the state is sharded over, by the ranks holding
// a full set of it (hybrid: the first replica group; the others skip).
void setUpCheckpointer(RunParts& run) {
  if (!run.strategy->firstReplica()) return;
  checkpoint::CheckpointOptions options;
  options.keepLast = static_cast<int>(run.cfg.checkpoint.keep_last);
  options.async = run.cfg.checkpoint.async;
  run.checkpointer.emplace((run.runDir / "checkpoints").string(), run.strategy->stateCommPtr(), options);
  if (run.ema && !run.cfg.ema.posthoc.stds.empty()) {
    // Post-hoc EMA snapshots: every one kept (keep_last 0), written synchronously (an
    // async writer would keep a second staging copy of the profiles).
    checkpoint::CheckpointOptions posthoc;
    run.posthocWriter.emplace((run.runDir / "posthoc").string(), run.strategy->stateCommPtr(), posthoc);
  }
}

// checkpoint.resume: loads the newest complete checkpoint ("auto", falling back to older
// ones when one fails verification on any rank) or the one named, into the run's state
// in place, and continues its counters. The data position is step x global batch, so the
// global batch and the seed must be the checkpoint's. Returns whether it resumed.
bool resume(RunParts& run) {
  const TrainConfig& cfg = run.cfg;
  if (cfg.checkpoint.resume == "none") return false;
  const std::string checkpointsDir = (run.runDir / "checkpoints").string();
  std::vector<checkpoint::StateEntry> entries = collectStateEntries(*run.strategy, run.ema.get());
  std::optional<checkpoint::LoadResult> loaded;
  if (cfg.checkpoint.resume == "auto") {
    loaded = checkpoint::resumeAuto(checkpointsDir, entries, run.comm.get());
  } else {
    // Each rank reads its own rows: all leave together when one fails.
    distributed::runOnEveryRank(run.comm.get(), "checkpoint.resume: " + cfg.checkpoint.resume,
                                [&] { loaded = checkpoint::loadCheckpoint(cfg.checkpoint.resume, entries); });
  }
  if (!loaded) return false;
  const TrainerCounters saved =
      countersFromJson(loaded->trainerState, (std::filesystem::path(loaded->dir) / "trainer_state.json").string());
  if (saved.globalBatch != cfg.data.global_batch) {
    throw ConfigError(strCat("data.global_batch: ", cfg.data.global_batch, " differs from the ", saved.globalBatch,
                             " that checkpoint ", loaded->dir, " was trained with; the data position cannot be converted"));
  }
  if (saved.seed != cfg.run.seed) {
    throw ConfigError(strCat("run.seed: ", cfg.run.seed, " differs from the ", saved.seed, " of checkpoint ",
                             loaded->dir, "; the data order would change"));
  }
  run.strategy->optimizer().checkLoadedStepCounts(saved.step, loaded->dir);
  if (run.ema) run.ema->setUpdateCount(saved.emaUpdates);
  run.strategy->publishParameters();
  run.startStep = saved.step;
  run.counters.skippedSteps = saved.skippedSteps;
  TLOG_INFO0("resumed from " << loaded->dir << " (step " << saved.step << ", saved by " << saved.worldSize
                             << " ranks with " << saved.strategy << "; now " << run.comm->worldSize()
                             << " ranks with " << cfg.sharding.strategy << "), read " << loaded->bytesRead
                             << " bytes in " << loaded->seconds << " s");
  return true;
}

// A fresh run's start from files: model.init_from into the strategy's records (each rank
// reads the rows it holds), the EMA then starting from those weights; ema.init_from into
// every EMA. Both strict: names, shapes, floating point, finite (importSafetensors), and
// agreed: a bad row that one rank reads fails every rank.
void initializeFromFiles(RunParts& run) {
  const TrainConfig& cfg = run.cfg;
  if (cfg.model.init_from) {
    checkpoint::ImportOptions options;
    options.stripPrefix = "model/";
    options.comm = run.comm.get();
    checkpoint::importSafetensors(*cfg.model.init_from, run.strategy->stateEntries("model/"), options);
    run.strategy->publishParameters();
    if (run.ema) run.ema->resetFromLive();
    TLOG_INFO0("model initialised from " << *cfg.model.init_from);
  }
  if (run.ema && cfg.ema.init_from) {
    // Fine-tuning: every EMA starts from given weights (names as the module's).
    const std::vector<checkpoint::StateEntry> entries = run.ema->stateEntries("ema/");
    for (size_t d = 0; d < run.ema->numProfiles(); ++d) {
      const std::string prefix = "ema/" + run.ema->stateName(d) + "/";
      std::vector<checkpoint::StateEntry> decay;
      for (const auto& e : entries) {
        if (e.name.compare(0, prefix.size(), prefix) == 0) decay.push_back(e);
      }
      checkpoint::ImportOptions options;
      options.stripPrefix = prefix;
      options.comm = run.comm.get();
      checkpoint::importSafetensors(*cfg.ema.init_from, decay, options);
    }
    TLOG_INFO0("EMA initialised from " << *cfg.ema.init_from);
  }
}

}  // namespace

std::unique_ptr<RunParts> setUpRun(TrainConfig config, std::string resolvedYaml,
                                   std::shared_ptr<distributed::Communicator> comm) {
  auto run = std::make_unique<RunParts>();
  run->cfg = std::move(config);
  run->resolvedYaml = std::move(resolvedYaml);
  run->comm = std::move(comm);
  const TrainConfig& cfg = run->cfg;
  const int rank = run->comm->rank();
  const int world = run->comm->worldSize();
  run->runDir = cfg.run.dir;
  fs::create_directories(run->runDir / "logs");
  if (rank == 0) replaceFile((run->runDir / "config.resolved.yaml").string(), run->resolvedYaml);

  // Data. torch's generator starts from run.seed on every rank (whatever draws from it);
  // the model's initial values do not come from it but from the strategy's initializer,
  // keyed by run.seed and parameter name, so every rank agrees on them by construction.
  torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
  run->device = trainingDevice(cfg);
  run->data = makeDataset(cfg.data, cfg.model, predictsEveryPosition(cfg.model));
  if (run->data->trainSamples() < cfg.data.global_batch) {
    throw ConfigError(strCat("data.global_batch: ", cfg.data.global_batch, " is more than the ",
                             run->data->trainSamples(), " training samples of data.path ", run->data->describe()));
  }
  run->sampler = std::make_unique<DistributedSampler>(run->data->trainSamples(), cfg.data.global_batch, cfg.run.seed,
                                                      cfg.data.shuffle);
  run->microBatches = cfg.data.global_batch / world / cfg.data.micro_batch;

  // Model (deferred: nothing allocated yet), strategy (materialises this rank's part),
  // schedule, EMA.
  // An allocation that fails (model.vocab_size 2^31) is reported with the keys that size
  // the model, without LibTorch's C++ backtrace.
  const std::string modelKeys = strCat("model (arch ", cfg.model.arch, ", vocab_size ", cfg.model.vocab_size, ", context ",
                                       cfg.model.context, ", embed_dim ", cfg.model.embed_dim, ", layers ",
                                       cfg.model.layers, ")");
  try {
    run->model = makeModel(cfg.model, run->data->spec(), run->device);
    run->strategy = sharding::makeStrategy(*run->model, run->comm, strategyOptions(cfg, *run->model));
  } catch (const c10::Error& e) {
    throw ConfigError(strCat(modelKeys, ": this rank's part cannot be built: ", e.what_without_backtrace()));
  } catch (const std::bad_alloc&) {
    throw ConfigError(strCat(modelKeys, ": this rank's part does not fit in memory"));
  }
  run->schedule = std::make_unique<sharding::LrSchedule>(scheduleOptions(cfg));
  run->ema = makeEma(cfg, *run->strategy);
  int64_t numParams = 0;
  for (const auto& p : run->model->parameters()) numParams += p.numel();
  TLOG_INFO0("run " << cfg.run.name << ": model " << cfg.model.arch << ": " << numParams << " parameters; strategy " << cfg.sharding.strategy
                      << " over " << world << " ranks; resident " << run->strategy->residentBytes().str()
                      << "; peak RSS so far " << peakRssMiB() << " MiB");
  TLOG_INFO0("data " << run->data->describe() << "; " << run->sampler->stepsPerEpoch() << " steps per epoch; "
                     << run->microBatches << " micro-batches of " << cfg.data.micro_batch << " per rank per step");

  // Checkpointer and resume.
  setUpCheckpointer(*run);
  run->counters.globalBatch = cfg.data.global_batch;
  run->counters.seed = cfg.run.seed;
  run->counters.strategy = cfg.sharding.strategy;
  run->counters.worldSize = world;
  run->counters.resolvedConfig = run->resolvedYaml;
  if (!resume(*run)) initializeFromFiles(*run);  // a resumed run keeps the checkpoint's weights
  TESSERA_CHECK_AS(ConfigError, run->startStep <= cfg.run.steps, "run.steps: ", cfg.run.steps,
                   " is below the step the run resumes from (", run->startStep, ")");
  return run;
}

}  // namespace tessera::trainer
