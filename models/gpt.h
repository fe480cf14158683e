// model.arch gpt (its spec: gpt_spec.cpp): a GPT-2-style decoder with nanoGPT's names
// (wte, wpe, h.<i> pre-norm blocks, the units; ln_f, lm_head or the tied head), the loss at
// every position of the window.
#pragma once

#include <torch/nn/module.h>

#include <cstdint>

#include "models/layers.h"
#include "models/model_options.h"
#include "models/train_model.h"
#include "sharding/unit.h"

namespace tessera::models {

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

}  // namespace tessera::models
