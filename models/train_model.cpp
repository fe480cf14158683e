// The loss of a NextTokenModel, and the per-prediction cross-entropy the models share
// (see train_model.h).
#include "models/train_model.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>

namespace tessera::models {

at::Tensor crossEntropyEach(const at::Tensor& logits, const at::Tensor& targets) {
  namespace F = torch::nn::functional;
  return F::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(at::kFloat), targets.reshape({-1}),
                          F::CrossEntropyFuncOptions().reduction(torch::kNone));
}

at::Tensor NextTokenModel::losses(const datasets::Batch& batch) {
  return crossEntropyEach(trainingLogits(batch.inputs), batch.targets);
}

}  // namespace tessera::models
