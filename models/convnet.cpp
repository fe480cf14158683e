// A small convolutional image classifier (see convnet.h).
#include "models/convnet.h"

#include <ATen/ATen.h>

#include <cmath>

#include "common/errors.h"
#include "models/architecture.h"

namespace tessera::models {

ConvStage::ConvStage(int64_t in, int64_t out, at::Device device) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(9 * in));
  weight = registerDeferred("weight", {out, in, 3, 3}, dtensor::ParamInit::uniform(-bound, bound), device);
  bias = registerDeferred("bias", {out}, dtensor::ParamInit::uniform(-bound, bound), device);
}

// The convolution through layers::conv3x3 (im2col and kernels::linear, not at::conv2d:
// the judge's bits should not depend on the CPU's choice of kernels).
at::Tensor ConvStage::forward(const at::Tensor& images) {
  return at::max_pool2d(at::relu(layers::conv3x3(images, weight, bias)), 2);
}

double ConvStage::forwardFlops(int64_t height, int64_t width) const {
  return 2.0 * static_cast<double>(weight.numel()) * static_cast<double>(height * width);
}

ConvNet::ConvNet(const ModelOptions& options, const datasets::DataSpec& data, at::Device device) : data_(data) {
  TESSERA_CHECK_AS(ConfigError, data.inputShape.size() == 3 && data.classes > 0,
                   "model.arch convnet classifies images with labels, got samples of ", at::IntArrayRef(data.inputShape),
                   " and ", data.classes, " classes");
  TESSERA_CHECK_AS(ConfigError, options.hidden.size() >= 2,
                   "model.arch convnet: model.hidden lists each stage's channels and then the feature width (at least "
                   "two entries), got ", options.hidden.size());
  stages_ = register_module("stages", sharding::UnitList<ConvStage>());
  int64_t channels = data.inputShape[0], height = data.inputShape[1], width = data.inputShape[2];
  for (size_t i = 0; i + 1 < options.hidden.size(); ++i) {
    TESSERA_CHECK_AS(ConfigError, height >= 2 && width >= 2, "model.arch convnet: ", options.hidden.size() - 1,
                     " stages halve ", data.inputShape[1], "x", data.inputShape[2], " images below one pixel");
    stages_->emplace_back(channels, options.hidden[i], device);
    channels = options.hidden[i];
    height /= 2;
    width /= 2;
  }
  fc_ = register_module("fc", layers::Linear(channels * height * width, options.hidden.back(),
                                                         /*bias=*/true, device));
  head_ = register_module("head", layers::Linear(options.hidden.back(), data.classes, /*bias=*/true, device));
}

at::Tensor ConvNet::features(const at::Tensor& images) {
  at::Tensor x = images.to(head_->weight.scalar_type());
  for (auto& stage : *stages_) x = stage->forward(x);
  return at::relu(fc_->forward(x.flatten(1)));
}

at::Tensor ConvNet::forward(const at::Tensor& images) { return head_->forward(features(images)); }

at::Tensor ConvNet::losses(const datasets::Batch& batch) { return crossEntropyEach(forward(batch.inputs), batch.targets); }

double ConvNet::forwardFlopsPerSample() const {
  double total = layers::matmulFlops(*fc_) + layers::matmulFlops(*head_);
  int64_t height = data_.inputShape[1], width = data_.inputShape[2];
  for (const auto& module : modules(/*include_self=*/false)) {  // the stages, in order
    const auto* stage = dynamic_cast<const ConvStage*>(module.get());
    if (stage == nullptr) continue;
    total += stage->forwardFlops(height, width);
    height /= 2;
    width /= 2;
  }
  return total;
}

std::shared_ptr<TrainModel> makeConvNet(const ModelOptions& options, const datasets::DataSpec& data, c10::Device device) {
  return std::make_shared<ConvNet>(options, data, device);
}

}  // namespace tessera::models
