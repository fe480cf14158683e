// The train loop (see trainer.h).
#include "trainer/trainer.h"

#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/utils.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <optional>

#include "common/errors.h"
#include "common/logging.h"
#include "distributed/communicator.h"
#include "checkpoint/checkpointer.h"
#include "checkpoint/exporter.h"
#include "checkpoint/reader.h"
#include "checkpoint/safetensors.h"
#include "ema/ema_manager.h"
#include "ema/strategy_ema.h"
#include "sharding/lr_schedule.h"
#include "sharding/fully_shard.h"
#include "sharding/strategy.h"
#include "trainer/diffusion.h"
#include "trainer/metrics.h"
#include "trainer/models.h"
#include "trainer/text_dataset.h"
#include "trainer/train_state.h"

namespace tessera::trainer {
namespace fs = std::filesystem;

struct Trainer::State {
  TrainConfig config;
  std::string resolvedYaml;
  std::shared_ptr<distributed::Communicator> comm;
};

namespace {

// Set by SIGTERM (preemption) or SIGINT (Ctrl-C): the loop checkpoints and stops at the
// next step.
std::atomic<bool> g_stopRequested{false};
extern "C" void onStopSignal(int) { g_stopRequested = true; }

double nowSec() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

at::ScalarType parseDtype(const std::string& name) {
  if (name == "fp32") return at::kFloat;
  if (name == "bf16") return at::kBFloat16;
  if (name == "fp16") return at::kHalf;
  throw ConfigError(strCat("unknown dtype '", name, "' (fp32, bf16, fp16)"));
}

sharding::StrategyOptions strategyOptions(const TrainConfig& cfg) {
  sharding::StrategyOptions o;
  o.strategy = cfg.sharding.strategy;
  o.bucketBytes = static_cast<int64_t>(cfg.sharding.bucket_mb * 1024 * 1024);
  o.paramDtype = parseDtype(cfg.sharding.param_dtype);
  o.reduceDtype = parseDtype(cfg.sharding.reduce_dtype);
  o.bufferSync = cfg.sharding.buffer_sync;
  o.gradClip = cfg.optim.grad_clip;
  o.optimizer.name = cfg.optim.name;
  o.optimizer.lr = cfg.optim.lr;
  o.optimizer.beta1 = cfg.optim.betas[0];
  o.optimizer.beta2 = cfg.optim.betas[1];
  o.optimizer.eps = cfg.optim.eps;
  o.optimizer.weightDecay = cfg.optim.weight_decay;
  o.optimizer.momentum = cfg.optim.momentum;
  o.optimizer.nesterov = cfg.optim.nesterov;
  o.fullyShard.reshardAfterForward = cfg.sharding.reshard_after_forward;
  o.fullyShard.prefetch = static_cast<int>(cfg.sharding.prefetch);
  o.fullyShard.activationCheckpointing = cfg.sharding.activation_checkpointing;
  o.fullyShard.shardSize = static_cast<int>(cfg.sharding.shard_size);
  o.wrap = cfg.sharding.wrap.empty() ? defaultUnits(cfg.model) : cfg.sharding.wrap;
  return o;
}

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

// The loss of each prediction of `batch`, with the model's root entered as a unit
// (zero3/hybrid gather the root's parameters there; a plain call under the other
// strategies). Inputs and targets move to `device` first.
at::Tensor lossesOf(TrainModel& model, Batch batch, at::Device device) {
  batch.inputs = batch.inputs.to(device);
  if (batch.targets.defined()) batch.targets = batch.targets.to(device);
  return sharding::unitForward(model, batch.inputs, [&](const at::Tensor& inputs) {
    Batch b = batch;
    b.inputs = inputs;
    return model.losses(b);
  });
}

bool fullySharded(const sharding::ShardingStrategy& strategy) {
  return strategy.kind() == sharding::StrategyKind::kZero3 || strategy.kind() == sharding::StrategyKind::kHybrid;
}

sharding::LrSchedule makeSchedule(const TrainConfig& cfg) {
  sharding::LrScheduleOptions o;
  o.kind = cfg.optim.schedule.kind;
  o.baseLr = cfg.optim.lr;
  o.warmupSteps = cfg.optim.schedule.warmup_steps;
  o.totalSteps = cfg.run.steps;
  o.minLr = cfg.optim.schedule.min_lr;
  o.stepSize = cfg.optim.schedule.step_size;
  o.gamma = cfg.optim.schedule.gamma;
  return sharding::LrSchedule(o);
}

std::unique_ptr<ema::ShardedModelEMAManager> makeEma(const TrainConfig& cfg, sharding::ShardingStrategy& strategy) {
  if (!cfg.ema.enabled) return nullptr;
  ema::EmaOptions o;
  o.decays = cfg.ema.decays;
  o.dtype = parseDtype(cfg.ema.dtype);
  o.startStep = cfg.ema.start_step;
  o.updateEvery = cfg.ema.update_every;
  o.warmup = cfg.ema.warmup;
  o.invGamma = cfg.ema.inv_gamma;
  o.power = cfg.ema.power;
  o.buffers = cfg.ema.buffers;
  auto manager = std::make_unique<ema::ShardedModelEMAManager>(o);
  ema::followStrategy(*manager, strategy);
  return manager;
}

// Sum of the losses over this rank's share of the first `n` held-out samples, all-reduced
// to the mean over all their predictions.
double heldOutLoss(TrainModel& model, const Dataset& data, int64_t runSeed, distributed::Communicator& comm,
                   at::Device device) {
  torch::NoGradGuard noGrad;
  const int rank = comm.rank(), world = comm.worldSize();
  const int64_t n = std::min<int64_t>(data.evalSamples(), 4096);
  // Every rank must run the forward (zero3 gathers inside it): at least one sample each.
  TESSERA_CHECK_AS(ConfigError, n >= world, "evaluation: data.eval_fraction leaves ", n,
                   " held-out samples, fewer than the ", world, " ranks");
  const int64_t begin = n * rank / world, end = n * (rank + 1) / world;
  at::Tensor sums = at::zeros({2}, at::kDouble);  // [loss sum, count]
  if (end > begin) {
    Batch batch = data.evalBatch(begin, end - begin);
    std::vector<int64_t> indices(static_cast<size_t>(end - begin));
    std::iota(indices.begin(), indices.end(), begin);
    seedNoise(batch, runSeed, -1, indices);
    const at::Tensor losses = lossesOf(model, batch, device);
    sums[0] = losses.to(at::kDouble).sum().item<double>();
    sums[1] = static_cast<double>(losses.numel());  // predictions, not windows
  }
  comm.allReduce(sums, distributed::ReduceOp::kSum);
  return sums[0].item<double>() / sums[1].item<double>();
}

// Runs `fn` with the model's parameters replaced by the EMA of decay 0 and restores them
// exactly afterwards, also when `fn` throws.
// - zero3/hybrid: the EMA shards have the masters' layout, so the masters are swapped
//   (a 1/N copy kept aside) and the units reshard; fn's forward gathers the EMA.
// - no_shard/zero1/zero2: the module holds full parameters; each is replaced by the
//   gathered EMA (one full tensor at a time is gathered) and copied back afterwards.
double withEmaModel(ema::ShardedModelEMAManager& emaManager, sharding::ShardingStrategy& strategy,
                    const std::function<double()>& fn) {
  torch::NoGradGuard noGrad;
  const bool sharded = fullySharded(strategy);
  std::vector<std::pair<at::Tensor, at::Tensor>> saved;  // (tensor swapped, value to restore)
  for (const auto& name : strategy.paramNames()) {
    at::Tensor target = sharded ? strategy.masterShard(name) : strategy.moduleParam(name).variable_data();
    const at::Tensor ema = sharded ? emaManager.emaShard(0, name)
                                   : emaManager.spec(name).fullTensor(emaManager.emaShard(0, name), strategy.comm());
    saved.emplace_back(target, target.clone());
    target.copy_(ema.view(target.sizes()));
  }
  if (sharded) strategy.publishParameters();
  auto restore = [&] {
    for (auto& [target, value] : saved) target.copy_(value);
    if (sharded) strategy.publishParameters();
  };
  double result = 0;
  try {
    result = fn();
  } catch (...) {
    restore();
    throw;
  }
  restore();
  return result;
}

// model.samples: DDPM samples drawn with generator_ema (every rank runs the sampler with
// the same seed, as zero3 gathers collectively); rank 0 writes them and logs their mean and
// spread against the held-out data's. Returns the file written ("" on other ranks).
std::string drawSamples(DiffusionDenoiser& model, ema::ShardedModelEMAManager& emaManager,
                        sharding::ShardingStrategy& strategy, const Dataset& data, const TrainConfig& cfg,
                        distributed::Communicator& comm, at::Device device, const fs::path& runDir) {
  at::Tensor samples;
  withEmaModel(emaManager, strategy, [&] {
    samples = sampleDdpm(model.schedule(), model.sampleShape(), cfg.model.samples, noiseSeed(cfg.run.seed, -2, 0),
                         device, [&](const at::Tensor& x, const at::Tensor& t) {
                           return sharding::unitForward(model, std::vector<at::Tensor>{x, t},
                                                        [&](const std::vector<at::Tensor>& in) {
                                                          return std::vector<at::Tensor>{model.forward(in[0], in[1])};
                                                        })[0];
                         });
    return 0.0;
  });
  if (comm.rank() != 0) return "";
  const std::string out = (runDir / "samples.safetensors").string();
  samples = samples.cpu();
  checkpoint::saveSafetensors(out, {{"samples", samples}}, {{"generator", "generator_ema"}});
  // The reference: up to 4096 held-out samples, or train samples when none are held out.
  const bool heldOut = data.evalSamples() > 0;
  std::vector<int64_t> first(static_cast<size_t>(std::min<int64_t>(heldOut ? data.evalSamples() : data.trainSamples(), 4096)));
  std::iota(first.begin(), first.end(), 0);
  const Batch referenceBatch = heldOut ? data.evalBatch(0, static_cast<int64_t>(first.size())) : data.trainBatch(first);
  const at::Tensor reference = referenceBatch.inputs.flatten(1);
  const at::Tensor flat = samples.flatten(1);
  const double meanError = (flat.mean(0) - reference.mean(0)).abs().mean().item<double>();
  // A spread needs two samples on each side.
  const std::string spread =
      flat.size(0) > 1 && reference.size(0) > 1
          ? strCat(", spread ratio ", (flat.std(0) / reference.std(0).clamp_min(1e-12)).mean().item<double>(),
                   " (1 = the data's)")
          : std::string();
  TLOG_INFO0("samples: " << cfg.model.samples << " drawn with generator_ema; per-feature mean differs from the "
                         << (heldOut ? "held-out" : "train") << " data's by " << meanError
                         << " on average" << spread);
  return out;
}

}  // namespace

Trainer::Trainer(TrainConfig config, std::string resolvedYaml, std::shared_ptr<distributed::Communicator> comm)
    : state_(std::make_unique<State>()) {
  TESSERA_CHECK(comm != nullptr, "Trainer: no communicator");
  state_->config = std::move(config);
  state_->resolvedYaml = std::move(resolvedYaml);
  state_->comm = std::move(comm);
}

Trainer::~Trainer() = default;

TrainSummary Trainer::run() {
  const TrainConfig& cfg = state_->config;
  distributed::Communicator& comm = *state_->comm;
  const int rank = comm.rank();
  const int world = comm.worldSize();
  const fs::path runDir(cfg.run.dir);
  fs::create_directories(runDir / "logs");
  if (rank == 0) {
    std::ofstream(runDir / "config.resolved.yaml") << state_->resolvedYaml;
  }

  // Every rank builds the model from the same seed; the strategy then broadcasts rank
  // 0's parameters and buffers, so replicas agree whatever happened before.
  torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
  const at::Device device = trainingDevice(cfg);
  std::unique_ptr<Dataset> data = makeDataset(cfg.data, cfg.model, predictsEveryPosition(cfg.model));
  std::shared_ptr<TrainModel> model = makeModel(cfg.model, data->spec());
  model->to(device);
  auto strategy = sharding::makeStrategy(*model, state_->comm, strategyOptions(cfg));
  auto emaManager = makeEma(cfg, *strategy);
  const sharding::LrSchedule schedule = makeSchedule(cfg);
  int64_t numParams = 0;
  for (const auto& p : model->parameters()) numParams += p.numel();
  TLOG_INFO0("model " << cfg.model.arch << ": " << numParams << " parameters; strategy " << cfg.sharding.strategy
                      << " over " << world << " ranks; resident " << strategy->residentBytes().str());

  DistributedSampler sampler(data->trainSamples(), cfg.data.global_batch, cfg.run.seed, cfg.data.shuffle);
  // sharding.reduce_every_micro_batch false: micro-batches before the last keep full
  // gradients and do not communicate.
  auto* noSyncStrategy =
      cfg.sharding.reduce_every_micro_batch ? nullptr : dynamic_cast<sharding::FullyShardStrategy*>(strategy.get());
  const int64_t perRank = cfg.data.global_batch / world;
  const int64_t accumulation = perRank / cfg.data.micro_batch;
  TLOG_INFO0("data " << data->describe() << "; " << sampler.stepsPerEpoch()
                     << " steps per epoch; " << accumulation << " micro-batches of " << cfg.data.micro_batch
                     << " per rank per step");

  // Checkpoints: resume first (every rank loads its own shards, resharding as needed).
  const fs::path checkpointsDir = runDir / "checkpoints";
  checkpoint::CheckpointOptions ckptOptions;
  ckptOptions.keepLast = static_cast<int>(cfg.checkpoint.keep_last);
  ckptOptions.async = cfg.checkpoint.async;
  // Checkpoints and exports are written over the group the state is sharded over, by the
  // ranks holding a full set of it (hybrid: the first replica group; others skip).
  std::optional<checkpoint::Checkpointer> checkpointer;
  if (strategy->firstReplica()) checkpointer.emplace(checkpointsDir.string(), strategy->stateCommPtr(), ckptOptions);
  TrainerCounters counters;
  counters.globalBatch = cfg.data.global_batch;
  counters.seed = cfg.run.seed;
  counters.strategy = cfg.sharding.strategy;
  counters.worldSize = world;
  counters.resolvedConfig = state_->resolvedYaml;
  int64_t startStep = 0;
  if (cfg.checkpoint.resume != "none") {
    std::vector<checkpoint::StateEntry> entries = collectStateEntries(*strategy, emaManager.get());
    std::optional<checkpoint::LoadResult> loaded;
    if (cfg.checkpoint.resume == "auto") {
      loaded = checkpoint::resumeAuto(checkpointsDir.string(), entries, &comm);
    } else {
      loaded = checkpoint::loadCheckpoint(cfg.checkpoint.resume, entries);
    }
    if (loaded) {
      const TrainerCounters saved = countersFromJson(loaded->trainerState);
      if (saved.globalBatch != cfg.data.global_batch) {
        throw ConfigError(strCat("data.global_batch: ", cfg.data.global_batch, " differs from the ", saved.globalBatch,
                                 " that checkpoint ", loaded->dir,
                                 " was trained with; the data position cannot be converted"));
      }
      if (saved.seed != cfg.run.seed) {
        throw ConfigError(strCat("run.seed: ", cfg.run.seed, " differs from the ", saved.seed, " of checkpoint ",
                                 loaded->dir, "; the data order would change"));
      }
      for (const auto& name : strategy->paramNames()) {
        auto it = saved.optimizerSteps.find(name);
        strategy->optimizer().setStepCount(strategy->paramIndex(name), it == saved.optimizerSteps.end() ? 0 : it->second);
      }
      if (emaManager) emaManager->setUpdateCount(saved.emaUpdates);
      strategy->publishParameters();
      startStep = saved.step;
      counters.skippedSteps = saved.skippedSteps;
      TLOG_INFO0("resumed from " << loaded->dir << " (step " << saved.step << ", saved by " << saved.worldSize
                                 << " ranks with " << saved.strategy << "; now " << world << " ranks with "
                                 << cfg.sharding.strategy << "), read " << loaded->bytesRead << " bytes in "
                                 << loaded->seconds << " s");
    }
  }
  if (startStep == 0 && emaManager && cfg.ema.init_from) {
    // Fine-tuning: the EMA starts from given weights (names as the module's), each rank
    // keeping its slice. A resumed run keeps the checkpoint's EMA instead.
    emaManager->initializeFrom(checkpoint::loadSafetensors(*cfg.ema.init_from));
    TLOG_INFO0("EMA initialised from " << *cfg.ema.init_from);
  }
  TESSERA_CHECK_AS(ConfigError, startStep <= cfg.run.steps, "run.steps: ", cfg.run.steps,
                   " is below the step the run resumes from (", startStep, ")");

  auto saveCheckpoint = [&](int64_t stepsDone) {
    counters.step = stepsDone;
    counters.emaUpdates = emaManager ? emaManager->updateCount() : 0;
    for (const auto& name : strategy->paramNames()) {
      counters.optimizerSteps[name] = strategy->optimizer().stepCount(strategy->paramIndex(name));
    }
    checkpoint::SaveRequest request;
    request.step = stepsDone;
    request.strategy = cfg.sharding.strategy;
    request.entries = collectStateEntries(*strategy, emaManager.get());
    request.trainerState = countersToJson(counters);
    request.aliases = emaAliases(emaManager.get());
    if (checkpointer) checkpointer->save(request);  // logs the training stall it caused
  };

  g_stopRequested = false;
  auto previousTerm = std::signal(SIGTERM, onStopSignal);
  auto previousInt = std::signal(SIGINT, onStopSignal);

  std::unique_ptr<MetricsLog> metrics;
  if (rank == 0) metrics = std::make_unique<MetricsLog>((runDir / "metrics.jsonl").string(), cfg.run.steps);

  auto evaluate = [&](std::map<std::string, double>& out) {
    if (data->evalSamples() <= 0) return;
    out["eval_loss"] = heldOutLoss(*model, *data, cfg.run.seed, comm, device);
    if (emaManager) {
      out["eval_loss_ema"] =
          withEmaModel(*emaManager, *strategy, [&] { return heldOutLoss(*model, *data, cfg.run.seed, comm, device); });
    }
  };

  TrainSummary summary;
  summary.runDir = runDir.string();
  double windowLoss = 0, windowStart = nowSec(), runStart = nowSec();
  int64_t windowSteps = 0, skippedSteps = 0;
  bool firstWindow = true;
  comm.resetStats();

  bool preempted = false;
  bool stopAgreed = false;  // some rank had a stop signal when the last step's loss was reduced
  int64_t step = startStep;
  for (; step < cfg.run.steps; ++step) {
    // Stop on SIGTERM at the same step on every rank: the flag travels with the previous
    // step's loss (below), so it costs no collective of its own.
    if (stopAgreed) {
      preempted = true;
      TLOG_WARN0("SIGTERM/SIGINT: stopping at step " << step << " with a checkpoint");
      break;
    }
    if (cfg.run.stop_after_steps > 0 && step - startStep >= cfg.run.stop_after_steps) {
      preempted = true;
      TLOG_INFO0("run.stop_after_steps: stopping at step " << step << " with a checkpoint; resume to continue");
      break;
    }
    strategy->zeroGrad();
    const std::vector<int64_t> indices = sampler.indicesFor(step, rank, world);
    at::Tensor stepLoss = at::zeros({1}, at::kDouble);
    for (int64_t micro = 0; micro < accumulation; ++micro) {
      if (noSyncStrategy) noSyncStrategy->setRequiresGradientSync(micro + 1 == accumulation);
      std::vector<int64_t> slice(indices.begin() + micro * cfg.data.micro_batch,
                                 indices.begin() + (micro + 1) * cfg.data.micro_batch);
      Batch batch = data->trainBatch(slice);
      seedNoise(batch, cfg.run.seed, step, slice);
      at::Tensor loss = lossesOf(*model, std::move(batch), device).mean() / static_cast<double>(accumulation);
      loss.backward();
      stepLoss += loss.detach().to(at::kDouble).cpu();
    }
    const double lr = schedule.lrAt(step);
    const sharding::StepResult result = strategy->step(lr);
    if (result.skipped) {
      ++skippedSteps;
      TLOG_WARN0("step " << step + 1 << ": gradient norm " << result.gradNorm << " is not finite; step skipped");
    }
    if (emaManager) emaManager->update(step + 1, !result.skipped);
    if (result.skipped) ++counters.skippedSteps;
    // One all-reduce for the step's loss (summed, then averaged) and the stop flags.
    at::Tensor shared = at::cat({stepLoss, at::full({1}, g_stopRequested ? 1.0 : 0.0, at::kDouble)});
    comm.allReduce(shared, distributed::ReduceOp::kSum);
    stopAgreed = shared[1].item<double>() > 0;
    windowLoss += shared[0].item<double>() / static_cast<double>(world);
    ++windowSteps;

    const bool last = step + 1 == cfg.run.steps;
    const bool evalNow = cfg.run.eval_every > 0 && (step + 1) % cfg.run.eval_every == 0;
    if ((step + 1) % cfg.run.log_every == 0 || last || evalNow) {
      const double elapsed = nowSec() - windowStart;
      at::Tensor rss = at::full({1}, peakRssMiB(), at::kDouble);
      comm.allReduce(rss, distributed::ReduceOp::kMax);
      StepMetrics m;
      m.step = step + 1;
      m.loss = windowLoss / static_cast<double>(windowSteps);
      m.lr = lr;
      m.gradNorm = result.gradNorm;
      m.samplesPerSec = static_cast<double>(cfg.data.global_batch * windowSteps) / elapsed;
      m.stepTimeMs = elapsed * 1000.0 / static_cast<double>(windowSteps);
      m.peakRssMiB = rss.item<double>();
      m.commMiB = static_cast<double>(comm.stats().totalBytes()) / (1024.0 * 1024.0);
      if (skippedSteps > 0) m.extra["skipped_steps"] = static_cast<double>(skippedSteps);
      if (evalNow || last) evaluate(m.extra);
      if (metrics) metrics->record(m);
      if (firstWindow) summary.firstLoss = m.loss;
      firstWindow = false;
      summary.finalLoss = m.loss;
      if (m.extra.count("eval_loss")) summary.evalLoss = m.extra["eval_loss"];
      if (m.extra.count("eval_loss_ema")) summary.evalLossEma = m.extra["eval_loss_ema"];
      windowLoss = 0;
      windowSteps = 0;
      windowStart = nowSec();
      TLOG_DEBUG0("communication since the last log line: " << comm.stats().toString());
      comm.resetStats();
    }
    if (cfg.checkpoint.every_steps > 0 && (step + 1) % cfg.checkpoint.every_steps == 0 && !last) {
      saveCheckpoint(step + 1);
    }
  }
  std::signal(SIGTERM, previousTerm);
  std::signal(SIGINT, previousInt);
  summary.steps = step;
  summary.preempted = preempted;
  summary.samplesPerSec =
      static_cast<double>(cfg.data.global_batch * (step - startStep)) / std::max(1e-9, nowSec() - runStart);
  if ((cfg.checkpoint.at_end || preempted) && step > startStep) saveCheckpoint(step);
  if (checkpointer) checkpointer->finish();

  if (!preempted) {
    // Consolidated exports, gathered one tensor at a time to rank 0.
    const auto entries = collectStateEntries(*strategy, emaManager.get());
    std::map<std::string, std::string> prefixes = emaAliases(emaManager.get());
    for (const auto& what : cfg.checkpoint.export_what) {
      std::string prefix = what == "model" ? "model/" : (prefixes.count(what) ? prefixes[what] : "ema/" + what + "/");
      checkpoint::ExportOptions exportOptions;
      exportOptions.what = what;
      exportOptions.dtype = parseDtype(cfg.checkpoint.export_dtype);
      exportOptions.metadata["tessera_step"] = std::to_string(step);
      const std::string out = (runDir / "export" / (what + ".safetensors")).string();
      if (rank == 0) fs::create_directories(runDir / "export");
      if (strategy->firstReplica()) {  // rank 0 of the state group (global rank 0) writes
        checkpoint::exportOnline(entries, prefix, &strategy->stateComm(), out, exportOptions);  // logs what it wrote
      }
      if (rank == 0) summary.exports.push_back(out);
    }
  }

  if (!preempted && cfg.model.samples > 0) {
    auto* denoiser = dynamic_cast<DiffusionDenoiser*>(model.get());
    TESSERA_CHECK(denoiser != nullptr && emaManager != nullptr, "model.samples needs the diffusion model and an EMA");
    summary.samplesPath = drawSamples(*denoiser, *emaManager, *strategy, *data, cfg, comm, device, runDir);
  }

  if (rank == 0) {
    summary.metricsPath = (runDir / "metrics.jsonl").string();
    summary.lossCurvePath = (runDir / "loss.svg").string();
    metrics->writeLossCurve(summary.lossCurvePath);
  }
  comm.barrier();
  return summary;
}

}  // namespace tessera::trainer
