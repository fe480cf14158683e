// The standard recipe (run.recipe standard): the one model trained on the data — the
// micro-batches' forward and backward, the strategy's step, the EMA update; held-out loss
// with the live and the EMA weights; DDPM samples of a diffusion model. Also the recipe
// factory and the helpers the recipes share (recipe.h).
#include <torch/utils.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <numeric>
#include <optional>

#include "checkpoint/safetensors.h"
#include "common/errors.h"
#include "common/logging.h"
#include "common/trace.h"
#include "distributed/communicator.h"
#include "ema/strategy_ema.h"
#include "sharding/canonical_reduce.h"
#include "sharding/fully_shard.h"
#include "datasets/batch_loader.h"
#include "models/diffusion.h"
#include "recipes/dmd_recipe.h"
#include "trainer/judge.h"
#include "models/models.h"
#include "models/train_model.h"
#include "trainer/recipe.h"
#include "recipes/recipe_steps.h"
#include "recipes/recipes.h"
#include "trainer/run_setup.h"
#include "models/sampling.h"

namespace tessera::recipes {

namespace fs = std::filesystem;

at::Tensor lossesOf(models::TrainModel& model, datasets::Batch batch, at::Device device) {
  batch.inputs = batch.inputs.to(device);
  if (batch.targets.defined()) batch.targets = batch.targets.to(device);
  return sharding::unitForward(model, batch.inputs, [&](const at::Tensor& inputs) {
    datasets::Batch b = batch;
    b.inputs = inputs;
    return model.losses(b);
  });
}

void forEachMicroBatch(const trainer::RunParts& run, trainer::ModelPart& part,
                       const std::function<void(const MicroBatch&)>& fn) {
  const auto micro = static_cast<size_t>(run.cfg.data.micro_batch);
  if (run.plan) {
    // run.deterministic: every rank runs as many passes as the rank with the most
    // micro-batches; the strategy keeps each micro-batch's gradients apart.
    const int rank = run.comm->rank();
    const int64_t mine = run.plan->end(rank) - run.plan->begin(rank);
    for (int64_t p = 0; p < run.plan->passes(); ++p) {
      const bool padding = p >= mine;
      const auto local = static_cast<size_t>(padding ? mine - 1 : p);
      part.strategy->setReshardAfterBackward(p + 1 == run.plan->passes());
      const MicroBatch mb{local * micro, (local + 1) * micro, padding ? -1 : run.plan->begin(rank) + p, padding};
      fn(mb);
      part.strategy->addMicroBatchGradients(mb.index);
    }
    return;
  }
  for (int64_t m = 0; m < run.microBatches; ++m) {
    const bool last = m + 1 == run.microBatches;
    if (!part.cfg.reduceEveryMicroBatch) part.strategy->setRequiresGradientSync(last);
    part.strategy->setReshardAfterBackward(last);  // the root's next gather would bring the same values
    fn(MicroBatch{static_cast<size_t>(m) * micro, static_cast<size_t>(m + 1) * micro, m, false});
  }
}

void StepLoss::add(const MicroBatch& mb, const at::Tensor& loss) {
  if (!mb.padding) values_[mb.index] += loss.detach().to(at::kDouble).cpu().item<double>();
}

double StepLoss::local() const {
  double sum = 0;
  for (const auto& [index, value] : values_) sum += value;
  return sum;
}

double meanStepLoss(const trainer::RunParts& run, const StepLoss& stepLoss, const sharding::StepSums& sums,
                    const std::string& name) {
  if (run.plan) return sharding::canonicalValueSum(*run.hostComm, run.plan->count, stepLoss.values());
  return sums[name] / static_cast<double>(run.comm->worldSize());
}

trainer::StepOutcome stepMainModel(const trainer::RunParts& run, trainer::ModelPart& part, int64_t step,
                                   const StepLoss& stepLoss, bool stopRequested,
                                   const std::map<std::string, const StepLoss*>& figures) {
  trainer::StepOutcome out;
  out.lr = part.schedule->lrAt(step);
  sharding::StepSums sums;
  sums.add("loss", stepLoss.local());
  for (const auto& [name, figure] : figures) sums.add("figure " + name, figure->local());
  sums.add("stop requests", stopRequested ? 1.0 : 0.0);
  sums.add("failed checkpoint writes", run.checkpointer && run.checkpointer->writerFailed() ? 1.0 : 0.0);
  out.result = part.strategy->step(out.lr, &sums);
  if (part.ema) {
    const trace::Span span("ema", "EMA update");
    part.ema->update(step + 1, !out.result.skipped);
  }
  out.loss = meanStepLoss(run, stepLoss, sums);
  for (const auto& [name, figure] : figures) out.extra[name] = meanStepLoss(run, *figure, sums, "figure " + name);
  out.stopSignalled = sums["stop requests"] > 0;
  out.checkpointFailed = sums["failed checkpoint writes"] > 0;
  return out;
}

namespace {

// meanOverRanks under run.deterministic: the n samples in chunks of data.micro_batch (the
// last one shorter), each chunk's losses summed in order on the rank that computes it,
// the chunks' sums added in index order, whatever the world size. Ranks run as many
// passes as the rank with the most chunks (padding passes recompute a chunk and drop it:
// zero3 gathers inside the forwards).
double canonicalMean(const trainer::RunParts& run, int64_t n,
                     const std::function<at::Tensor(int64_t begin, int64_t end)>& losses) {
  TESSERA_CHECK(n >= 1, "evaluation: no samples");
  const int rank = run.comm->rank(), world = run.comm->worldSize();
  const int64_t micro = run.cfg.data.micro_batch, chunks = (n + micro - 1) / micro;
  const sharding::MicroBatchPlan plan{chunks, world};
  const int64_t first = plan.begin(rank), mine = plan.end(rank) - first;
  std::map<int64_t, double> sums, counts;
  for (int64_t p = 0; p < std::max<int64_t>(1, plan.passes()); ++p) {
    const bool padding = p >= mine;
    const int64_t chunk = padding ? (mine > 0 ? first + mine - 1 : 0) : first + p;
    const at::Tensor each = losses(chunk * micro, std::min(n, (chunk + 1) * micro)).to(at::kDouble).contiguous().cpu();
    if (padding) continue;
    double sum = 0;
    const double* v = each.data_ptr<double>();
    for (int64_t i = 0; i < each.numel(); ++i) sum += v[i];
    sums[chunk] = sum;
    counts[chunk] = static_cast<double>(each.numel());
  }
  return sharding::canonicalValueSum(*run.hostComm, chunks, sums) /
         sharding::canonicalValueSum(*run.hostComm, chunks, counts);
}

}  // namespace

double meanOverRanks(const trainer::RunParts& run, int64_t n, const std::function<at::Tensor(int64_t begin, int64_t end)>& losses) {
  if (run.plan) return canonicalMean(run, n, losses);
  const int rank = run.comm->rank(), world = run.comm->worldSize();
  TESSERA_CHECK_AS(ConfigError, n >= world, "evaluation: ", n, " samples, fewer than the ", world,
                   " ranks (every rank runs the forwards; raise data.eval_fraction)");
  const int64_t begin = n * rank / world, end = n * (rank + 1) / world;
  const at::Tensor mine = losses(begin, end);
  at::Tensor sums = at::tensor({mine.to(at::kDouble).sum().item<double>(), static_cast<double>(mine.numel())}, at::kDouble);
  run.hostComm->allReduce(sums, distributed::ReduceOp::kSum);
  return sums[0].item<double>() / sums[1].item<double>();
}

std::string writeSamples(trainer::RunParts& run, const at::Tensor& samples, const std::string& generator) {
  if (run.comm->rank() != 0) return "";
  const std::string out = (run.runDir / "samples.safetensors").string();
  const at::Tensor cpu = samples.cpu();
  checkpoint::saveSafetensors(out, {{"samples", cpu}}, {{"generator", generator}});
  // The reference: up to 4096 held-out samples, or train samples when none are held out.
  const datasets::Dataset& data = *run.data;
  const bool heldOut = data.evalSamples() > 0;
  std::vector<int64_t> first(static_cast<size_t>(std::min<int64_t>(heldOut ? data.evalSamples() : data.trainSamples(), 4096)));
  std::iota(first.begin(), first.end(), 0);
  const datasets::Batch referenceBatch = heldOut ? data.evalBatch(0, static_cast<int64_t>(first.size())) : data.trainBatch(first);
  const at::Tensor reference = referenceBatch.inputs.flatten(1);
  const at::Tensor flat = cpu.flatten(1);
  const double meanError = (flat.mean(0) - reference.mean(0)).abs().mean().item<double>();
  // A spread needs two samples on each side.
  const std::string spread =
      flat.size(0) > 1 && reference.size(0) > 1
          ? strCat(", spread ratio ", (flat.std(0) / reference.std(0).clamp_min(1e-12)).mean().item<double>(),
                   " (1 = the data's)")
          : std::string();
  TLOG_INFO0("samples: " << flat.size(0) << " drawn with " << generator << "; per-feature mean differs from the "
                         << (heldOut ? "held-out" : "train") << " data's by " << meanError << " on average" << spread);
  return out;
}

trainer::SampleGrid writeStepGrid(trainer::RunParts& run, int64_t step, const std::string& name, const at::Tensor& samples,
                         int64_t perRow) {
  const fs::path dir = run.runDir / "samples";
  fs::create_directories(dir);
  char stepName[32];
  std::snprintf(stepName, sizeof(stepName), "step_%08lld", static_cast<long long>(step));
  const std::string path = (dir / strCat(stepName, "_", name, ".png")).string();
  return {name, path, models::writeSampleGrid(path, samples, perRow)};
}

namespace {

class StandardRecipe : public trainer::Recipe {
 public:
  explicit StandardRecipe(trainer::RunParts& run)
      : run_(run),
        part_(run.models.front()),
        loader_(*run.data, *run.sampler, run.samplePositions(), run.cfg.run.seed, run.cfg.data.hflip) {
    // Loaded on every rank when the run starts: a classifier that cannot be used fails
    // every rank now, not rank 0 after the training.
    if (!run.cfg.eval.judge.empty()) {
      try {
        judge_.emplace(run.cfg.eval.judge);
      } catch (const std::exception& e) {
        throw ConfigError(strCat("eval.judge: ", e.what()));
      }
    }
  }

  // The micro-batches' forward and backward, the strategy's step (gradient sync,
  // clipping, optimizer; the loss and the stop flags summed in its norm's all-reduce),
  // and the EMA update.
  trainer::StepOutcome step(int64_t step, bool stopRequested) override {
    part_.strategy->zeroGrad();
    const datasets::StepBatch mine = loader_.take(step);  // prepared while the previous step ran
    StepLoss stepLoss;
    forEachMicroBatch(run_, part_, [&](const MicroBatch& mb) {
      at::Tensor loss;
      {
        const trace::Span span("compute", "forward (micro-batch)");
        loss = lossesOf(*part_.model,
                        datasets::sliceBatch(mine.batch, static_cast<int64_t>(mb.begin), static_cast<int64_t>(mb.end)),
                        run_.device)
                   .mean() /
               static_cast<double>(run_.lossDivisor);
      }
      const trace::Span span("compute", "backward (micro-batch)");
      loss.backward();
      stepLoss.add(mb, loss);
    });
    trainer::StepOutcome out = stepMainModel(run_, part_, step, stepLoss, stopRequested);
    out.extra["data_wait_ms"] = loader_.takeWaitSeconds() * 1000.0;
    return out;
  }

  void evaluate(std::map<std::string, double>& out) override {
    if (run_.data->evalSamples() <= 0) return;
    out["eval_loss"] = heldOutLoss();
    const bool classifier = dynamic_cast<models::FeatureModel*>(part_.model.get()) != nullptr && run_.data->spec().classes > 0;
    if (classifier) out["eval_accuracy"] = heldOutAccuracy();
    // Each EMA profile: the first as eval_loss_ema, the others by name
    // (eval_loss_model_ema_0.999).
    for (size_t d = 0; part_.ema && d < part_.ema->numProfiles(); ++d) {
      double emaLoss = 0, emaAccuracy = 0;
      ema::withEmaWeights(*part_.ema, *part_.strategy, d, [&] {
        emaLoss = heldOutLoss();
        if (classifier) emaAccuracy = heldOutAccuracy();
      });
      const std::string suffix = d == 0 ? "ema" : part_.ema->stateName(d);
      out["eval_loss_" + suffix] = emaLoss;
      if (classifier) out["eval_accuracy_" + suffix] = emaAccuracy;
    }
  }

  // DDPM samples drawn with generator_ema (every rank runs the sampler with the same seed,
  // as zero3 gathers collectively); a class-conditional model's cycle through the classes.
  std::string drawSamples() override {
    auto* model = dynamic_cast<models::Denoiser*>(part_.model.get());
    TESSERA_CHECK(model != nullptr && part_.ema != nullptr, "model.samples needs a denoiser and an EMA");
    const trainer::TrainConfig& cfg = run_.cfg;
    const int64_t count = cfg.defaults.model.samples;
    const at::Tensor noise = models::samplingNoise(model->sampleShape(), count, datasets::noiseSeed(cfg.run.seed, -2, 0));
    const at::Tensor labels = model->classes() > 0 ? at::arange(count, at::kLong).remainder(model->classes()) : at::Tensor();
    at::Tensor samples;
    ema::withEmaWeights(*part_.ema, *part_.strategy, 0, [&] {
      models::SampleRequest request;
      request.noise = noise;
      request.labels = labels;
      request.sampler = "ddpm";
      request.seed = static_cast<int64_t>(datasets::noiseSeed(cfg.run.seed, -2, 1));
      samples = models::drawSamples(*model, request, /*comm=*/nullptr, run_.device);
    });
    return writeSamples(run_, samples, part_.cfg.names.ema);
  }

  // One forward and one backward (twice the forward's FLOPs) per sample.
  double trainFlopsPerSample() const override { return 3.0 * part_.model->forwardFlopsPerSample(); }
  int64_t tokensPerSample() const override { return part_.model->tokensPerSample(); }

  std::vector<trainer::SampleGrid> writeSampleGrids(int64_t step) override {
    auto* model = dynamic_cast<models::Denoiser*>(part_.model.get());
    if (model == nullptr || model->sampleShape().size() != 3) return {};  // not an image denoiser
    const trainer::EvalSection& e = run_.cfg.eval;
    const models::SampleRequest request = evalRequest(*model, e.sample_per_class);
    std::vector<trainer::SampleGrid> written;
    const auto draw = [&](const std::string& name) {
      const at::Tensor samples = models::drawSamples(*model, request, run_.hostComm.get(), run_.device);
      if (run_.comm->rank() == 0) written.push_back(writeStepGrid(run_, step, name, samples, e.sample_per_class));
    };
    if (part_.ema) {
      for (size_t d = 0; d < part_.ema->numProfiles(); ++d) {
        ema::withEmaWeights(*part_.ema, *part_.strategy, d, [&] { draw(part_.ema->stateName(d)); });
      }
    }
    {
      torch::NoGradGuard noGrad;
      draw("live");
    }
    return written;
  }

  std::string judgeSamples() override {
    if (!judge_) return "";
    auto& model = dynamic_cast<models::Denoiser&>(*part_.model);
    const models::SampleRequest request = evalRequest(model, run_.cfg.eval.judge_per_class);
    at::Tensor samples;
    ema::withEmaWeights(*part_.ema, *part_.strategy, 0,
                        [&] { samples = models::drawSamples(model, request, run_.hostComm.get(), run_.device); });
    if (run_.comm->rank() != 0) return "";
    const trainer::Judgement j = judge_->judge(samples, request.labels);
    return strCat("judge: ", j.samples, " samples of ", part_.cfg.names.ema, " (DDIM ", request.steps, " steps, guidance ",
                  request.cfg, models::guidanceIntervalText(run_.cfg.eval.sample_cfg_interval), "): accuracy ", j.accuracy, " (real images: ", j.realAccuracy, "), Frechet distance ",
                  j.frechet, " (", j.samples, " real images: ", j.realFrechet, "); ", trainer::perClassText(j));
  }

 private:
  // The grids' and the judge's samples: `perClass` of each class, DDIM at eval.sample_steps
  // (at most the model's timesteps) with guidance eval.sample_cfg in eval.sample_cfg_interval.
  models::SampleRequest evalRequest(const models::Denoiser& model, int64_t perClass) const {
    models::SampleRequest request = models::gridRequest(model, perClass, run_.cfg.run.seed);
    request.steps = std::min(run_.cfg.eval.sample_steps, model.schedule().timesteps);
    request.cfg = run_.cfg.eval.sample_cfg;
    request.cfgInterval = models::makeGuidanceInterval(run_.cfg.eval.sample_cfg_interval);
    return request;
  }

  // The mean loss over the first (up to 4096) held-out samples' predictions.
  double heldOutLoss() {
    torch::NoGradGuard noGrad;
    return meanOverRanks(run_, std::min<int64_t>(run_.data->evalSamples(), 4096), [&](int64_t begin, int64_t end) {
      datasets::Batch batch = run_.data->evalBatch(begin, end - begin);
      std::vector<int64_t> indices(static_cast<size_t>(end - begin));
      std::iota(indices.begin(), indices.end(), begin);
      datasets::seedNoise(batch, run_.cfg.run.seed, -1, indices);
      return lossesOf(*part_.model, batch, run_.device);  // one per prediction, not per window
    });
  }

  // A classifier's accuracy over every held-out sample: the fraction whose largest logit
  // is its class.
  double heldOutAccuracy() {
    torch::NoGradGuard noGrad;
    auto& model = dynamic_cast<models::FeatureModel&>(*part_.model);
    return meanOverRanks(run_, run_.data->evalSamples(), [&](int64_t begin, int64_t end) {
      const datasets::Batch batch = run_.data->evalBatch(begin, end - begin);
      const at::Tensor logits = sharding::unitForward(model, batch.inputs.to(run_.device),
                                                      [&model](const at::Tensor& x) { return model.forward(x); });
      return logits.argmax(1).cpu().eq(batch.targets).to(at::kDouble);
    });
  }

  trainer::RunParts& run_;
  trainer::ModelPart& part_;
  datasets::BatchLoader loader_;
  std::optional<trainer::SampleJudge> judge_;  // eval.judge
};

}  // namespace

std::unique_ptr<trainer::Recipe> makeStandardRecipe(trainer::RunParts& run) { return std::make_unique<StandardRecipe>(run); }

}  // namespace tessera::recipes
