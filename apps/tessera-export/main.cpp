// tessera-export: writes consolidated safetensors from a sharded checkpoint, offline
// (no distributed job; any saved world size), streaming one block at a time.
//   tessera-export CKPT_DIR --what generator_ema|generator_ema_0.999|model --out FILE_OR_DIR
//                  [--dtype fp32|bf16|fp16] [--max-shard-size 2GB] [--no-verify]
// CKPT_DIR is a step_N directory, or a run's checkpoints directory (its newest complete
// checkpoint is used). Post-hoc EMA (docs/ema.md), from a run's posthoc/ snapshots:
//   tessera-export RUN_DIR --posthoc-ema SIGMA_REL [--at-step S] --out FILE
//   tessera-export RUN_DIR --posthoc-ema S1,S2,... --judge CLASSIFIER [--per-class N] [--steps K]
//                  [--cfg C] [--cfg-interval F,L] [--seed S] --out FILE  (the sweep: the judge keeps the best;
//                  under tessera-run its samples are split over the ranks)
//   tessera-export RUN_DIR --list
// Exit status: 0 ok, 2 bad arguments, 1 failure (corruption, I/O).

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <optional>
#include <sstream>

#include "checkpoint/exporter.h"
#include "checkpoint/file_io.h"
#include "checkpoint/format.h"
#include "checkpoint/metadata.h"
#include "checkpoint/reader.h"
#include "common/app_main.h"
#include "common/command_line.h"
#include "common/errors.h"
#include "common/signal_thread.h"
#include "common/logging.h"
#include "distributed/rank_env.h"
#include "distributed/runtime.h"
#include "ema/posthoc.h"
#include "models/model_options.h"
#include "checkpoint/formats_1_2.h"
#include "trainer/model_metadata.h"
#include "trainer/posthoc_sweep.h"
#include "trainer/train_counters.h"

namespace ckpt = tessera::checkpoint;

namespace {

// --list: the snapshots, their profiles, and what can be reconstructed reliably.
int listPosthoc(const std::string& dir) {
  const auto snapshots = tessera::ema::listPosthocSnapshots(dir);
  double lo = 1, hi = 0;
  for (const auto& s : snapshots) {
    std::cout << "step " << s.step << "  " << s.dir << "  sigma_rel";
    for (const auto& [name, sigma] : s.profiles) {
      std::cout << " " << sigma;
      lo = std::min(lo, sigma);
      hi = std::max(hi, sigma);
    }
    std::cout << "\n";
  }
  std::cout << snapshots.size() << " snapshots, steps " << snapshots.front().step << " to " << snapshots.back().step
            << "; reconstructs sigma_rel in [" << lo << ", " << hi
            << "] reliably (the tracked range; outside it the fit extrapolates), at any step up to "
            << snapshots.back().step << "\n";
  return 0;
}

// The command line, as parsed.
struct ExportArgs {
  std::string dir, out, dtype, maxShard;
  bool noVerify = false;
  ckpt::ExportOptions options;
  std::string posthocList;           // --posthoc-ema as given: one sigma_rel or a comma-separated list
  std::vector<double> posthocSigmas;  // ... parsed
  std::optional<int64_t> atStep;
  tessera::trainer::PosthocSweepOptions sweep;  // with --judge
  bool list = false;
};

// --posthoc-ema's "0.05" or "0.05,0.07,0.1" (one value per argument: a list is one word, so
// the run directory after it stays the positional argument).
std::vector<double> parseSigmaList(const std::string& text) {
  std::vector<double> out;
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    size_t used = 0;
    double value = 0;
    try {
      value = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || !std::isfinite(value)) {
      throw tessera::UsageError(tessera::strCat("--posthoc-ema ", text, ": '", item, "' is not a number"));
    }
    out.push_back(value);
  }
  if (out.empty() || text.back() == ',') throw tessera::UsageError(tessera::strCat("--posthoc-ema ", text, ": no sigma_rel"));
  return out;
}

// Declares the options and which ones exclude each other.
void addOptions(CLI::App& app, ExportArgs& args) {
  app.add_option("CKPT_DIR", args.dir,
                 "Checkpoint step directory, or a run's checkpoints directory; with --posthoc-ema or --list: "
                 "the run directory (or its posthoc/ directory)")
      ->required();
  auto* what = app.add_option("--what", args.options.what,
                              "generator_ema | generator_ema_<decay> | model | a prefix ending in '/'");
  auto* posthoc = app.add_option("--posthoc-ema", args.posthocList,
                                 "Reconstruct the power-function EMA of this sigma_rel from the run's post-hoc "
                                 "snapshots (ema.posthoc); with --judge, a comma-separated list to sweep")
                      ;
  auto* judge = app.add_option("--judge", args.sweep.judge,
                               "With --posthoc-ema: sample each sigma_rel's EMA, judge it with this classifier "
                               "export (as tessera-sample --judge), keep the lowest Frechet distance as --out, and "
                               "write <out>_sweep.tsv and <out>_sweep.svg")
                    ->needs(posthoc);
  app.add_option("--per-class", args.sweep.perClass, "With --judge: samples per class")->needs(judge)->check(CLI::Range(2, 100000));
  app.add_option("--steps", args.sweep.steps, "With --judge: DDIM steps (default: the model's sample_timesteps, or 50)")->needs(judge)->check(CLI::Range(1, 100000));
  app.add_option("--cfg", args.sweep.cfg, "With --judge: classifier-free guidance scale")->needs(judge)
      ->check(CLI::Range(0.0, 100.0));
  app.add_option("--cfg-interval", args.sweep.cfgInterval,
                 "With --judge: FIRST,LAST, the timesteps where the guidance applies (as tessera-sample's)")
      ->needs(judge)
      ->delimiter(',')
      ->expected(2);
  app.add_option("--seed", args.sweep.seed, "With --judge: the sampling noise's seed (as tessera-sample's)")->needs(judge);
  app.add_option("--at-step", args.atStep,
                 "With --posthoc-ema: the step to reconstruct at (default: the last snapshot)")
      ->needs(posthoc);
  auto* listFlag =
      app.add_flag("--list", args.list, "List the run's post-hoc snapshots and the sigma_rel range they cover");
  auto* outOption = app.add_option("--out", args.out, "Output .safetensors file (a directory with --max-shard-size)");
  what->excludes(posthoc)->excludes(listFlag);
  posthoc->excludes(listFlag);
  outOption->excludes(listFlag);
  app.add_option("--dtype", args.dtype, "Cast floating-point tensors: fp32 | bf16 | fp16");
  app.add_option("--max-shard-size", args.maxShard, "Split into files of at most this size, e.g. 2GB, 500MiB");
  app.add_flag("--no-verify", args.noVerify, "Skip checksum verification");
}

// --posthoc-ema with --judge: each sigma_rel reconstructed, sampled and judged; the best kept.
// Under a launcher (tessera-run, torchrun, srun -n N) the samples are split over the ranks;
// rank 0 alone writes and prints.
int sweepPosthoc(const ExportArgs& args) {
  tessera::trainer::PosthocSweepOptions options = args.sweep;
  options.sigmas = args.posthocSigmas;
  options.atStep = args.atStep;
  options.verify = args.options.verify;
  const auto env = tessera::distributed::RankEnv::fromEnvironment();
  std::shared_ptr<tessera::distributed::Runtime> runtime;
  if (env.world_size > 1) runtime = tessera::distributed::Runtime::init(env);
  const auto result =
      tessera::trainer::sweepPosthocEma(args.dir, args.out, options, runtime ? runtime->comm().get() : nullptr);
  if (env.rank != 0) return 0;
  std::cout << "post-hoc EMA sweep at step " << result.step << " (" << options.perClass << " samples per class, "
            << result.sampler << ", guidance " << options.cfg
            << tessera::models::guidanceIntervalText(options.cfgInterval) << "; judged by " << options.judge << "):\n"
            << "  sigma_rel  Frechet  accuracy\n";
  for (size_t i = 0; i < result.points.size(); ++i) {
    const auto& p = result.points[i];
    std::cout << "  " << p.sigmaRel << "  " << p.judgement.frechet << "  " << p.judgement.accuracy
              << (i == result.best ? "  <- kept" : "") << "\n";
  }
  std::cout << "kept sigma_rel " << result.points[result.best].sigmaRel << ": " << args.out << "\n  table: "
            << result.table << "\n  plot:  " << result.plot << "\n";
  return 0;
}

// --posthoc-ema: one file in the saved dtype, reconstructed from the run's snapshots.
int reconstructPosthoc(const ExportArgs& args) {
  if (!args.dtype.empty() || !args.maxShard.empty()) {
    throw tessera::UsageError("--posthoc-ema writes one file in the saved dtype: no --dtype or --max-shard-size");
  }
  if (!args.sweep.judge.empty()) return sweepPosthoc(args);
  if (args.posthocSigmas.size() != 1) {
    throw tessera::UsageError("--posthoc-ema: one sigma_rel, or a list to sweep with --judge CLASSIFIER");
  }
  tessera::ema::PosthocOptions posthocOptions;
  posthocOptions.sigmaRel = args.posthocSigmas.front();
  posthocOptions.atStep = args.atStep;
  posthocOptions.verify = args.options.verify;
  // The model it holds, as the run's own exports say it (tessera-sample reads it).
  std::string model;
  try {
    model = tessera::trainer::posthocModelMetadata(args.dir);
  } catch (const std::exception& e) {  // the snapshots alone make the file; it just cannot say its model
    // Unless they are missing or cannot be combined: then the reconstruction's own error, alone.
    tessera::ema::listPosthocSnapshots(args.dir);
    std::cerr << "tessera-export: warning: the run's checkpoints do not say which model the snapshots hold (" << e.what()
              << "); the file will carry no model description\n";
  }
  if (!model.empty()) posthocOptions.metadata[tessera::trainer::kModelMetadataKey] = model;
  const auto result = tessera::ema::reconstructPosthocEma(args.dir, args.out, posthocOptions);
  std::cout << "reconstructed the post-hoc EMA of sigma_rel " << posthocOptions.sigmaRel << " at step " << result.step
            << " from " << result.used.size() << " snapshots (" << result.weights.size() << " profiles): "
            << result.tensors << " tensors (" << result.bytes << " bytes) in " << result.seconds << " s\n  " << args.out
            << "\n";
  return 0;
}

// CKPT_DIR itself if it is a complete checkpoint, else the newest complete one in it.
std::string checkpointStepDir(const std::string& dir) {
  const std::string stepDir = ckpt::checkpointOrNewestIn(dir);
  if (stepDir.empty()) {
    throw tessera::UsageError(tessera::strCat(dir, " is neither a complete checkpoint (no metadata.json) nor a ",
                                              "directory holding one"));
  }
  if (stepDir != dir) std::cerr << "tessera-export: using the newest complete checkpoint " << stepDir << "\n";
  return stepDir;
}

// --what as the tensor-name prefix it stands for in the checkpoint (its export names; for
// checkpoints older than the component table, those of the trainer's layout), and the
// model description the run recorded for it (trainer_state.json), so that the file says
// which model it holds, as the run's own exports do.
void resolveWhat(const std::string& stepDir, ckpt::ExportOptions& options) {
  ckpt::CheckpointReader reader(stepDir);
  std::string prefix;
  try {
    prefix = ckpt::resolveExportPrefix(reader.metadata(), options.what,
                                       tessera::checkpoint::checkpointExportNames(reader.metadata()));
  } catch (const ckpt::CheckpointError& e) {  // what the user asked for is not there: their mistake
    throw tessera::UsageError(tessera::strCat("--what ", options.what, ": ", e.what()));
  }
  const std::string asked = options.what;
  options.what = prefix;
  const auto described = tessera::trainer::modelMetadataFromJson(
      reader.trainerState(), (std::filesystem::path(stepDir) / "trainer_state.json").string());
  const std::string model = tessera::trainer::modelMetadataForPrefix(described, prefix);
  if (model.empty()) return;
  // Checked before it is copied: an export says only what its tensors can be.
  tessera::trainer::checkedModelMetadata(
      model, tessera::strCat((std::filesystem::path(stepDir) / "trainer_state.json").string(), " (", asked, ")"),
      tessera::trainer::shapesUnder(reader.metadata(), prefix));
  options.metadata[tessera::trainer::kModelMetadataKey] = model;
}

// --what: exports that part of the checkpoint and lists the files written.
int exportWhat(const ExportArgs& args) {
  const std::string stepDir = checkpointStepDir(args.dir);
  ckpt::ExportOptions options = args.options;
  resolveWhat(stepDir, options);
  const auto result = ckpt::exportCheckpoint(stepDir, args.out, options);
  std::cout << "exported " << result.tensors << " tensors under '" << result.prefix << "' (" << result.totalBytes
            << " bytes) from " << stepDir << " in " << result.seconds << " s\n";
  for (const auto& f : result.files) std::cout << "  " << f << "\n";
  if (!result.indexFile.empty()) std::cout << "  " << result.indexFile << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return tessera::runMain("tessera-export", [&]() -> int {
    tessera::routeSignalsToOwnThread();  // before any thread starts: no handler runs inside a oneDNN product
    CLI::App app{"Tessera: export consolidated safetensors from a sharded checkpoint"};
    ExportArgs args;
    addOptions(app, args);
    if (const auto done = tessera::parseCommandLine(app, argc, argv)) return *done;
    // A single-process tool but for the post-hoc sweep, which splits its samples over ranks:
    // started as several ranks otherwise, every rank would write the same --out, and one
    // read another's half-written file.
    const auto env = tessera::distributed::RankEnv::fromEnvironment();
    if (env.world_size > 1 && (args.posthocList.empty() || args.sweep.judge.empty())) {
      throw tessera::UsageError(tessera::strCat("tessera-export runs as one process (only the post-hoc sweep, "
                                                "--posthoc-ema S1,S2,... --judge, runs as ranks), but this is ",
                                                env.describe(), ": run it without tessera-run, torchrun or srun -n N"));
    }
    tessera::log::LogOptions logOptions;
    logOptions.rank = env.world_size > 1 ? env.rank : -1;  // a single process: no rank prefix
    logOptions.level = "warn";
    tessera::log::init(logOptions);
    if (!args.dtype.empty()) args.options.dtype = ckpt::parseExportDtype(args.dtype);
    if (!args.maxShard.empty()) args.options.maxShardBytes = ckpt::parseByteSize(args.maxShard);
    args.options.verify = !args.noVerify;
    if (args.list) return listPosthoc(args.dir);
    if (args.out.empty()) throw tessera::UsageError("--out is required");
    std::vector<std::string> inputs{args.dir};
    if (!args.sweep.judge.empty()) inputs.push_back(args.sweep.judge);
    ckpt::checkOutputOutsideState(args.out, "--out", inputs);
    if (!args.posthocList.empty()) {
      args.posthocSigmas = parseSigmaList(args.posthocList);
      return reconstructPosthoc(args);
    }
    if (args.options.what.empty()) throw tessera::UsageError("give --what (or --posthoc-ema, or --list)");
    return exportWhat(args);
  });
}
