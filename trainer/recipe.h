// What a train step does, by run.recipe: the standard recipe trains the one model on the
// data (standard_recipe.cpp); dmd distils a teacher into a one- or few-step generator with a
// critic (dmd_recipe.h). The train loop (trainer.cpp) around a recipe is the same: logs,
// evaluations, checkpoints of every model, exports, stop signals.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "observe/tensorboard_writer.h"
#include "sharding/strategy.h"
#include "trainer/dataset.h"

namespace tessera::trainer {

struct RunParts;
struct ModelPart;
class TrainModel;

// What one step leaves for the periodic actions and the stop decision. Every rank gets
// the same values (they ride on the step's collectives).
struct StepOutcome {
  double loss = 0;               // the recipe's main loss, mean over the global batch
  double lr = 0;                 // of the main model
  sharding::StepResult result;   // of the main model's optimizer step
  bool stopSignalled = false;    // some rank had a stop signal
  std::map<std::string, double> extra;  // further figures for metrics.jsonl (e.g. critic_loss)
};

// A PNG grid of samples in <run.dir>/samples/: the weights that drew it ("generator_ema",
// "model", ...) and the file.
struct SampleGrid {
  std::string name;
  std::string path;
  observe::EncodedImage image;  // the file's bytes and size (TensorBoard shows them)
};

class Recipe {
 public:
  virtual ~Recipe() = default;
  // Optimizer step `step` (0-based) of every model the recipe trains, EMA updates
  // included; `stopRequested`: this rank saw SIGTERM/SIGINT. Collective.
  virtual StepOutcome step(int64_t step, bool stopRequested) = 0;
  // Held-out figures for an evaluation: eval_loss with the live weights and eval_loss_ema
  // with the EMA's (when there is one). Collective.
  virtual void evaluate(std::map<std::string, double>& out) = 0;
  // At the end of a finished run, model.samples > 0: draws the samples, rank 0 writes
  // <run.dir>/samples.safetensors and returns its path ("" on other ranks). Collective.
  virtual std::string drawSamples() = 0;
  // Image denoisers: PNG grids of samples from each EMA and the live weights after `step`
  // steps, the same noise and classes every time (eval.*), in <run.dir>/samples/. Returns
  // the grids written (rank 0; empty elsewhere and for recipes without pictures). Collective.
  virtual std::vector<SampleGrid> writeSampleGrids(int64_t /*step*/) { return {}; }
  // The model FLOPs a step spends on one sample of the global batch (forward and backward
  // of what it trains: TrainModel::forwardFlopsPerSample), for MFU; 0 = not counted.
  virtual double trainFlopsPerSample() const { return 0; }
  // Tokens one sample stands for (text models), for tokens/s; 0 otherwise.
  virtual int64_t tokensPerSample() const { return 0; }
  // eval.judge: generator_ema's samples judged by the classifier (judge.h), as a log line
  // (rank 0; "" elsewhere and without a judge). Collective.
  virtual std::string judgeSamples() { return ""; }
};

// The recipe run.recipe names, over the parts of the run.
std::unique_ptr<Recipe> makeRecipe(RunParts& run);

// Helpers the recipes share.

// The loss of each prediction of `batch`, with the model's root entered as a unit
// (zero3/hybrid gather the root's parameters there; a plain call under the other
// strategies). Inputs and targets move to `device` first.
at::Tensor lossesOf(TrainModel& model, Batch batch, at::Device device);

// Runs `fn(begin, end)` for each micro-batch of this rank's share of a step — positions
// [begin, end) in the rank's sample indices — with `part`'s gradient synchronisation set
// as its sharding.reduce_every_micro_batch says (off before the last micro-batch when false).
void forEachMicroBatch(const RunParts& run, ModelPart& part, const std::function<void(size_t begin, size_t end)>& fn);

// The optimizer step of the recipe's main model `part` (then its EMA update) with the
// step's summed loss `stepLoss` (a [1] double tensor) and this rank's stop request riding
// on the gradient-norm all-reduce (no collective of their own): the outcome's lr,
// result, loss (mean over ranks) and stopSignalled. Collective.
StepOutcome stepMainModel(const RunParts& run, ModelPart& part, int64_t step, const at::Tensor& stepLoss,
                          bool stopRequested);

// The mean of `losses(begin, end)` (per-prediction losses of samples [begin, end)) over
// `n` samples split among the ranks, each rank at least one (zero3 gathers inside the
// forwards: every rank must run them). Collective.
double meanOverRanks(const RunParts& run, int64_t n, const std::function<at::Tensor(int64_t begin, int64_t end)>& losses);

// Rank 0 writes `samples` to <run.dir>/samples.safetensors (metadata generator:
// `generator`) and logs their per-feature mean and spread against the held-out data's
// (the train data's when none is held out). Returns the file written.
std::string writeSamples(RunParts& run, const at::Tensor& samples, const std::string& generator);

// Rank 0 writes `samples` (images) as <run.dir>/samples/step_<step>_<name>.png, `perRow`
// per row; returns the grid.
SampleGrid writeStepGrid(RunParts& run, int64_t step, const std::string& name, const at::Tensor& samples,
                          int64_t perRow);

}  // namespace tessera::trainer
