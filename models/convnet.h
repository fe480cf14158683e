// model.arch convnet (its spec: convnet_spec.cpp): a small convolutional classifier of
// images, the second judge's architecture (trainer/judge.h): it sees an image through
// local filters where the MLP sees every pixel at once, so a generator cannot please both
// judges' features by one kind of error. model.hidden names its widths: one stage per
// entry but the last (a 3x3 convolution of that many channels, padding 1, ReLU, 2x2 max
// pool), then the feature layer fc (a Linear over the flattened map, ReLU: the features a
// Frechet distance compares), then the head. Parameter names: stages.<i>.weight and
// .bias (PyTorch's Conv2d; the stages are the units), fc, head.
#pragma once

#include <torch/nn/module.h>

#include <cstdint>

#include "datasets/dataset.h"
#include "models/layers.h"
#include "models/model_options.h"
#include "models/train_model.h"
#include "sharding/unit.h"

namespace tessera::models {

// A 3x3 convolution (stride 1, padding 1), ReLU and a 2x2 max pool: weight [out, in, 3, 3],
// bias [out], both uniform(-1/sqrt(9 in), 1/sqrt(9 in)) as torch.nn.Conv2d's defaults.
class ConvStage : public layers::DeferredModule {
 public:
  ConvStage(int64_t in, int64_t out, at::Device device);
  at::Tensor forward(const at::Tensor& images);  // [N, in, H, W] -> [N, out, H/2, W/2]
  // Forward FLOPs on an [in, H, W] input.
  double forwardFlops(int64_t height, int64_t width) const;
  at::Tensor weight, bias;
};

class ConvNet : public FeatureModel {
 public:
  ConvNet(const ModelOptions& options, const datasets::DataSpec& data, at::Device device);
  at::Tensor forward(const at::Tensor& images) override;   // [N, C, H, W] -> logits [N, classes]
  at::Tensor features(const at::Tensor& images) override;  // [N, hidden.back()]
  at::Tensor losses(const datasets::Batch& batch) override;
  double forwardFlopsPerSample() const override;

 private:
  datasets::DataSpec data_;
  sharding::UnitList<ConvStage> stages_{nullptr};
  layers::Linear fc_{nullptr}, head_{nullptr};  // the feature layer, the head
};

}  // namespace tessera::models
