// Built-in models. Parameter names follow the equivalent PyTorch modules, so exported
// weights load into a Python model with the same structure.
//
// mlp: next-token predictor over a fixed context window:
//   embed (Embedding vocab x embed_dim) -> flatten -> [Linear -> act] x len(hidden)
//   -> Linear to vocab. Parameters: embed.weight, layers.<i>.weight/bias, head.weight/bias.
//   Each hidden layer is entered through sharding::unitForward, so under zero3/hybrid
//   the layers are FSDP units (gathered one at a time); a plain call otherwise.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <string>
#include <vector>

#include "trainer/train_config.h"

namespace tessera::trainer {

class ContextMlpImpl : public torch::nn::Module {
 public:
  explicit ContextMlpImpl(const ModelOptions& options);
  // tokens: [batch, context] int64 -> logits [batch, vocab]
  at::Tensor forward(const at::Tensor& tokens);

 private:
  ModelOptions options_;
  torch::nn::Embedding embed_{nullptr};
  torch::nn::ModuleList layers_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(ContextMlp);

// The submodules that become zero3/hybrid units when sharding.wrap is empty: the MLP's
// hidden layers ("layers.*"); none when it has no hidden layer (the root is one unit).
std::vector<std::string> defaultUnits(const ModelOptions& options);

}  // namespace tessera::trainer
