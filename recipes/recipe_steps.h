// The pieces of a train step that recipes share: a model's losses on a batch, the
// micro-batch loop, the main model's optimizer step with the loss riding on its norm's
// all-reduce, held-out means over the ranks, and the samples and grids a recipe writes.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "datasets/dataset.h"
#include "trainer/recipe.h"

namespace tessera::trainer {
struct RunParts;
struct ModelPart;
}  // namespace tessera::trainer

namespace tessera::models {
class TrainModel;
}  // namespace tessera::models

namespace tessera::sharding {
class StepSums;
}  // namespace tessera::sharding

namespace tessera::recipes {

// The loss of each prediction of `batch`, with the model's root entered as a unit
// (zero3/hybrid gather the root's parameters there; a plain call under the other
// strategies). Inputs and targets move to `device` first.
at::Tensor lossesOf(models::TrainModel& model, datasets::Batch batch, at::Device device);

// One forward and backward pass of a step: positions [begin, end) in this rank's sample
// indices, and which micro-batch it is (this rank's pass, or under run.deterministic the
// micro-batch's index in the global batch). A padding pass (run.deterministic, a rank with
// fewer micro-batches than another) recomputes the rank's last micro-batch so that
// zero3's gathers stay matched; its loss and gradients are dropped.
struct MicroBatch {
  size_t begin = 0, end = 0;
  int64_t index = 0;
  bool padding = false;
};

// Runs `fn` for each pass of this rank's share of a step with `part`'s gradient
// synchronisation set as its sharding.reduce_every_micro_batch says (off before the last
// micro-batch when false); under run.deterministic each pass's gradients then go to the
// strategy's canonical sums (ShardingStrategy::addMicroBatchGradients).
void forEachMicroBatch(const trainer::RunParts& run, trainer::ModelPart& part,
                       const std::function<void(const MicroBatch&)>& fn);

// A step's loss, micro-batch by micro-batch: each the micro-batch's mean loss divided by
// run.lossDivisor. Padding passes are not added.
class StepLoss {
 public:
  void add(const MicroBatch& mb, const at::Tensor& loss);
  double local() const;  // this rank's values, summed in index order
  const std::map<int64_t, double>& values() const { return values_; }

 private:
  std::map<int64_t, double> values_;
};

// The step's mean loss over every rank: under run.deterministic the canonical sum of every
// micro-batch's value in index order (collective over the host group); otherwise `sums`
// must hold this rank's stepLoss.local() as "loss", summed over ranks by the step already.
// `name`: the sum's name in `sums` (a further per-micro-batch figure than the loss).
double meanStepLoss(const trainer::RunParts& run, const StepLoss& stepLoss, const sharding::StepSums& sums,
                    const std::string& name = "loss");

// The optimizer step of the recipe's main model `part` (then its EMA update) with the
// step's loss `stepLoss`, this rank's stop request and whether its async checkpoint write
// failed riding on the gradient-norm all-reduce (no collective of their own): the
// outcome's lr, result, loss (mean over ranks), stopSignalled and checkpointFailed.
// `figures`: further per-micro-batch figures, averaged over the ranks the same way into
// the outcome's extra[name]. Collective.
trainer::StepOutcome stepMainModel(const trainer::RunParts& run, trainer::ModelPart& part, int64_t step,
                                   const StepLoss& stepLoss, bool stopRequested,
                                   const std::map<std::string, const StepLoss*>& figures = {});

// The mean of `losses(begin, end)` (per-prediction losses of samples [begin, end)) over
// `n` samples split among the ranks, each rank at least one (zero3 gathers inside the
// forwards: every rank must run them). Collective.
double meanOverRanks(const trainer::RunParts& run, int64_t n, const std::function<at::Tensor(int64_t begin, int64_t end)>& losses);

// Rank 0 writes `samples` to <run.dir>/samples.safetensors (metadata generator:
// `generator`) and logs their per-feature mean and spread against the held-out data's
// (the train data's when none is held out). Returns the file written.
std::string writeSamples(trainer::RunParts& run, const at::Tensor& samples, const std::string& generator);

// Rank 0 writes `samples` (images) as <run.dir>/samples/step_<step>_<name>.png, `perRow`
// per row; returns the grid.
trainer::SampleGrid writeStepGrid(trainer::RunParts& run, int64_t step, const std::string& name, const at::Tensor& samples,
                          int64_t perRow);

}  // namespace tessera::recipes
