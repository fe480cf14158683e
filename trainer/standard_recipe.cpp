// The standard recipe (run.recipe standard): the one model trained on the data — the
// micro-batches' forward and backward, the strategy's step, the EMA update; held-out loss
// with the live and the EMA weights; DDPM samples of a diffusion model. Also the recipe
// factory and the helpers the recipes share (recipe.h).
#include <torch/utils.h>

#include <numeric>

#include "checkpoint/safetensors.h"
#include "common/errors.h"
#include "common/logging.h"
#include "distributed/communicator.h"
#include "ema/strategy_ema.h"
#include "sharding/fully_shard.h"
#include "trainer/diffusion.h"
#include "trainer/dmd_recipe.h"
#include "trainer/recipe.h"
#include "trainer/run_setup.h"

namespace tessera::trainer {

at::Tensor lossesOf(TrainModel& model, Batch batch, at::Device device) {
  batch.inputs = batch.inputs.to(device);
  if (batch.targets.defined()) batch.targets = batch.targets.to(device);
  return sharding::unitForward(model, batch.inputs, [&](const at::Tensor& inputs) {
    Batch b = batch;
    b.inputs = inputs;
    return model.losses(b);
  });
}

std::string writeSamples(RunParts& run, const at::Tensor& samples, const std::string& generator) {
  if (run.comm->rank() != 0) return "";
  const std::string out = (run.runDir / "samples.safetensors").string();
  const at::Tensor cpu = samples.cpu();
  checkpoint::saveSafetensors(out, {{"samples", cpu}}, {{"generator", generator}});
  // The reference: up to 4096 held-out samples, or train samples when none are held out.
  const Dataset& data = *run.data;
  const bool heldOut = data.evalSamples() > 0;
  std::vector<int64_t> first(static_cast<size_t>(std::min<int64_t>(heldOut ? data.evalSamples() : data.trainSamples(), 4096)));
  std::iota(first.begin(), first.end(), 0);
  const Batch referenceBatch = heldOut ? data.evalBatch(0, static_cast<int64_t>(first.size())) : data.trainBatch(first);
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

namespace {

class StandardRecipe : public Recipe {
 public:
  explicit StandardRecipe(RunParts& run) : run_(run), part_(run.models.front()) {}

  // The micro-batches' forward and backward, the strategy's step (gradient sync,
  // clipping, optimizer; the loss and the stop flags summed in its norm's all-reduce),
  // and the EMA update.
  StepOutcome step(int64_t step, bool stopRequested) override {
    sharding::ShardingStrategy& strategy = *part_.strategy;
    distributed::Communicator& comm = *run_.comm;
    const TrainConfig& cfg = run_.cfg;
    strategy.zeroGrad();
    const std::vector<int64_t> indices = run_.sampler->indicesFor(step, comm.rank(), comm.worldSize());
    const int64_t micro = cfg.data.micro_batch;
    at::Tensor stepLoss = at::zeros({1}, at::kDouble);
    for (int64_t m = 0; m < run_.microBatches; ++m) {
      // sharding.reduce_every_micro_batch false: micro-batches before the last keep full
      // gradients and do not communicate.
      if (!part_.cfg.sharding.reduce_every_micro_batch) strategy.setRequiresGradientSync(m + 1 == run_.microBatches);
      std::vector<int64_t> slice(indices.begin() + m * micro, indices.begin() + (m + 1) * micro);
      Batch batch = run_.data->trainBatch(slice);
      seedNoise(batch, cfg.run.seed, step, slice);
      at::Tensor loss =
          lossesOf(*part_.model, std::move(batch), run_.device).mean() / static_cast<double>(run_.microBatches);
      loss.backward();
      stepLoss += loss.detach().to(at::kDouble).cpu();
    }
    StepOutcome out;
    out.lr = part_.schedule->lrAt(step);
    // The step's loss (summed, then averaged) and the stop flags ride on the strategy's
    // gradient-norm all-reduce: no collective of their own.
    at::Tensor shared = at::cat({stepLoss, at::full({1}, stopRequested ? 1.0 : 0.0, at::kDouble)});
    out.result = strategy.step(out.lr, shared);
    if (part_.ema) part_.ema->update(step + 1, !out.result.skipped);
    out.loss = shared[0].item<double>() / static_cast<double>(comm.worldSize());
    out.stopSignalled = shared[1].item<double>() > 0;
    return out;
  }

  void evaluate(std::map<std::string, double>& out) override {
    if (run_.data->evalSamples() <= 0) return;
    out["eval_loss"] = heldOutLoss();
    if (part_.ema) {
      double emaLoss = 0;
      ema::withEmaWeights(*part_.ema, *part_.strategy, 0, [&] { emaLoss = heldOutLoss(); });
      out["eval_loss_ema"] = emaLoss;
    }
  }

  // DDPM samples drawn with generator_ema (every rank runs the sampler with the same seed,
  // as zero3 gathers collectively).
  std::string drawSamples() override {
    auto* model = dynamic_cast<DiffusionDenoiser*>(part_.model.get());
    TESSERA_CHECK(model != nullptr && part_.ema != nullptr, "model.samples needs the diffusion model and an EMA");
    const TrainConfig& cfg = run_.cfg;
    at::Tensor samples;
    ema::withEmaWeights(*part_.ema, *part_.strategy, 0, [&] {
      samples = sampleDdpm(model->schedule(), model->sampleShape(), cfg.model.samples, noiseSeed(cfg.run.seed, -2, 0),
                           run_.device, [&](const at::Tensor& x, const at::Tensor& t) {
                             return sharding::unitForward(*model, std::vector<at::Tensor>{x, t},
                                                          [&](const std::vector<at::Tensor>& in) {
                                                            return std::vector<at::Tensor>{model->forward(in[0], in[1])};
                                                          })[0];
                           });
    });
    return writeSamples(run_, samples, part_.cfg.names.ema);
  }

 private:
  // Sum of the losses over this rank's share of the first `n` held-out samples, all-reduced
  // to the mean over all their predictions.
  double heldOutLoss() {
    torch::NoGradGuard noGrad;
    const int rank = run_.comm->rank(), world = run_.comm->worldSize();
    const int64_t n = std::min<int64_t>(run_.data->evalSamples(), 4096);
    // Every rank must run the forward (zero3 gathers inside it): at least one sample each.
    TESSERA_CHECK_AS(ConfigError, n >= world, "evaluation: data.eval_fraction leaves ", n,
                     " held-out samples, fewer than the ", world, " ranks");
    const int64_t begin = n * rank / world, end = n * (rank + 1) / world;
    at::Tensor sums = at::zeros({2}, at::kDouble);  // [loss sum, count]
    if (end > begin) {
      Batch batch = run_.data->evalBatch(begin, end - begin);
      std::vector<int64_t> indices(static_cast<size_t>(end - begin));
      std::iota(indices.begin(), indices.end(), begin);
      seedNoise(batch, run_.cfg.run.seed, -1, indices);
      const at::Tensor losses = lossesOf(*part_.model, batch, run_.device);
      sums[0] = losses.to(at::kDouble).sum().item<double>();
      sums[1] = static_cast<double>(losses.numel());  // predictions, not windows
    }
    run_.comm->allReduce(sums, distributed::ReduceOp::kSum);
    return sums[0].item<double>() / sums[1].item<double>();
  }

  RunParts& run_;
  ModelPart& part_;
};

}  // namespace

std::unique_ptr<Recipe> makeRecipe(RunParts& run) {
  if (run.cfg.run.recipe == "dmd") return makeDmdRecipe(run);
  return std::make_unique<StandardRecipe>(run);
}

}  // namespace tessera::trainer
