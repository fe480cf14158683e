// Built-in models. Parameter names follow the equivalent PyTorch modules, so exported
// weights load into a Python model with the same structure.
//
// Every model is a TrainModel: it turns a Batch into the loss of each prediction; the
// trainer averages them for training and sums them over the ranks for evaluation. Units
// for zero3/hybrid (defaultUnits) are entered through sharding::unitForward inside the
// models, a plain call under the other strategies.
//
// mlp on token data (data.kind text / tokens; a NextTokenModel): embed (Embedding vocab x
//   embed_dim) -> flatten the window -> [Linear -> act] x len(hidden) -> Linear to vocab;
//   cross-entropy of the next token. Parameters: embed.weight, layers.<i>.weight/bias,
//   head.weight/bias. Units: the hidden layers ("layers.*").
// mlp on tensor data (data.kind tensors): flatten the input -> [Linear -> act] x
//   len(hidden) -> Linear to the classes (integer targets: cross-entropy) or to the target's
//   size (float targets: mean-squared error). Parameters: layers.<i>.*, head.*.
// diffusion: the denoiser of diffusion.h (its own noise-prediction loss).
// gpt: a GPT-2-style decoder with nanoGPT's names: wte, wpe (learned positions), h.<i>
//   pre-norm blocks (ln_1, attn.c_attn, attn.c_proj: causal self-attention with `heads`
//   heads; ln_2, mlp.c_fc, mlp.c_proj: 4x GELU MLP), ln_f, lm_head (no bias; with
//   tie_head the logits use wte.weight and there is no lm_head). forward() gives logits
//   at every position; nextTokenLogits() the last one. Units: the blocks ("h.*").
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <memory>
#include <string>
#include <vector>

#include "trainer/dataset.h"
#include "trainer/train_config.h"

namespace tessera::trainer {

class TrainModel : public torch::nn::Module {
 public:
  // The loss of each prediction in `batch` (float32, one per prediction: per window or
  // position for next-token models, per sample otherwise), on the batch's device.
  virtual at::Tensor losses(const Batch& batch) = 0;
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
  at::Tensor losses(const Batch& batch) override;
};

class ContextMlp : public NextTokenModel {
 public:
  explicit ContextMlp(const ModelOptions& options);
  at::Tensor nextTokenLogits(const at::Tensor& tokens) override;

 private:
  ModelOptions options_;
  torch::nn::Embedding embed_{nullptr};
  torch::nn::ModuleList layers_{nullptr};
  torch::nn::Linear head_{nullptr};
};

// An MLP over float tensors [batch, ...] for classification or regression.
class FeatureMlp : public TrainModel {
 public:
  FeatureMlp(const ModelOptions& options, const DataSpec& data);
  at::Tensor forward(const at::Tensor& inputs);  // [batch, ...] -> [batch, classes or target size]
  at::Tensor losses(const Batch& batch) override;

 private:
  ModelOptions options_;
  DataSpec data_;
  torch::nn::ModuleList layers_{nullptr};
  torch::nn::Linear head_{nullptr};
};

class GptBlock : public torch::nn::Module {
 public:
  GptBlock(int64_t width, int64_t heads);
  at::Tensor forward(const at::Tensor& x);  // [batch, time, width] -> same

 private:
  int64_t heads_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear attnIn_{nullptr}, attnOut_{nullptr}, mlpIn_{nullptr}, mlpOut_{nullptr};
};

class Gpt : public NextTokenModel {
 public:
  explicit Gpt(const ModelOptions& options);
  // tokens [batch, time <= context] -> logits [batch, time, vocab]; position t sees
  // tokens 0..t only.
  at::Tensor forward(const at::Tensor& tokens);
  at::Tensor nextTokenLogits(const at::Tensor& tokens) override;
  bool predictsEveryPosition() const override { return true; }
  at::Tensor trainingLogits(const at::Tensor& tokens) override { return forward(tokens); }

 private:
  ModelOptions options_;
  torch::nn::Embedding wte_{nullptr}, wpe_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::LayerNorm lnF_{nullptr};
  torch::nn::Linear lmHead_{nullptr};  // absent with tie_head
};

// The spec of token data for `options` (windows of model.context, model.vocab_size ids).
DataSpec tokenDataSpec(const ModelOptions& options);

// Whether model.arch trains on the next token of every position (gpt) rather than of the
// window (the dataset's targets depend on it).
bool predictsEveryPosition(const ModelOptions& options);

// The model model.arch names, sized for `data`. tessera::ConfigError for an unknown
// architecture or one that cannot train on the data (gpt needs tokens, diffusion floats).
std::shared_ptr<TrainModel> makeModel(const ModelOptions& options, const DataSpec& data);
inline std::shared_ptr<TrainModel> makeModel(const ModelOptions& options) {
  return makeModel(options, tokenDataSpec(options));
}

// The submodules that become zero3/hybrid units when sharding.wrap is empty: the MLP's
// hidden layers ("layers.*", none without hidden layers), the GPT's blocks ("h.*"), the
// denoiser's blocks ("blocks.*").
std::vector<std::string> defaultUnits(const ModelOptions& options);

}  // namespace tessera::trainer
