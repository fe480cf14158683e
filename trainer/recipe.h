// What a train step does, by run.recipe: the interface every recipe implements (recipes/:
// the standard recipe trains the one model on the data; dmd distils a teacher into a one- or
// few-step generator with a critic). The train loop (trainer.cpp) around a recipe is the
// same: logs, evaluations, checkpoints of every model, exports, stop signals. A recipe is
// found by name through its RecipeSpec (recipe_spec.h).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "observe/tensorboard_writer.h"
#include "sharding/strategy.h"

namespace tessera::trainer {

// What one step leaves for the periodic actions and the stop decision. Every rank gets
// the same values (they ride on the step's collectives).
struct StepOutcome {
  double loss = 0;               // the recipe's main loss, mean over the global batch
  double lr = 0;                 // of the main model
  sharding::StepResult result;   // of the main model's optimizer step
  bool stopSignalled = false;    // some rank had a stop signal
  bool checkpointFailed = false; // some rank's async checkpoint save failed (the loop then stops)
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

}  // namespace tessera::trainer
