// Deferred layers with declared initial distributions (see layers.h).
#include "models/layers.h"

#include <ATen/ATen.h>

#include <cmath>

#include "common/errors.h"
#include "kernels/cpu_matmul.h"
#include "kernels/layer_norm.h"

namespace tessera::models::layers {

void DeferredModule::setInit(const std::string& name, const dtensor::ParamInit& init) {
  auto it = inits_.find(name);
  TESSERA_CHECK(it != inits_.end(), "DeferredModule::setInit: no parameter '", name, "'");
  it->second = init;
}

at::Tensor DeferredModule::registerDeferred(const std::string& name, const std::vector<int64_t>& shape,
                                            const dtensor::ParamInit& init, at::Device device) {
  inits_[name] = init;
  return register_parameter(name, dtensor::deferredTensor(shape, at::TensorOptions().dtype(at::kFloat).device(device)));
}

LinearImpl::LinearImpl(int64_t in, int64_t out, bool withBias, at::Device device) {
  const double bound = in > 0 ? 1.0 / std::sqrt(static_cast<double>(in)) : 0.0;
  weight = registerDeferred("weight", {out, in}, dtensor::ParamInit::uniform(-bound, bound), device);
  if (withBias) bias = registerDeferred("bias", {out}, dtensor::ParamInit::uniform(-bound, bound), device);
}

at::Tensor LinearImpl::forward(const at::Tensor& x) { return kernels::linear(x, weight, bias); }

EmbeddingImpl::EmbeddingImpl(int64_t count, int64_t dim, at::Device device) {
  weight = registerDeferred("weight", {count, dim}, dtensor::ParamInit::normal(0.0, 1.0), device);
}

at::Tensor EmbeddingImpl::forward(const at::Tensor& indices) { return at::embedding(weight, indices); }

LayerNormImpl::LayerNormImpl(int64_t dim, at::Device device) {
  weight = registerDeferred("weight", {dim}, dtensor::ParamInit::constant(1.0), device);
  bias = registerDeferred("bias", {dim}, dtensor::ParamInit::constant(0.0), device);
}

at::Tensor LayerNormImpl::forward(const at::Tensor& x) {
  return kernels::layerNorm(x, weight, bias, 1e-5);
}

std::map<std::string, dtensor::ParamInit> declaredInits(const torch::nn::Module& root) {
  std::map<std::string, dtensor::ParamInit> inits;
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    const auto* deferred = dynamic_cast<const DeferredModule*>(item.value().get());
    if (deferred == nullptr) continue;
    for (const auto& [name, init] : deferred->paramInits()) inits[item.key().empty() ? name : item.key() + "." + name] = init;
  }
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    TESSERA_CHECK(inits.count(item.key()), "declaredInits: parameter '", item.key(),
                  "' has no declared initial distribution (not built by a DeferredModule)");
  }
  return inits;
}

dtensor::ParamInitializer initializerOf(const torch::nn::Module& root, uint64_t seed) {
  auto inits = std::make_shared<const std::map<std::string, dtensor::ParamInit>>(declaredInits(root));
  return [inits, seed](const std::string& name, int64_t rowBegin, const at::Tensor& rows) {
    auto it = inits->find(name);
    TESSERA_CHECK(it != inits->end(), "initializer: no parameter '", name, "'");
    dtensor::fillRows(it->second, seed, name, rowBegin, rows);
  };
}

double matmulFlops(const LinearImpl& linear) {
  return 2.0 * static_cast<double>(linear.weight.size(0)) * static_cast<double>(linear.weight.size(1));
}

double linearFlops(const torch::nn::Module& module) {
  // Not modules(include_self = true): a module made on the stack has no shared_ptr to itself.
  const auto* self = dynamic_cast<const LinearImpl*>(&module);
  double total = self != nullptr ? matmulFlops(*self) : 0.0;
  for (const auto& child : module.modules(/*include_self=*/false)) {
    if (const auto* linear = dynamic_cast<const LinearImpl*>(child.get())) total += matmulFlops(*linear);
  }
  return total;
}

at::Tensor conv3x3(const at::Tensor& images, const at::Tensor& weight, const at::Tensor& bias) {
  TESSERA_CHECK(images.dim() == 4 && weight.dim() == 4 && weight.size(1) == images.size(1) && weight.size(2) == 3 &&
                    weight.size(3) == 3,
                "conv3x3: images ", images.sizes(), " and weight ", weight.sizes(), " are not [N, C, H, W] and [out, C, 3, 3]");
  const int64_t n = images.size(0), height = images.size(2), width = images.size(3), out = weight.size(0);
  const at::Tensor columns = at::im2col(images, /*kernel_size=*/{3, 3}, /*dilation=*/{1, 1}, /*padding=*/{1, 1},
                                        /*stride=*/{1, 1});  // [N, C x 9, H x W]
  const at::Tensor rows = columns.transpose(1, 2).reshape({n * height * width, columns.size(1)});
  return kernels::linear(rows, weight.reshape({out, -1}), bias).view({n, height, width, out}).permute({0, 3, 1, 2}).contiguous();
}

}  // namespace tessera::models::layers
