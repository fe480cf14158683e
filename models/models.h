// Built-in models: mlp (on token windows or tensors), gpt (a GPT-2-style decoder with
// nanoGPT's names), diffusion (the denoiser of diffusion.h) and dit (dit.h). Parameter names follow the
// equivalent PyTorch modules, so exported weights load into a Python model of the same
// structure; each model, its parameters and its initial distributions are listed in
// docs/design.md, "Built-in models".
//
// Every model is built from the deferred layers of layers.h: constructing it allocates no
// parameter storage; a strategy materialises what each rank holds and initialises it
// (StrategyOptions::initializer = layers::initializerOf(model, run.seed)), and
// initializeModel() does so in full for a single process, so the initial values depend on
// run.seed and the parameter names alone. Every model is a TrainModel: it turns a Batch
// into the loss of each prediction, which the trainer averages for training and sums over
// the ranks for evaluation. Its zero3/hybrid units are its sharding::Unit members (the
// hidden layers, the blocks); the trainer enters its root through sharding::unitForward.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <memory>
#include <string>
#include <vector>

#include "sharding/unit.h"
#include "datasets/dataset.h"
#include "models/layers.h"
#include "models/model_options.h"

namespace tessera::models {

class TrainModel : public torch::nn::Module {
 public:
  // The loss of each prediction in `batch` (float32, one per prediction: per window or
  // position for next-token models, per sample otherwise), on the batch's device.
  virtual at::Tensor losses(const datasets::Batch& batch) = 0;
  // Forward FLOPs of one sample, counted from the model's shapes: 2 per multiply-add of
  // its matrix products (linears, patch embedding, attention's scores and weighted sum,
  // counted in full where a causal mask skips half, as PaLM's MFU does); elementwise work,
  // norms and softmax not counted. Training counts 3x (the backward pass costs twice the
  // forward): docs/observability.md. 0 = unknown (no MFU is reported).
  virtual double forwardFlopsPerSample() const { return 0; }
  // Tokens one sample stands for in tokens/s (text models): the positions it predicts.
  // 0 for models that are not over tokens (images/s or samples/s are reported).
  virtual int64_t tokensPerSample() const { return 0; }
};

// Token windows [batch, context] -> next-token logits; loss: cross-entropy.
class NextTokenModel : public TrainModel {
 public:
  // tokens: [batch, context] int64 -> logits [batch, vocab] of the token that follows.
  virtual at::Tensor nextTokenLogits(const at::Tensor& tokens) = 0;
  // What training predicts: false, the token after the window (trainingLogits =
  // nextTokenLogits); true, the next token at every position (logits [batch, context,
  // vocab] against the window shifted by one).
  virtual bool predictsEveryPosition() const { return false; }
  virtual at::Tensor trainingLogits(const at::Tensor& tokens) { return nextTokenLogits(tokens); }
  at::Tensor losses(const datasets::Batch& batch) override;
};

class ContextMlp : public NextTokenModel {
 public:
  ContextMlp(const ModelOptions& options, at::Device device);
  at::Tensor nextTokenLogits(const at::Tensor& tokens) override;
  double forwardFlopsPerSample() const override;
  int64_t tokensPerSample() const override { return 1; }

 private:
  ModelOptions options_;
  layers::Embedding embed_{nullptr};
  sharding::UnitList<layers::Linear> layers_{nullptr};
  layers::Linear head_{nullptr};
};

// An MLP over float tensors [batch, ...] for classification or regression.
class FeatureMlp : public TrainModel {
 public:
  FeatureMlp(const ModelOptions& options, const datasets::DataSpec& data, at::Device device);
  at::Tensor forward(const at::Tensor& inputs);  // [batch, ...] -> [batch, classes or target size]
  // The head's input [batch, last hidden width]: the learned features (a classifier's
  // penultimate layer, what a Frechet distance compares).
  at::Tensor features(const at::Tensor& inputs);
  at::Tensor losses(const datasets::Batch& batch) override;
  double forwardFlopsPerSample() const override;

 private:
  ModelOptions options_;
  datasets::DataSpec data_;
  sharding::UnitList<layers::Linear> layers_{nullptr};
  layers::Linear head_{nullptr};
};

class GptBlock : public torch::nn::Module {
 public:
  // `layers`: the model's depth, which scales the residual projections' initial std.
  GptBlock(int64_t width, int64_t heads, int64_t layers, at::Device device);
  at::Tensor forward(const at::Tensor& x);  // [batch, time, width] -> same
  // Forward FLOPs over a window of `time` tokens: the linears per token, attention's
  // q k^T and weights x v (2 x 2 x time^2 x width).
  double forwardFlops(int64_t time) const;

 private:
  int64_t heads_;
  layers::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  layers::Linear attnIn_{nullptr}, attnOut_{nullptr}, mlpIn_{nullptr}, mlpOut_{nullptr};
};

class Gpt : public NextTokenModel {
 public:
  Gpt(const ModelOptions& options, at::Device device);
  // tokens [batch, time <= context] -> logits [batch, time, vocab]; position t sees
  // tokens 0..t only.
  at::Tensor forward(const at::Tensor& tokens);
  at::Tensor nextTokenLogits(const at::Tensor& tokens) override;
  bool predictsEveryPosition() const override { return true; }
  at::Tensor trainingLogits(const at::Tensor& tokens) override { return forward(tokens); }
  double forwardFlopsPerSample() const override;
  int64_t tokensPerSample() const override { return options_.context; }

 private:
  ModelOptions options_;
  layers::Embedding wte_{nullptr}, wpe_{nullptr};
  sharding::UnitList<GptBlock> blocks_{nullptr};
  layers::LayerNorm lnF_{nullptr};
  layers::Linear lmHead_{nullptr};  // absent with tie_head
};

// The spec of token data for `options` (windows of model.context, model.vocab_size ids).
datasets::DataSpec tokenDataSpec(const ModelOptions& options);

// How the model of `options` reads token data (makeDataset).
datasets::TokenWindows tokenWindows(const ModelOptions& options);

// Whether model.arch trains on the next token of every position (gpt) rather than of the
// window (the dataset's targets depend on it).
bool predictsEveryPosition(const ModelOptions& options);

// The model model.arch names, sized for `data`, its parameters deferred on `device`.
// tessera::ConfigError for an unknown architecture or one that cannot train on the data
// (gpt needs tokens, diffusion floats).
std::shared_ptr<TrainModel> makeModel(const ModelOptions& options, const datasets::DataSpec& data,
                                      at::Device device = at::kCPU);
inline std::shared_ptr<TrainModel> makeModel(const ModelOptions& options) {
  return makeModel(options, tokenDataSpec(options));
}

// Single process, no strategy: allocates every deferred parameter of `model` in full and
// gives it its initial value under `seed` (what a strategy's ranks hold together).
void initializeModel(torch::nn::Module& model, uint64_t seed);


}  // namespace tessera::models
