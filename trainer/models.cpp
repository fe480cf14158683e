// Built-in models (see models.h).
#include "trainer/models.h"

#include <ATen/ATen.h>

#include "common/errors.h"
#include "sharding/fully_shard.h"

namespace tessera::trainer {

ContextMlpImpl::ContextMlpImpl(const ModelOptions& options) : options_(options) {
  embed_ = register_module("embed", torch::nn::Embedding(options.vocab_size, options.embed_dim));
  layers_ = register_module("layers", torch::nn::ModuleList());
  int64_t width = options.context * options.embed_dim;
  for (int64_t hidden : options.hidden) {
    layers_->push_back(torch::nn::Linear(width, hidden));
    width = hidden;
  }
  head_ = register_module("head", torch::nn::Linear(width, options.vocab_size));
}

at::Tensor ContextMlpImpl::forward(const at::Tensor& tokens) {
  TESSERA_CHECK(tokens.dim() == 2 && tokens.size(1) == options_.context, "ContextMlp::forward: expected tokens [batch, ",
                options_.context, "], got ", tokens.sizes());
  at::Tensor x = embed_->forward(tokens).flatten(1);
  for (const auto& layer : *layers_) {
    auto* linear = layer->as<torch::nn::Linear>();
    x = sharding::unitForward(*layer, x, [linear](const at::Tensor& in) { return linear->forward(in); });
    x = options_.activation == "relu" ? at::relu(x) : at::gelu(x);
  }
  return head_->forward(x);
}

std::vector<std::string> defaultUnits(const ModelOptions& options) {
  if (options.hidden.empty()) return {};
  return {"layers.*"};
}

}  // namespace tessera::trainer
