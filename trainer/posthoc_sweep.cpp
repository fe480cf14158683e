// Choosing the post-hoc EMA length by the judge (see posthoc_sweep.h).
#include "trainer/posthoc_sweep.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <optional>
#include <sstream>

#include "checkpoint/reader.h"
#include "common/errors.h"
#include "common/file_open.h"
#include "distributed/communicator.h"
#include "distributed/string_collectives.h"
#include "ema/posthoc.h"
#include "models/diffusion.h"
#include "models/sampling.h"
#include "sharding/tensor_sync.h"
#include "trainer/metrics.h"
#include "trainer/model_loading.h"
#include "trainer/model_metadata.h"
#include "trainer/train_counters.h"

namespace tessera::trainer {
namespace fs = std::filesystem;

std::string posthocModelMetadata(const std::string& runDir) {
  fs::path dir(runDir);
  if (dir.filename() == "posthoc" || (dir.filename().empty() && dir.parent_path().filename() == "posthoc")) {
    dir = dir.filename().empty() ? dir.parent_path().parent_path() : dir.parent_path();
  }
  const std::string stepDir = checkpoint::checkpointOrNewestIn((dir / "checkpoints").string());
  if (stepDir.empty()) return "";
  checkpoint::CheckpointReader reader(stepDir);
  const auto described = modelMetadataFromJson(reader.trainerState(), (fs::path(stepDir) / "trainer_state.json").string());
  const std::vector<ema::PosthocSnapshot> snapshots = ema::listPosthocSnapshots(runDir);
  if (snapshots.empty() || snapshots.front().profiles.empty()) return "";
  // A power-function profile "<ema>_phema<sigma>" is of the model its EMA averages.
  return modelMetadataForPrefix(described, "ema/" + snapshots.front().profiles.front().first + "/");
}

namespace {

constexpr int64_t kDefaultSteps = 50;  // DDIM's steps when neither --steps nor the model names them

std::string withoutSuffix(const std::string& path, const std::string& suffix) {
  return path.size() > suffix.size() && path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0
             ? path.substr(0, path.size() - suffix.size())
             : path;
}

// The request the judge's samples of one reconstruction (`file`, for errors) are drawn with:
// every class from fixed noise, at the sweep's sampler.
void requestSamples(const LoadedModel& loaded, const std::string& file, const PosthocSweepOptions& o,
                    models::SampleRequest* request, std::string* sampler) {
  auto* denoiser = dynamic_cast<models::Denoiser*>(loaded.model.get());
  TESSERA_CHECK_AS(UsageError, denoiser != nullptr && denoiser->classes() > 0, file,
                   ": the post-hoc sweep judges a class-conditional denoiser (dit), not ", loaded.description.model.arch);
  *request = models::SampleRequest{};
  std::vector<int64_t> classes(static_cast<size_t>(denoiser->classes()));
  std::iota(classes.begin(), classes.end(), 0);
  request->labels = models::classRows(classes, o.perClass);
  request->noise = models::samplingNoise(denoiser->sampleShape(), request->labels.size(0), static_cast<uint64_t>(o.seed));
  // As tessera-sample: a model with its own timesteps samples at them unless told the steps.
  if (!o.steps && models::useOwnTimesteps(*request, *denoiser, loaded.description.model.sample_timesteps,
                                          file + ": model.sample_timesteps")) {
    std::string list;
    for (int64_t t : request->timesteps) list += strCat(list.empty() ? "" : ", ", t);
    *sampler = "DDIM at the model's timesteps " + list;
  } else {
    request->steps = o.steps.value_or(kDefaultSteps);
    *sampler = strCat("DDIM ", request->steps, " steps");
  }
  request->cfg = o.cfg;
  const std::string interval = models::guidanceIntervalProblem(o.cfgInterval, denoiser->schedule().timesteps);
  TESSERA_CHECK_AS(UsageError, interval.empty(), "--cfg-interval: ", interval);
  request->cfgInterval = models::makeGuidanceInterval(o.cfgInterval);
}

// Rank 0's model on every rank: its parameters and buffers broadcast into the others' model of
// the same description (in buffers of 64 MiB), so that only rank 0 reads files.
void broadcastWeights(distributed::Communicator* comm, torch::nn::Module& model) {
  if (comm == nullptr) return;
  std::vector<at::Tensor> tensors = model.parameters();
  for (const at::Tensor& b : model.buffers()) tensors.push_back(b);
  sharding::broadcastCoalesced(tensors, *comm, /*root=*/0, int64_t{64} << 20);
}

// How long the other ranks wait for rank 0's reconstruction or judgement of one sigma_rel.
constexpr std::chrono::minutes kRankZeroWork{30};

}  // namespace

PosthocSweepResult sweepPosthocEma(const std::string& runDir, const std::string& outPath,
                                   const PosthocSweepOptions& options, distributed::Communicator* comm) {
  TESSERA_CHECK_AS(UsageError, !options.sigmas.empty(), "--posthoc-ema: no sigma_rel to sweep");
  // Every number checked before the first reconstruction, not when its turn comes minutes later.
  for (double sigma : options.sigmas) ema::checkPosthocSigma(sigma);
  TESSERA_CHECK_AS(UsageError, std::isfinite(options.cfg), "--cfg: ", options.cfg, " is not a number");
  std::vector<double> sorted = options.sigmas;
  std::sort(sorted.begin(), sorted.end());
  TESSERA_CHECK_AS(UsageError, std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
                   "--posthoc-ema: a sigma_rel is given twice");
  // Rank 0 alone reads the run directory and writes beside --out; the other ranks are sent what
  // they need (the model description, each reconstruction's weights), so they may be on
  // another node without the run's files.
  const bool writer = comm == nullptr || comm->rank() == 0;
  std::string model;
  distributed::runOnEveryRank(comm, "reading the run's model description", [&] {
    if (writer) model = posthocModelMetadata(runDir);
  });
  model = distributed::broadcastString(comm, model, 0);
  TESSERA_CHECK_AS(UsageError, !model.empty(), runDir,
                   ": no checkpoint of the run says which model its snapshots hold (the sweep samples from each "
                   "reconstruction); keep a checkpoint in <run.dir>/checkpoints");
  // Checked against the model the snapshots hold before any reconstruction (a model with its
  // own sample_timesteps samples at them unless --steps is given).
  const models::ModelOptions described = parseModelMetadata(model, runDir).model;
  if (options.steps || described.sample_timesteps.empty()) {
    const int64_t steps = options.steps.value_or(kDefaultSteps);
    TESSERA_CHECK_AS(UsageError, steps <= described.timesteps, "--steps ", steps, options.steps ? "" : " (the default)",
                     ": more steps than the model's ", described.timesteps, " timesteps");
  }
  // The judge loads first: a classifier that cannot judge fails before any reconstruction.
  std::optional<SampleJudge> judge;
  distributed::runOnEveryRank(comm, "loading the judge", [&] {
    if (!writer) return;
    try {
      judge.emplace(options.judge);
    } catch (const Error& e) {
      throw UsageError(strCat("--judge ", e.what()));
    }
  });

  PosthocSweepResult result;
  const std::string stem = withoutSuffix(outPath, ".safetensors");
  // Working files beside --out, never a file that is already there (it might be the user's).
  const std::string candidate = stem + ".sweep_candidate.safetensors", kept = stem + ".sweep_best.safetensors";
  distributed::runOnEveryRank(comm, "checking --out", [&] {
    if (!writer) return;
    // The best is renamed over --out at the very end: a directory or a FIFO there fails now.
    try {
      checkReplaceable(outPath);
    } catch (const Error& e) {
      throw UsageError(strCat("--out ", e.what()));
    }
    for (const std::string& path : {candidate, kept}) {
      std::error_code ignored;
      TESSERA_CHECK_AS(UsageError, !fs::exists(fs::symlink_status(path, ignored)), "--out ", outPath, ": ",
                       path, " exists (the sweep's working file): remove it or choose another --out");
    }
  });
  double bestFrechet = 0;
  try {
    for (double sigma : options.sigmas) {
      // The other ranks wait while rank 0 alone reconstructs (and below, judges): minutes for
      // a large model's many snapshots, so longer than a collective's usual 5.
      std::optional<distributed::TimeoutScope> rankZeroWork(std::in_place, kRankZeroWork);
      distributed::runOnEveryRank(comm, strCat("reconstructing sigma_rel ", sigma), [&] {
        if (!writer) return;
        ema::PosthocOptions reconstruct;
        reconstruct.sigmaRel = sigma;
        reconstruct.atStep = options.atStep;
        reconstruct.verify = options.verify;
        reconstruct.metadata[kModelMetadataKey] = model;
        result.step = ema::reconstructPosthocEma(runDir, candidate, reconstruct).step;
      });
      // Rank 0 reads the candidate and sends its weights; every rank draws its share, the
      // samples gather on rank 0, which judges them and keeps or drops the candidate while
      // the others go on.
      rankZeroWork.reset();
      models::SampleRequest request;
      LoadedModel loaded;
      distributed::runOnEveryRank(comm, strCat("reading sigma_rel ", sigma, "'s reconstruction ", candidate), [&] {
        loaded = writer ? loadExportedModel(candidate) : buildDescribedModel(model, runDir + " (from rank 0)");
        requestSamples(loaded, candidate, options, &request, &result.sampler);
      });
      broadcastWeights(comm, *loaded.model);
      const at::Tensor samples =
          models::drawSamples(dynamic_cast<models::Denoiser&>(*loaded.model), request, comm, at::kCPU);
      rankZeroWork.emplace(kRankZeroWork);
      distributed::runOnEveryRank(comm, strCat("judging sigma_rel ", sigma), [&] {
        if (!writer) return;
        PosthocSweepPoint point{sigma, judge->judge(samples, request.labels)};
        // A distance that is not finite (samples gone to NaN) is never the best.
        if (std::isfinite(point.judgement.frechet) && (!fs::exists(kept) || point.judgement.frechet < bestFrechet)) {
          bestFrechet = point.judgement.frechet;
          result.best = result.points.size();
          fs::rename(candidate, kept);
        } else {
          fs::remove(candidate);
        }
        result.points.push_back(point);
      });
    }
    distributed::runOnEveryRank(comm, "keeping the best", [&] {
      if (!writer) return;
      TESSERA_CHECK(fs::exists(kept), "--posthoc-ema: no sigma_rel gave samples with a finite Frechet distance");
      fs::rename(kept, outPath);
    });
  } catch (...) {  // no working file left behind
    if (writer) {
      std::error_code ignored;
      fs::remove(candidate, ignored);
      fs::remove(kept, ignored);
    }
    throw;
  }
  if (!writer) return result;

  std::ostringstream table;
  table << "sigma_rel\tfrechet\taccuracy\tsamples\n";
  ChartSeries frechet{"Frechet distance", {}}, accuracy{"accuracy (%)", {}};
  for (const PosthocSweepPoint& p : result.points) {
    table << p.sigmaRel << "\t" << p.judgement.frechet << "\t" << p.judgement.accuracy << "\t" << p.judgement.samples
          << "\n";
    frechet.points.emplace_back(p.sigmaRel, p.judgement.frechet);
    accuracy.points.emplace_back(p.sigmaRel, 100 * p.judgement.accuracy);
  }
  for (ChartSeries* s : {&frechet, &accuracy}) std::sort(s->points.begin(), s->points.end());
  result.table = stem + "_sweep.tsv";
  result.plot = stem + "_sweep.svg";
  replaceFile(result.table, table.str());
  // One chart each: on a shared axis a Frechet distance of 30 and an accuracy of 84% are two
  // flat lines, their changes with sigma_rel invisible.
  replaceFile(result.plot,
              stackChartsSvg({renderLineChartSvg({frechet}, strCat("post-hoc EMA at step ", result.step, ": the judge's scores"),
                                                 "sigma_rel", "Frechet distance (lower is better)"),
                              renderLineChartSvg({accuracy}, "", "sigma_rel", "accuracy (%)")}));
  return result;
}

}  // namespace tessera::trainer
