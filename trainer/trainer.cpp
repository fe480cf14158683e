// The train loop (see trainer.h): Trainer::run sets the run up (run_setup.cpp), then
// alternates one train step with the periodic actions (log, evaluate, save) until the
// last step or a stop, and ends the run (final save, exports, samples).
#include "trainer/trainer.h"

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <functional>
#include <map>
#include <numeric>

#include "checkpoint/exporter.h"
#include "checkpoint/safetensors.h"
#include "common/errors.h"
#include "common/logging.h"
#include "distributed/communicator.h"
#include "ema/posthoc.h"
#include "ema/strategy_ema.h"
#include "sharding/fully_shard.h"
#include "sharding/mixed_precision.h"
#include "trainer/checkpoint_schedule.h"
#include "trainer/diffusion.h"
#include "trainer/metrics.h"
#include "trainer/run_setup.h"

namespace tessera::trainer {
namespace fs = std::filesystem;

struct Trainer::State {
  TrainConfig config;
  std::string resolvedYaml;
  std::shared_ptr<distributed::Communicator> comm;
};

namespace {

// Set by SIGTERM (preemption) or SIGINT (Ctrl-C): the ranks agree on it with the next
// step's loss and stop after that step, with a checkpoint.
std::atomic<bool> g_stopRequested{false};
extern "C" void onStopSignal(int) { g_stopRequested = true; }

// Installs the stop handlers for the train loop and restores the previous ones after it
// (a second signal during the final save or the exports gets the default treatment).
class StopSignals {
 public:
  StopSignals() {
    g_stopRequested = false;
    previousTerm_ = std::signal(SIGTERM, onStopSignal);
    previousInt_ = std::signal(SIGINT, onStopSignal);
  }
  ~StopSignals() {
    std::signal(SIGTERM, previousTerm_);
    std::signal(SIGINT, previousInt_);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  void (*previousTerm_)(int) = SIG_DFL;
  void (*previousInt_)(int) = SIG_DFL;
};

double nowSec() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
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

// Sum of the losses over this rank's share of the first `n` held-out samples, all-reduced
// to the mean over all their predictions.
double heldOutLoss(RunParts& run) {
  torch::NoGradGuard noGrad;
  const int rank = run.comm->rank(), world = run.comm->worldSize();
  const int64_t n = std::min<int64_t>(run.data->evalSamples(), 4096);
  // Every rank must run the forward (zero3 gathers inside it): at least one sample each.
  TESSERA_CHECK_AS(ConfigError, n >= world, "evaluation: data.eval_fraction leaves ", n,
                   " held-out samples, fewer than the ", world, " ranks");
  const int64_t begin = n * rank / world, end = n * (rank + 1) / world;
  at::Tensor sums = at::zeros({2}, at::kDouble);  // [loss sum, count]
  if (end > begin) {
    Batch batch = run.data->evalBatch(begin, end - begin);
    std::vector<int64_t> indices(static_cast<size_t>(end - begin));
    std::iota(indices.begin(), indices.end(), begin);
    seedNoise(batch, run.cfg.run.seed, -1, indices);
    const at::Tensor losses = lossesOf(*run.model, batch, run.device);
    sums[0] = losses.to(at::kDouble).sum().item<double>();
    sums[1] = static_cast<double>(losses.numel());  // predictions, not windows
  }
  run.comm->allReduce(sums, distributed::ReduceOp::kSum);
  return sums[0].item<double>() / sums[1].item<double>();
}

// model.samples: DDPM samples drawn with generator_ema (every rank runs the sampler with
// the same seed, as zero3 gathers collectively); rank 0 writes them and logs their mean and
// spread against the held-out data's. Returns the file written ("" on other ranks).
std::string drawSamples(RunParts& run) {
  auto* model = dynamic_cast<DiffusionDenoiser*>(run.model.get());
  TESSERA_CHECK(model != nullptr && run.ema != nullptr, "model.samples needs the diffusion model and an EMA");
  const TrainConfig& cfg = run.cfg;
  at::Tensor samples;
  ema::withEmaWeights(*run.ema, *run.strategy, 0, [&] {
    samples = sampleDdpm(model->schedule(), model->sampleShape(), cfg.model.samples, noiseSeed(cfg.run.seed, -2, 0),
                         run.device, [&](const at::Tensor& x, const at::Tensor& t) {
                           return sharding::unitForward(*model, std::vector<at::Tensor>{x, t},
                                                        [&](const std::vector<at::Tensor>& in) {
                                                          return std::vector<at::Tensor>{model->forward(in[0], in[1])};
                                                        })[0];
                         });
  });
  if (run.comm->rank() != 0) return "";
  const std::string out = (run.runDir / "samples.safetensors").string();
  samples = samples.cpu();
  checkpoint::saveSafetensors(out, {{"samples", samples}}, {{"generator", "generator_ema"}});
  // The reference: up to 4096 held-out samples, or train samples when none are held out.
  const Dataset& data = *run.data;
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

// What one train step leaves for the periodic actions and the stop decision.
struct StepOutcome {
  double loss = 0;               // mean over the global batch
  double lr = 0;
  sharding::StepResult result;
  bool stopSignalled = false;    // some rank had a stop signal (agreed by all)
};

// The train loop's parts, over the parts of the run.
class TrainLoop {
 public:
  explicit TrainLoop(RunParts& run)
      : run_(run),
        cfg_(run.cfg),
        schedule_(run.cfg.run.steps, run.startStep, run.cfg.checkpoint.every_steps, run.cfg.run.stop_after_steps,
                  run.cfg.checkpoint.at_end) {
    if (run.comm->rank() == 0) {
      metrics_ = std::make_unique<MetricsLog>((run.runDir / "metrics.jsonl").string(), cfg_.run.steps);
    }
    summary_.runDir = run.runDir.string();
    windowStart_ = runStart_ = nowSec();
    run.comm->resetStats();
  }

  // One optimizer step: the micro-batches' forward and backward, the strategy's step
  // (gradient sync, clipping, optimizer; the loss and the stop flags summed in its norm's
  // all-reduce), and the EMA update.
  StepOutcome trainStep(int64_t step) {
    sharding::ShardingStrategy& strategy = *run_.strategy;
    distributed::Communicator& comm = *run_.comm;
    strategy.zeroGrad();
    const std::vector<int64_t> indices = run_.sampler->indicesFor(step, comm.rank(), comm.worldSize());
    const int64_t micro = cfg_.data.micro_batch;
    at::Tensor stepLoss = at::zeros({1}, at::kDouble);
    for (int64_t m = 0; m < run_.microBatches; ++m) {
      // sharding.reduce_every_micro_batch false: micro-batches before the last keep full
      // gradients and do not communicate.
      if (!cfg_.sharding.reduce_every_micro_batch) strategy.setRequiresGradientSync(m + 1 == run_.microBatches);
      std::vector<int64_t> slice(indices.begin() + m * micro, indices.begin() + (m + 1) * micro);
      Batch batch = run_.data->trainBatch(slice);
      seedNoise(batch, cfg_.run.seed, step, slice);
      at::Tensor loss =
          lossesOf(*run_.model, std::move(batch), run_.device).mean() / static_cast<double>(run_.microBatches);
      loss.backward();
      stepLoss += loss.detach().to(at::kDouble).cpu();
    }
    StepOutcome out;
    out.lr = run_.schedule->lrAt(step);
    // The step's loss (summed, then averaged) and the stop flags ride on the strategy's
    // gradient-norm all-reduce: no collective of their own.
    at::Tensor shared = at::cat({stepLoss, at::full({1}, g_stopRequested ? 1.0 : 0.0, at::kDouble)});
    out.result = strategy.step(out.lr, shared);
    if (out.result.skipped) {
      ++run_.counters.skippedSteps;
      TLOG_WARN0("step " << step + 1 << ": gradient norm " << out.result.gradNorm << " is not finite; step skipped");
    }
    if (run_.ema) run_.ema->update(step + 1, !out.result.skipped);
    out.loss = shared[0].item<double>() / static_cast<double>(comm.worldSize());
    out.stopSignalled = shared[1].item<double>() > 0;
    return out;
  }

  // After `done` steps: a metrics line every run.log_every steps (and at evaluations and
  // the last step), the held-out loss every run.eval_every steps and at the end, and the
  // periodic checkpoint.
  void periodicActions(int64_t done, const StepOutcome& out) {
    windowLoss_ += out.loss;
    ++windowSteps_;
    if (out.result.skipped) ++skippedInRun_;
    const bool last = done == cfg_.run.steps;
    const bool evalNow = cfg_.run.eval_every > 0 && done % cfg_.run.eval_every == 0;
    if (done % cfg_.run.log_every == 0 || last || evalNow) logWindow(done, out, evalNow || last);
    if (schedule_.periodicSaveDue(done)) saveCheckpoint(done);
    if (run_.posthocWriter && done % cfg_.ema.posthoc.snapshot_every == 0) savePosthocSnapshot(done);
  }

  // ema.posthoc: the power-function profiles at step `done`, for tessera-export
  // --posthoc-ema (ema/posthoc.h).
  void savePosthocSnapshot(int64_t done) {
    checkpoint::SaveRequest request;
    request.step = done;
    request.strategy = cfg_.sharding.strategy;
    for (size_t i = 0; i < run_.ema->numProfiles(); ++i) {
      if (!run_.ema->isPowerProfile(i)) continue;
      for (auto& e : run_.ema->profileEntries(i)) request.entries.push_back(std::move(e));
    }
    request.trainerState = ema::posthocSnapshotState(*run_.ema);
    run_.posthocWriter->save(request);
  }

  // Whether the run stops after `done` steps (a stop signal, run.stop_after_steps).
  bool stopsAfter(int64_t done, const StepOutcome& out) {
    if (!schedule_.stopsAfter(done, out.stopSignalled)) return false;
    if (out.stopSignalled) {
      TLOG_WARN0("SIGTERM/SIGINT: stopping at step " << done << " with a checkpoint");
    } else {
      TLOG_INFO0("run.stop_after_steps: stopping at step " << done << " with a checkpoint; resume to continue");
    }
    return true;
  }

  // The end: the final checkpoint (checkpoint.at_end, or a stop), then, when the run
  // finished, the exports and the samples; the loss curve.
  TrainSummary finish(int64_t done, bool stopped) {
    summary_.steps = done;
    summary_.preempted = stopped;
    summary_.samplesPerSec = static_cast<double>(cfg_.data.global_batch * (done - run_.startStep)) /
                             std::max(1e-9, nowSec() - runStart_);
    if (schedule_.finalSaveDue(done, stopped)) saveCheckpoint(done);
    if (run_.checkpointer) run_.checkpointer->finish();
    if (!stopped) exportWeights(done);
    if (!stopped && cfg_.model.samples > 0) summary_.samplesPath = drawSamples(run_);
    if (run_.comm->rank() == 0) {
      summary_.metricsPath = (run_.runDir / "metrics.jsonl").string();
      summary_.lossCurvePath = (run_.runDir / "loss.svg").string();
      metrics_->writeLossCurve(summary_.lossCurvePath, "training loss: " + cfg_.run.name);
    }
    run_.comm->barrier();
    return summary_;
  }

 private:
  void logWindow(int64_t done, const StepOutcome& out, bool evaluateNow) {
    distributed::Communicator& comm = *run_.comm;
    const double elapsed = nowSec() - windowStart_;
    const distributed::CommStats sent = comm.stats();  // the window's steps (and saves), not what follows
    at::Tensor rss = at::full({1}, peakRssMiB(), at::kDouble);
    comm.allReduce(rss, distributed::ReduceOp::kMax);
    StepMetrics m;
    m.step = done;
    m.loss = windowLoss_ / static_cast<double>(windowSteps_);
    m.lr = out.lr;
    m.gradNorm = out.result.gradNorm;
    m.samplesPerSec = static_cast<double>(cfg_.data.global_batch * windowSteps_) / elapsed;
    m.stepTimeMs = elapsed * 1000.0 / static_cast<double>(windowSteps_);
    m.peakRssMiB = rss.item<double>();
    m.commMiB = static_cast<double>(sent.totalBytes()) / (1024.0 * 1024.0);
    m.collectivesPerStep = static_cast<double>(sent.totalCalls()) / static_cast<double>(windowSteps_);
    if (skippedInRun_ > 0) m.extra["skipped_steps"] = static_cast<double>(skippedInRun_);
    if (evaluateNow) evaluate(m.extra);
    if (metrics_) metrics_->record(m);
    if (firstWindow_) summary_.firstLoss = m.loss;
    firstWindow_ = false;
    summary_.finalLoss = m.loss;
    if (m.extra.count("eval_loss")) summary_.evalLoss = m.extra["eval_loss"];
    if (m.extra.count("eval_loss_ema")) summary_.evalLossEma = m.extra["eval_loss_ema"];
    windowLoss_ = 0;
    windowSteps_ = 0;
    windowStart_ = nowSec();
    TLOG_DEBUG0("communication since the last log line: " << sent.toString());
    comm.resetStats();
  }

  // The held-out loss with the live weights and with generator_ema's.
  void evaluate(std::map<std::string, double>& out) {
    if (run_.data->evalSamples() <= 0) return;
    out["eval_loss"] = heldOutLoss(run_);
    if (run_.ema) {
      double emaLoss = 0;
      ema::withEmaWeights(*run_.ema, *run_.strategy, 0, [&] { emaLoss = heldOutLoss(run_); });
      out["eval_loss_ema"] = emaLoss;
    }
  }

  // Saves step `done` unless it is saved already (a stop or the end on a periodic step).
  void saveCheckpoint(int64_t done) {
    if (!schedule_.claimSave(done)) return;
    run_.counters.step = done;
    run_.counters.emaUpdates = run_.ema ? run_.ema->updateCount() : 0;
    checkpoint::SaveRequest request;
    request.step = done;
    request.strategy = cfg_.sharding.strategy;
    request.entries = collectStateEntries(*run_.strategy, run_.ema.get());
    request.trainerState = countersToJson(run_.counters);
    if (run_.ema) request.aliases = run_.ema->exportAliases();
    if (run_.checkpointer) run_.checkpointer->save(request);  // logs the training stall it caused
  }

  // checkpoint.export_what: consolidated safetensors, gathered one tensor at a time to
  // rank 0 over the state group.
  void exportWeights(int64_t done) {
    const auto entries = collectStateEntries(*run_.strategy, run_.ema.get());
    const std::map<std::string, std::string> aliases =
        run_.ema ? run_.ema->exportAliases() : std::map<std::string, std::string>{};
    const int rank = run_.comm->rank();
    for (const auto& what : cfg_.checkpoint.export_what) {
      checkpoint::ExportOptions options;
      options.what = what;
      options.dtype = sharding::parseFloatDtype(cfg_.checkpoint.export_dtype, "checkpoint.export_dtype");
      options.metadata["tessera_step"] = std::to_string(done);
      const std::string out = (run_.runDir / "export" / (what + ".safetensors")).string();
      if (rank == 0) fs::create_directories(run_.runDir / "export");
      if (run_.strategy->firstReplica()) {  // rank 0 of the state group (global rank 0) writes; logs what it wrote
        checkpoint::exportOnline(entries, checkpoint::exportPrefix(what, aliases), &run_.strategy->stateComm(), out,
                                 options);
      }
      if (rank == 0) summary_.exports.push_back(out);
    }
  }

  RunParts& run_;
  const TrainConfig& cfg_;
  CheckpointSchedule schedule_;
  std::unique_ptr<MetricsLog> metrics_;  // rank 0
  TrainSummary summary_;
  double windowLoss_ = 0, windowStart_ = 0, runStart_ = 0;
  int64_t windowSteps_ = 0, skippedInRun_ = 0;
  bool firstWindow_ = true;
};

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
  std::unique_ptr<RunParts> run = setUpRun(state_->config, state_->resolvedYaml, state_->comm);
  TrainLoop loop(*run);
  int64_t done = run->startStep;
  bool stopped = false;
  {
    StopSignals signals;  // SIGTERM/SIGINT: stop after the current step, with a checkpoint
    while (done < run->cfg.run.steps && !stopped) {
      const StepOutcome outcome = loop.trainStep(done);
      ++done;
      loop.periodicActions(done, outcome);
      stopped = loop.stopsAfter(done, outcome);
    }
  }
  return loop.finish(done, stopped);
}

}  // namespace tessera::trainer
