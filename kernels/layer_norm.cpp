// LayerNorm of bf16 CPU tensors through LibTorch's fp32 kernels (see layer_norm.h).
#include "kernels/layer_norm.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>

namespace tessera::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

c10::optional<at::Tensor> widened(const at::Tensor& t) {
  return t.defined() ? c10::optional<at::Tensor>(t.to(at::kFloat)) : c10::nullopt;
}

// Forward and backward in fp32 over a bf16 input; the saved tensors are the bf16 input, the
// (small) fp32 mean and reciprocal deviation of each row, and the bf16 weight and bias
// (LibTorch's backward sizes the bias gradient from the bias).
at::Tensor bf16Forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                       double eps) {
  const auto [y, mean, rstd] = at::native_layer_norm(x.to(at::kFloat), {x.size(-1)}, widened(weight), widened(bias), eps);
  ctx->save_for_backward({x, mean, rstd, weight, bias});
  return y.to(x.scalar_type());
}

variable_list bf16Backward(AutogradContext* ctx, const at::Tensor& gradOut, bool affine) {
  const auto saved = ctx->get_saved_variables();
  const at::Tensor& x = saved[0];
  const std::array<bool, 3> mask{ctx->needs_input_grad(0), affine && ctx->needs_input_grad(1),
                                 affine && ctx->needs_input_grad(2)};
  // The upstream gradient may be a view: LibTorch's backward takes any strides (tested).
  const auto [dx, dw, db] = at::native_layer_norm_backward(gradOut.to(at::kFloat), x.to(at::kFloat), {x.size(-1)},
                                                           saved[1], saved[2], widened(saved[3]), widened(saved[4]), mask);
  const auto narrow = [&](const at::Tensor& g) { return g.defined() ? g.to(x.scalar_type()) : g; };
  if (!affine) return {narrow(dx)};
  return {narrow(dx), narrow(dw), narrow(db)};
}

// Two autograd functions, with and without the affine part, since an undefined tensor cannot
// be an autograd input.
struct Bf16LayerNormAffine : public torch::autograd::Function<Bf16LayerNormAffine> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                            double eps) {
    return bf16Forward(ctx, x, weight, bias, eps);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out = bf16Backward(ctx, grads[0], true);
    out.emplace_back();  // eps
    return out;
  }
};

struct Bf16LayerNorm : public torch::autograd::Function<Bf16LayerNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, double eps) {
    return bf16Forward(ctx, x, at::Tensor(), at::Tensor(), eps);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out = bf16Backward(ctx, grads[0], false);
    out.emplace_back();  // eps
    return out;
  }
};

}  // namespace

at::Tensor layerNorm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  const bool affine = weight.defined() && bias.defined();
  const auto bf16CpuVector = [&](const at::Tensor& t) {
    return t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.layout() == at::kStrided && t.dim() == 1 &&
           t.size(0) == x.size(-1);
  };
  const bool ours = x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.layout() == at::kStrided &&
                    x.dim() >= 1 &&
                    (affine ? bf16CpuVector(weight) && bf16CpuVector(bias) : !weight.defined() && !bias.defined());
  if (!ours) return at::layer_norm(x, {x.size(-1)}, weight, bias, eps);  // also the one to name a bad shape
  return affine ? Bf16LayerNormAffine::apply(x, weight, bias, eps) : Bf16LayerNorm::apply(x, eps);
}

}  // namespace tessera::kernels
