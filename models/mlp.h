// model.arch mlp (its spec: mlp_spec.cpp): an MLP over token windows (ContextMlp: the
// window's embeddings flattened, the next token's logits) or over float tensors and images
// (FeatureMlp: a classifier or regressor, e.g. the judge's). Parameter names: embed,
// layers.<i> (the units), head.
#pragma once

#include <torch/nn/module.h>

#include <cstdint>

#include "datasets/dataset.h"
#include "models/layers.h"
#include "models/model_options.h"
#include "models/train_model.h"
#include "sharding/unit.h"

namespace tessera::models {

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
class FeatureMlp : public FeatureModel {
 public:
  FeatureMlp(const ModelOptions& options, const datasets::DataSpec& data, at::Device device);
  at::Tensor forward(const at::Tensor& inputs) override;  // [batch, ...] -> [batch, classes or target size]
  // The head's input [batch, last hidden width]: the learned features (a classifier's
  // penultimate layer, what a Frechet distance compares).
  at::Tensor features(const at::Tensor& inputs) override;
  at::Tensor losses(const datasets::Batch& batch) override;
  double forwardFlopsPerSample() const override;

 private:
  ModelOptions options_;
  datasets::DataSpec data_;
  sharding::UnitList<layers::Linear> layers_{nullptr};
  layers::Linear head_{nullptr};
};

}  // namespace tessera::models
