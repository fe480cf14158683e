// model.arch mlp: ContextMlp and FeatureMlp (see mlp.h).
#include "models/mlp.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>

#include "common/errors.h"
#include "models/train_model.h"

namespace tessera::models {
namespace {

// [Linear -> activation] for each hidden layer (each a unit).
at::Tensor runHiddenLayers(sharding::UnitList<layers::Linear>& hidden, at::Tensor x, const std::string& activation) {
  for (auto& layer : *hidden) {
    x = layer->forward(x);
    x = activation == "relu" ? at::relu(x) : at::gelu(x);
  }
  return x;
}

}  // namespace

ContextMlp::ContextMlp(const ModelOptions& options, at::Device device) : options_(options) {
  embed_ = register_module("embed", layers::Embedding(options.vocab_size, options.embed_dim, device));
  layers_ = register_module("layers", sharding::UnitList<layers::Linear>());
  int64_t width = options.context * options.embed_dim;
  for (int64_t hidden : options.hidden) {
    layers_->emplace_back(width, hidden, /*bias=*/true, device);
    width = hidden;
  }
  head_ = register_module("head", layers::Linear(width, options.vocab_size, /*bias=*/true, device));
}

at::Tensor ContextMlp::nextTokenLogits(const at::Tensor& tokens) {
  TESSERA_CHECK(tokens.dim() == 2 && tokens.size(1) == options_.context, "ContextMlp: expected tokens [batch, ",
                options_.context, "], got ", tokens.sizes());
  return head_->forward(runHiddenLayers(layers_, embed_->forward(tokens).flatten(1), options_.activation));
}

FeatureMlp::FeatureMlp(const ModelOptions& options, const datasets::DataSpec& data, at::Device device)
    : options_(options), data_(data) {
  TESSERA_CHECK_AS(ConfigError, data.hasTargets, "model.arch mlp on tensor data needs 'targets' in the data file");
  layers_ = register_module("layers", sharding::UnitList<layers::Linear>());
  int64_t width = c10::multiply_integers(data.inputShape);
  for (int64_t hidden : options.hidden) {
    layers_->emplace_back(width, hidden, /*bias=*/true, device);
    width = hidden;
  }
  const int64_t out = data.classes > 0 ? data.classes : c10::multiply_integers(data.targetShape);
  head_ = register_module("head", layers::Linear(width, out, /*bias=*/true, device));
}

at::Tensor FeatureMlp::features(const at::Tensor& inputs) {
  const auto dtype = head_->weight.scalar_type();  // the compute dtype (sharding.param_dtype)
  return runHiddenLayers(layers_, inputs.flatten(1).to(dtype), options_.activation);
}

double ContextMlp::forwardFlopsPerSample() const { return layers::linearFlops(*this); }

double FeatureMlp::forwardFlopsPerSample() const { return layers::linearFlops(*this); }

at::Tensor FeatureMlp::forward(const at::Tensor& inputs) { return head_->forward(features(inputs)); }

at::Tensor FeatureMlp::losses(const datasets::Batch& batch) {
  const at::Tensor out = forward(batch.inputs);
  if (data_.classes > 0) return crossEntropyEach(out, batch.targets);
  // Per-sample mean-squared error; targets [n] (one value each) or [n, ...].
  return (out.to(at::kFloat) - batch.targets.reshape({batch.targets.size(0), -1})).square().mean(1);
}

std::shared_ptr<TrainModel> makeMlp(const ModelOptions& options, const datasets::DataSpec& data, c10::Device device) {
  if (data.tokens) return std::make_shared<ContextMlp>(options, device);
  return std::make_shared<FeatureMlp>(options, data, device);
}

}  // namespace tessera::models
