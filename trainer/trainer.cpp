// The train loop (see trainer.h): Trainer::run sets the run up (run_setup.cpp), then
// alternates one step of the recipe (recipe.h) with the periodic actions (log, evaluate,
// save every model) until the last step or a stop, and ends the run (final save,
// exports, samples).
#include "trainer/trainer.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <signal.h>

#include <algorithm>
#include <csignal>
#include <vector>
#include <filesystem>
#include <map>
#include <optional>

#include <unistd.h>

#include "checkpoint/exporter.h"
#include "diagnostics/flight_recorder.h"
#include "kernels/cpu_matmul.h"
#include "kernels/cpu_threads.h"
#include "common/clock.h"
#include "common/errors.h"
#include "common/logging.h"
#include "distributed/communicator.h"
#include "ema/posthoc.h"
#include "observe/tensorboard_writer.h"
#include "sharding/mixed_precision.h"
#include "trainer/checkpoint_schedule.h"
#include "trainer/memory_breakdown.h"
#include "trainer/metrics.h"
#include "trainer/model_metadata.h"
#include "trainer/recipe.h"
#include "trainer/recipe_spec.h"
#include "trainer/replica_recovery.h"
#include "trainer/profiler.h"
#include "trainer/run_setup.h"
#include "trainer/stragglers.h"
#include "trainer/throughput.h"

namespace tessera::trainer {
namespace fs = std::filesystem;

struct Trainer::State {
  TrainConfig config;
  std::string resolvedYaml;
  std::shared_ptr<distributed::Communicator> comm;
};

namespace {

// Set by SIGTERM (preemption) or SIGINT (Ctrl-C): the ranks agree on it with the next
// step's loss and stop after that step, with a checkpoint. A second signal ends the
// process at once (the default action), as the first one's message says.
std::atomic<bool> g_stopRequested{false};
extern "C" void onStopSignal(int signal) {
  if (signal == SIGTERM) diagnostics::flight::onTerminateSignal();  // the dump says where this rank was
  if (g_stopRequested.exchange(true)) {
    std::signal(signal, SIG_DFL);
    std::raise(signal);
    return;
  }
  if (log::rank() <= 0) {
    static const char kMessage[] =
        "\ntessera-train: stop requested: stopping after the current step with a checkpoint (resume to continue); "
        "a second Ctrl-C (or SIGTERM) stops at once, without one\n";
    const ssize_t ignored = ::write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);  // async-signal-safe
    (void)ignored;
  }
}

// Exports `names` (checkpoint.export's) of step `done` to <run.dir>/export/<name>.safetensors:
// consolidated, gathered one tensor at a time to rank 0 over the state group. Collective;
// returns the files written (rank 0; empty elsewhere).
std::vector<std::string> writeExports(RunParts& run, int64_t done, const std::vector<std::string>& names) {
  const std::vector<dtensor::StateEntry> entries = checkpoint::collectEntries(run.states());
  std::map<std::string, std::string> exportNames;
  for (const ExportName& n : runExportNames(run.cfg)) exportNames[n.name] = n.prefix;
  const distributed::TimeoutScope timeout(run.cfg.diagnostics.checkpoint_timeout);
  sharding::ShardingStrategy& writer = *run.models.front().strategy;  // every model's state group (run_setup.h)
  const int rank = run.comm->rank();
  std::vector<std::string> written;
  for (const auto& what : names) {
    checkpoint::ExportOptions options;
    options.what = what;
    options.dtype = run.cfg.checkpoint.export_dtype;
    options.metadata["tessera_step"] = std::to_string(done);
    const std::string model = modelMetadataForPrefix(run.counters.modelMetadata, checkpoint::exportPrefix(what, exportNames));
    if (!model.empty()) options.metadata[kModelMetadataKey] = model;
    const std::string out = (run.runDir / "export" / (what + ".safetensors")).string();
    if (rank == 0) fs::create_directories(run.runDir / "export");
    if (writer.firstReplica()) {  // rank 0 of the state group (global rank 0) writes; logs what it wrote
      checkpoint::exportOnline(entries, exportNames, writer.stateCommPtr()->host().get(), out, options);
    }
    if (rank == 0) written.push_back(out);
  }
  return written;
}

// The exports of checkpoint.export that rank 0 does not find in <run.dir>/export (a
// run stopped between its final checkpoint and its exports, or an export name added
// since), agreed by every rank.
std::vector<std::string> missingExports(RunParts& run) {
  const std::vector<std::string>& names = run.cfg.checkpoint.export_what;
  at::Tensor missing = at::zeros({static_cast<int64_t>(names.size()) + 1}, at::kLong);
  if (run.comm->rank() == 0) {
    for (size_t i = 0; i < names.size(); ++i) {
      std::error_code ec;
      missing[static_cast<int64_t>(i)] = fs::exists(run.runDir / "export" / (names[i] + ".safetensors"), ec) ? 0 : 1;
    }
  }
  run.hostComm->broadcast(missing, 0);
  std::vector<std::string> out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (missing[static_cast<int64_t>(i)].item<int64_t>() != 0) out.push_back(names[i]);
  }
  return out;
}

// Installs the stop handlers for the train loop and restores the previous ones after it
// (a second signal during the final save or the exports gets the default treatment). They run
// on tessera-train's signal thread (common/signal_thread.h), never inside a oneDNN product.
// With SIG_DFL: the signals end the process at once while it lives (a rank that waits to
// rejoin holds nothing to save).
class StopSignals {
 public:
  explicit StopSignals(void (*handler)(int) = onStopSignal) {
    if (handler == onStopSignal) g_stopRequested = false;
    struct sigaction action{};
    action.sa_handler = handler;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    ::sigaction(SIGTERM, &action, &previousTerm_);
    ::sigaction(SIGINT, &action, &previousInt_);
  }
  ~StopSignals() {
    ::sigaction(SIGTERM, &previousTerm_, nullptr);
    ::sigaction(SIGINT, &previousInt_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction previousTerm_{};
  struct sigaction previousInt_{};
};

// fault.survive: a rank whose group would rejoin a run that trained its last step first.
TrainSummary finishedWithoutThisRank() {
  TLOG_WARN("fault.survive: the run finished before this rank's replica group could rejoin; nothing to do");
  TrainSummary summary;
  summary.finishedWithoutThisRank = true;
  return summary;
}

// run.recipe's training code over the run's parts.
std::unique_ptr<Recipe> makeRecipeOf(RunParts& run) {
  const RecipeSpec& spec = recipeSpec(run.cfg.run.recipe);
  if (spec.make == nullptr) {
    throw UsageError(strCat("run.recipe '", spec.name, "' was added without its training code (RecipeSpec::make)"));
  }
  return spec.make(run);
}

// The train loop's parts, over the parts of the run.
class TrainLoop {
 public:
  // `replicaGroupSize`: fault.survive's ranks per replica group (metrics' replicas_live); 0: off.
  explicit TrainLoop(RunParts& run, int replicaGroupSize = 0)
      : run_(run),
        replicaGroupSize_(replicaGroupSize),
        cfg_(run.cfg),
        recipe_(makeRecipeOf(run)),
        schedule_(run.cfg.run, run.cfg.checkpoint, run.startStep),
        profile_(run.cfg.profile, *run.hostComm, run.runDir) {
    trace::nameThisThread("main");
    if (run.comm->rank() == 0) {
      metrics_ = std::make_unique<MetricsLog>((run.runDir / "metrics.jsonl").string(), cfg_.run.steps, run.startStep);
      if (cfg_.log.tensorboard) tensorboard_ = std::make_unique<observe::TensorBoardWriter>((run.runDir / "tb").string());
    }
    summary_.runDir = run.runDir.string();
    trainFlopsPerSample_ = recipe_->trainFlopsPerSample();
    if (trainFlopsPerSample_ > 0) {
      // Every rank probes at once, so the figure carries the contention of the run itself
      // (ranks sharing a CPU's cores); rank 0 reports against its own.
      peak_ = peakFlops(cfg_.run.peak_flops, run.device, run.models.front().cfg.sharding.paramDtype);
      TLOG_INFO0("MFU: " << trainFlopsPerSample_ / 1e9 << " GFLOP per sample (forward and backward), against a peak of "
                         << peak_.flopsPerSec / 1e12 << " TFLOP/s per rank " << peak_.source);
      if (run.device.is_cpu()) {
        const at::ScalarType paramDtype = run.models.front().cfg.sharding.paramDtype;
        datasheet_ = cpuDatasheetPeak(
            paramDtype == at::kBFloat16 || kernels::cpuLinearDtype() == at::kBFloat16 ? at::kBFloat16 : at::kFloat,
            at::get_num_threads());
        if (datasheet_.flopsPerSec > 0) {
          TLOG_INFO0("datasheet peak: " << datasheet_.source << " (metrics' mfu_datasheet)");
        }
      }
      if (!peak_.matmulPath.empty()) TLOG_INFO0("matrix products: " << peak_.matmulPath);
      if (!peak_.slowWarning.empty()) TLOG_WARN0(peak_.slowWarning);
    }
    // The host's optimizer, norms and EMA (all of them with sharding.cpu_offload).
    TLOG_INFO0("CPU loops: Tessera's own on " << kernels::parallelLoopThreads() << " of LibTorch's "
                                              << at::get_num_threads() << " threads");
    runtimeBytes_ = runtimeBytes();
    memoryWindowFirst_ = run.startStep + 1;
    windowStart_ = runStart_ = steadySeconds();
    run.comm->resetStats();
  }

  // One optimizer step of every model the recipe trains.
  StepOutcome trainStep(int64_t step) {
    profile_.beforeStep(step);
    trace::setCurrentStep(step + 1);
    const trace::Span span("step", strCat("step ", step + 1));
    StepOutcome out = recipe_->step(step, g_stopRequested);
    if (out.checkpointFailed && run_.checkpointer) {
      // Every rank learnt it on this step's all-reduce: all stop now, each throwing the
      // failing rank's reason, the previous checkpoint still the latest.
      const distributed::TimeoutScope timeout(cfg_.diagnostics.checkpoint_timeout);
      run_.checkpointer->finish();
    }
    if (out.result.skipped) {
      ++run_.counters.skippedSteps;
      TLOG_WARN0("step " << step + 1 << ": gradient norm " << out.result.gradNorm << " is not finite; step skipped");
    }
    return out;
  }

  // After `done` steps: a metrics line every run.log_every steps (and at evaluations and
  // the last step), the held-out loss every run.eval_every steps and at the end, and the
  // periodic checkpoint.
  void periodicActions(int64_t done, const StepOutcome& out) {
    const std::string trace = profile_.afterStep(done);
    if (!trace.empty()) summary_.tracePath = trace;
    windowLoss_ += out.loss;
    for (const auto& [key, value] : out.extra) windowExtra_[key] += value;
    ++windowSteps_;
    if (out.result.skipped) ++skippedInRun_;
    if (const datasets::SkipCount skipped = run_.data->skipped(); skipped.samples > dataSkipsLogged_) {
      TLOG_WARN("data.on_error skip: passed over " << skipped.samples - dataSkipsLogged_
                << " samples this rank could not read (" << skipped.samples << " so far); the last: " << skipped.last);
      dataSkipsLogged_ = skipped.samples;
    }
    const bool last = done == cfg_.run.steps;
    const bool evalNow = cfg_.run.eval_every > 0 && done % cfg_.run.eval_every == 0;
    if (done % cfg_.run.log_every == 0 || last || evalNow) logWindow(done, out, evalNow || last);
    if (cfg_.eval.sample_every > 0 && done % cfg_.eval.sample_every == 0 && !last) writeSampleGrids(done);
    if (schedule_.periodicSaveDue(done)) saveCheckpoint(done);
    if (run_.localCheckpointer && schedule_.localSaveDue(done)) saveLocal(done);
    // The last step too, so that tessera-export reconstructs at the run's end even when
    // snapshot_every does not divide run.steps.
    if (run_.posthocWriter && (done % run_.models.front().cfg.ema.snapshotEvery == 0 || last)) savePosthocSnapshot(done);
  }

  // ema.posthoc: the power-function profiles at step `done`, for tessera-export
  // --posthoc-ema (ema/posthoc.h).
  void savePosthocSnapshot(int64_t done) {
    ema::ShardedModelEMAManager& ema = *run_.models.front().ema;  // single-model form only
    checkpoint::SaveRequest request;
    request.step = done;
    request.strategy = run_.strategies();
    request.entries = ema::posthocSnapshotEntries(ema);
    // Which run wrote it: its seed (and the model, which the EMA records itself).
    request.trainerState = ema::posthocSnapshotState(ema, strCat("{\"seed\": ", cfg_.run.seed, "}"));
    const distributed::TimeoutScope timeout(cfg_.diagnostics.checkpoint_timeout);
    run_.posthocWriter->save(request);
  }

  // Whether the run stops after `done` steps (a stop signal, run.stop_after_steps).
  bool stopsAfter(int64_t done, const StepOutcome& out) {
    if (!schedule_.stopsAfter(done, out.stopSignalled)) return false;
    if (out.stopSignalled && !g_stopRequested) {
      summary_.stoppedForAPeer = true;
      TLOG_WARN("another rank got SIGTERM/SIGINT, this one none: stopping at step " << done
                << " with a checkpoint; exit status 75 asks the launcher to restart this rank and resume");
    } else if (out.stopSignalled) {
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
                             std::max(1e-9, steadySeconds() - runStart_);
    if (schedule_.finalSaveDue(done, stopped)) saveCheckpoint(done);
    if (run_.checkpointer) {
      const distributed::TimeoutScope timeout(cfg_.diagnostics.checkpoint_timeout);
      run_.checkpointer->finish();
    }
    // The persistent tier holds the end: the local one would only fill node memory.
    if (run_.localCheckpointer) run_.localCheckpointer->clear();
    if (!stopped) exportWeights(done);
    if (!stopped) writeSampleGrids(done);
    if (!stopped) summary_.judgement = recipe_->judgeSamples();
    if (!stopped && cfg_.defaults.model.samples > 0) summary_.samplesPath = recipe_->drawSamples();
    if (run_.device.is_cpu()) {
      keepIfPeak(measureMemory(run_, runtimeBytes_), "the run's end: evaluation, checkpoint, exports, samples");
      TLOG_INFO("memory at the run's peak (" << peakMemoryWhen_ << "): " << peakMemory_.str());
    }
    if (run_.comm->rank() == 0) {
      summary_.metricsPath = (run_.runDir / "metrics.jsonl").string();
      summary_.lossCurvePath = (run_.runDir / "loss.svg").string();
      metrics_->writeLossCurve(summary_.lossCurvePath, "losses: " + cfg_.run.name, cfg_.log.loss_scale == "log");
    }
    run_.hostComm->barrier();
    return summary_;
  }

 private:
  void writeSampleGrids(int64_t done) {
    const std::vector<SampleGrid> grids = recipe_->writeSampleGrids(done);
    for (const SampleGrid& grid : grids) {
      TLOG_INFO0("step " << done << ": sample grid " << grid.path);
      if (tensorboard_) tensorboard_->addImage(done, "samples/" + grid.name, grid.image);
    }
    if (!grids.empty()) {
      summary_.sampleGrids.clear();
      for (const SampleGrid& grid : grids) summary_.sampleGrids.push_back(grid.path);
    }
  }

  void logWindow(int64_t done, const StepOutcome& out, bool evaluateNow) {
    const trace::Span span("log", "metrics window");
    distributed::Communicator& comm = *run_.comm;
    const double elapsed = steadySeconds() - windowStart_;
    const distributed::CommStats sent = comm.stats();  // the window's steps (and saves), not what follows
    const double steps = static_cast<double>(windowSteps_);
    const double stepMs = elapsed * 1000.0 / steps, waitMs = static_cast<double>(sent.waitNs) / 1e6 / steps;
    // One gather per window: each rank's peak RSS (the run's: each window's, as VmHWM
    // restarts with each memory window, and those before) and its pace, for the straggler.
    // On CPU the window's memory breakdown and the run's peak come from one read of VmHWM,
    // so the window's peak never exceeds the run's (two reads raced with the gather between).
    std::optional<MemoryBreakdown> memory;
    if (run_.device.is_cpu()) memory = measureMemory(run_, runtimeBytes_);
    runPeakRssMiB_ = std::max(runPeakRssMiB_, memory ? static_cast<double>(memory->peakRss) / (1024.0 * 1024.0)
                                                     : peakRssMiB());
    const int world = run_.hostComm->worldSize();
    // Busy at least 0: waitNs adds up every thread's waits, which may overlap (a prefetch
    // thread waiting while the step computes).
    const at::Tensor mine = at::tensor({runPeakRssMiB_, std::max(0.0, stepMs - waitMs), waitMs}, at::kDouble);
    const at::Tensor all = at::empty({world, 3}, at::kDouble);
    run_.hostComm->allGatherInto(all.view({-1}), mine);
    std::vector<RankPace> paces;
    for (int r = 0; r < world; ++r) paces.push_back({all[r][1].item<double>(), all[r][2].item<double>()});
    StepMetrics m;
    m.step = done;
    m.loss = windowLoss_ / steps;
    m.lr = out.lr;
    m.gradNorm = out.result.gradNorm;
    m.samplesPerSec = static_cast<double>(cfg_.data.global_batch * windowSteps_) / elapsed;
    m.stepTimeMs = stepMs;
    m.peakRssMiB = all.select(1, 0).max().item<double>();
    m.commMiB = static_cast<double>(sent.totalBytes()) / (1024.0 * 1024.0);
    m.collectivesPerStep = static_cast<double>(sent.totalCalls()) / steps;
    m.extra["comm_wait_ms"] = waitMs;
    nameStraggler(paces, stepMs, m);
    for (const auto& [key, sum] : windowExtra_) m.extra[key] = sum / steps;
    if (memory) {
      for (const auto& [key, value] : memory->metrics()) m.extra[key] = value;
      keepIfPeak(*memory, strCat("steps ", memoryWindowFirst_, "-", done));
      memoryWindowFirst_ = done + 1;
      startMemoryWindow(run_);
    }
    const bool images = datasets::isImageKind(cfg_.data.kind);
    for (const auto& [key, value] : throughputFigures(m.samplesPerSec, comm.worldSize(), trainFlopsPerSample_,
                                                      recipe_->tokensPerSample(), images, peak_.flopsPerSec,
                                                      datasheet_.flopsPerSec)) {
      m.extra[key] = value;
    }
    if (replicaGroupSize_ > 0) m.extra["replicas_live"] = world / replicaGroupSize_;
    if (skippedInRun_ > 0) m.extra["skipped_steps"] = static_cast<double>(skippedInRun_);
    if (const datasets::SkipCount skipped = run_.data->skipped(); skipped.samples > 0) {
      m.extra["data_skipped"] = static_cast<double>(skipped.samples);  // rank 0's; each rank logs its own below
    }
    if (evaluateNow) evaluate(m.extra);
    if (metrics_) {
      metrics_->record(m);
      if (tensorboard_) {
        std::vector<std::pair<std::string, double>> scalars;
        for (const auto& [name, value] : m.named()) scalars.emplace_back(tensorBoardTag(name), value);
        tensorboard_->addScalars(m.step, scalars);
      }
    } else {
      TLOG_INFO0(formatStepLine(m, cfg_.run.steps));  // into this rank's own log file
    }
    if (firstWindow_) summary_.firstLoss = m.loss;
    firstWindow_ = false;
    summary_.lossLogged = true;
    summary_.finalLoss = m.loss;
    if (m.extra.count("eval_loss")) {
      summary_.evalLoss = m.extra["eval_loss"];
      summary_.evaluated = true;
    }
    if (m.extra.count("eval_loss_ema")) summary_.evalLossEma = m.extra["eval_loss_ema"];
    windowLoss_ = 0;
    windowExtra_.clear();
    windowSteps_ = 0;
    windowStart_ = steadySeconds();
    TLOG_DEBUG0("communication since the last log line: " << sent.toString());
    comm.resetStats();
  }

  // The window's slowest rank, in the metrics; named in rank 0's log when it is slower than
  // diagnostics.straggler_ratio times the others over a span of a few seconds of steps
  // (StragglerWatch).
  void nameStraggler(const std::vector<RankPace>& paces, double stepMs, StepMetrics& m) {
    const StragglerReport window = findStraggler(paces, cfg_.diagnostics.straggler_ratio, stepMs);
    if (window.slowestRank < 0) return;
    m.extra["slowest_rank"] = window.slowestRank;
    m.extra["slowest_rank_lag_ms"] = window.lagMs;
    StragglerReport span;
    if (stragglers_.add(paces, windowSteps_, stepMs, span)) TLOG_WARN0(describeStraggler(span));
  }

  // The breakdown of the window with the highest peak RSS so far, for the run's last line.
  void keepIfPeak(const MemoryBreakdown& memory, std::string when) {
    if (memory.peakRss < peakMemory_.peakRss) return;
    peakMemory_ = memory;
    peakMemoryWhen_ = std::move(when);
  }

  // The recipe's held-out figures (eval_loss, eval_loss_ema).
  void evaluate(std::map<std::string, double>& out) { recipe_->evaluate(out); }

  // Saves step `done` unless it is saved already (a stop or the end on a periodic step).
  void saveCheckpoint(int64_t done) {
    if (!schedule_.claimSave(done)) return;
    run_.counters.step = done;
    checkpoint::SaveOptions options;
    options.strategy = run_.strategies();
    options.trainerState = countersToJson(run_.counters);
    const distributed::TimeoutScope timeout(cfg_.diagnostics.checkpoint_timeout);
    if (run_.checkpointer) run_.checkpointer->save(done, run_.states(), options);  // logs the training stall it caused
  }

  // checkpoint.local: step `done` to the node-local tier and its replicas (a failure is
  // logged there and training goes on).
  void saveLocal(int64_t done) {
    run_.counters.step = done;
    checkpoint::SaveOptions options;
    options.strategy = run_.strategies();
    options.trainerState = countersToJson(run_.counters);
    const checkpoint::SaveRequest request = checkpoint::saveRequestOf(done, run_.states(), options);
    const distributed::TimeoutScope timeout(cfg_.diagnostics.checkpoint_timeout);
    const checkpoint::LocalSaveStats stats = run_.localCheckpointer->save(request);
    if (!stats.saved) return;
    const std::string line = strCat("checkpoint.local: step ", done, " saved in ", stats.seconds, " s (",
                                    stats.bytes, " bytes of this rank, ", stats.replicaBytes, " of replicas received)");
    if (firstLocalSave_) {
      TLOG_INFO0(line);
    } else {
      TLOG_DEBUG(line);
    }
    firstLocalSave_ = false;
  }

  void exportWeights(int64_t done) {
    for (std::string& file : writeExports(run_, done, cfg_.checkpoint.export_what)) summary_.exports.push_back(std::move(file));
  }

  RunParts& run_;
  int replicaGroupSize_;
  const TrainConfig& cfg_;
  std::unique_ptr<Recipe> recipe_;
  CheckpointSchedule schedule_;
  ProfileWindow profile_;
  std::unique_ptr<MetricsLog> metrics_;  // rank 0
  std::unique_ptr<observe::TensorBoardWriter> tensorboard_;  // rank 0, log.tensorboard
  double trainFlopsPerSample_ = 0;  // 0: the recipe does not count them (no MFU)
  int64_t runtimeBytes_ = 0;        // held besides the host allocator and malloc before the first step
  double runPeakRssMiB_ = 0;
  MemoryBreakdown peakMemory_;      // the window of the highest peak RSS (CPU runs)
  std::string peakMemoryWhen_;      // which window that was
  int64_t memoryWindowFirst_ = 0;   // the first step of the current memory window
  PeakFlops peak_;
  DatasheetPeak datasheet_;  // CPU only: the core's datasheet figure (mfu_datasheet)
  TrainSummary summary_;
  double windowLoss_ = 0, windowStart_ = 0, runStart_ = 0;
  std::map<std::string, double> windowExtra_;  // the recipe's further figures, summed over the window
  int64_t windowSteps_ = 0, skippedInRun_ = 0, dataSkipsLogged_ = 0;
  StragglerWatch stragglers_{cfg_.diagnostics.straggler_ratio};
  bool firstWindow_ = true;
  bool firstLocalSave_ = true;
};

}  // namespace

Trainer::Trainer(TrainConfig config, std::string resolvedYaml, std::shared_ptr<distributed::Communicator> comm)
    : state_(std::make_unique<State>()) {
  TESSERA_CHECK(comm != nullptr || config.fault.survive, "Trainer: no communicator");
  state_->config = std::move(config);
  state_->resolvedYaml = std::move(resolvedYaml);
  state_->comm = std::move(comm);
}

Trainer::~Trainer() = default;

TrainSummary Trainer::run() {
  std::unique_ptr<ReplicaGroups> replicas;
  std::unique_ptr<RunParts> run = state_->comm ? setUpRun(state_->config, state_->resolvedYaml, state_->comm)
                                               : rejoin(state_->config, state_->resolvedYaml, replicas);
  if (!run) return finishedWithoutThisRank();
  if (run->startStep > 0 && run->startStep == run->cfg.run.steps) {
    TrainSummary summary;
    summary.steps = run->startStep;
    summary.runDir = run->runDir.string();
    summary.alreadyFinished = true;
    const std::vector<std::string> missing = missingExports(*run);
    TLOG_WARN0("run.dir " << run->runDir.string() << " holds a finished run (step " << run->startStep << " of "
                          << run->cfg.run.steps << "); nothing to train"
                          << (missing.empty() ? "" : ", writing the exports it lacks from its final checkpoint")
                          << ": another run.dir starts afresh (raise run.steps to train further)");
    summary.exports = writeExports(*run, run->startStep, missing);
    return summary;
  }
  const TestKill testKill;
  if (run->cfg.fault.survive && !replicas) replicas = startReplicaGroups(*run);
  auto loop = std::make_unique<TrainLoop>(*run, replicas ? replicas->groupSize() : 0);
  int64_t done = run->startStep;
  bool stopped = false;
  {
    // SIGTERM/SIGINT: stop after the current step, with a checkpoint. Not during the
    // set-up: a signal there ends the process at once (the default), which loses nothing
    // since the last checkpoint and is what tessera-run's teardown of the other ranks
    // expects (SIGTERM, then SIGKILL after a grace period of seconds).
    StopSignals signals;
    while (done < run->cfg.run.steps && !stopped) {
      const sharding::ShardingStrategy& main = *run->models.front().strategy;
      const int64_t stepStart = done, updatesBefore = main.stepsApplied() + main.stepsSkipped();
      bool admit = false;
      try {
        // fault.survive: a lost group back, whole, is admitted between steps.
        admit = replicas && replicas->rejoinWaiting(*run->hostComm);
        if (!admit) {
          testKill.at(done + 1, "start");
          const StepOutcome outcome = loop->trainStep(done);
          ++done;
          testKill.at(done, "update");
          loop->periodicActions(done, outcome);
          testKill.at(done, "save");
          stopped = loop->stopsAfter(done, outcome);
        }
      } catch (const PeerLostError& e) {
        if (!replicas) throw;
        // The step's update is done on this rank when the loss came after it (in the loss's
        // all-gather, the metrics', a checkpoint's): the survivors agree on it, or give up.
        const bool updated = main.stepsApplied() + main.stepsSkipped() > updatesBefore;
        const int64_t stepsDone = stepStart + (updated ? 1 : 0);
        loop.reset();
        try {
          run = goOnWithoutTheLostGroup(*replicas, std::move(run), stepsDone, e.what());
        } catch (const ReplicaGroupLeftError& left) {
          // Alive, but out of the run with its group: a rank of it is lost, or was taken for
          // lost (its heartbeats late on an overloaded host). It asks to rejoin in process, so
          // a late group costs no restart; when the rest of its group does not ask with it, a
          // rank of it is really gone and this one leaves (its launcher restarts the node).
          // Its launcher stopping the node (a rank of it died) ends it at once, as during the
          // set-up: a stop that came already, or one that comes while it waits.
          const StopSignals endAtOnce(SIG_DFL);
          if (g_stopRequested) throw;
          TLOG_WARN(firstLine(left.what()) << "; asking to rejoin in process (its whole replica group must ask within "
                                           << kGroupAsksToRejoinWithin.count() / 1000.0 << " s)");
          run = rejoin(state_->config, state_->resolvedYaml, replicas, kGroupAsksToRejoinWithin);
          if (!run) break;  // the run finished without this rank
        }
        loop = std::make_unique<TrainLoop>(*run, replicas->groupSize());
        done = run->startStep;
        continue;
      }
      if (admit) {
        loop.reset();
        admitRejoiningGroups(*replicas, run, done);  // or, when the donor is lost, the run without it
        loop = std::make_unique<TrainLoop>(*run, replicas->groupSize());
      }
    }
  }
  if (!run) return finishedWithoutThisRank();
  // A group still waiting to rejoin stops waiting (rank 0: the store's host).
  if (replicas && run->comm->rank() == 0) replicas->finished();
  return loop->finish(done, stopped);
}

}  // namespace tessera::trainer
