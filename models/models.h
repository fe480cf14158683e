// Built-in models: makeModel() builds the architecture model.arch names (architecture.h:
// mlp.h, gpt.h, diffusion.h, dit.h), sized for the data. Parameter names follow the
// equivalent PyTorch modules, so exported weights load into a Python model of the same
// structure (python/tessera_models.py); each model, its parameters and its initial
// distributions are listed in docs/design.md, "Built-in models".
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>

#include "datasets/dataset.h"
#include "models/model_options.h"
#include "models/train_model.h"

namespace tessera::models {

// The spec of token data for `options` (windows of model.context, model.vocab_size ids).
datasets::DataSpec tokenDataSpec(const ModelOptions& options);

// How the model of `options` reads token data (makeDataset).
datasets::TokenWindows tokenWindows(const ModelOptions& options);

// Whether model.arch trains on the next token of every position (gpt) rather than of the
// window (the dataset's targets depend on it): its architecture's say.
bool predictsEveryPosition(const ModelOptions& options);

// The model model.arch names, sized for `data`, its parameters deferred on `device`
// (architecture(options.arch).make). tessera::ConfigError for an unknown architecture or one
// that cannot train on the data (gpt needs tokens, diffusion floats).
std::shared_ptr<TrainModel> makeModel(const ModelOptions& options, const datasets::DataSpec& data,
                                      at::Device device = at::kCPU);
inline std::shared_ptr<TrainModel> makeModel(const ModelOptions& options) {
  return makeModel(options, tokenDataSpec(options));
}

// Single process, no strategy: allocates every deferred parameter of `model` in full and
// gives it its initial value under `seed` (what a strategy's ranks hold together).
void initializeModel(torch::nn::Module& model, uint64_t seed);


}  // namespace tessera::models
