// What every built-in model is to the trainer: a TrainModel turns a Batch into the loss of
// each prediction (the trainer averages them for training and sums them over the ranks
// for evaluation) and counts its FLOPs; a NextTokenModel is one over token windows.
//
// Every model is built from the deferred layers of layers.h: constructing it allocates no
// parameter storage; a strategy materialises what each rank holds and initialises it
// (StrategyOptions::initializer = layers::initializerOf(model, run.seed)), and
// initializeModel() (models.h) does so in full for a single process, so the initial values
// depend on run.seed and the parameter names alone. Its zero3/hybrid units are its
// sharding::Unit members (the hidden layers, the blocks); the trainer enters its root
// through sharding::unitForward.
#pragma once

#include <torch/nn/module.h>

#include <cstdint>

#include "datasets/dataset.h"

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

// A model over float tensors whose head reads learned features: a classifier's are what
// the judge's Frechet distance compares (trainer/judge.h).
class FeatureModel : public TrainModel {
 public:
  virtual at::Tensor forward(const at::Tensor& inputs) = 0;   // [batch, ...] -> the head's output
  virtual at::Tensor features(const at::Tensor& inputs) = 0;  // the head's input [batch, width]
};

// The cross-entropy of each prediction: logits [..., classes], targets [...] -> [n] float32.
at::Tensor crossEntropyEach(const at::Tensor& logits, const at::Tensor& targets);

}  // namespace tessera::models
