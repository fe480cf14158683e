// The tanh-approximated GELU's autograd function and dispatch (see gelu.h); the loops are
// gelu_avx2.cpp's.
#include "kernels/gelu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

namespace tessera::kernels {
namespace avx2 {
void geluTanhForward(const float* x, float* y, int64_t n);
void geluTanhBackward(const float* x, const float* gradOut, float* gradIn, int64_t n);
}  // namespace avx2

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kGrain = 16384;  // elements per task: a task is worth a thread's start

bool coreHasAvx2() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

struct FusedGeluTanh : public torch::autograd::Function<FusedGeluTanh> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input) {
    const at::Tensor x = input.contiguous();
    at::Tensor y = at::empty_like(x);
    const float* in = x.data_ptr<float>();
    float* out = y.data_ptr<float>();
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
      avx2::geluTanhForward(in + begin, out + begin, end - begin);
    });
    ctx->save_for_backward({x});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const at::Tensor g = grads[0].contiguous();
    at::Tensor dx = at::empty_like(x);
    const float* in = x.data_ptr<float>();
    const float* gradOut = g.data_ptr<float>();
    float* gradIn = dx.data_ptr<float>();
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
      avx2::geluTanhBackward(in + begin, gradOut + begin, gradIn + begin, end - begin);
    });
    return {dx};
  }
};

}  // namespace

at::Tensor geluTanh(const at::Tensor& x) {
  if (!coreHasAvx2() || !x.device().is_cpu() || x.scalar_type() != at::kFloat || x.layout() != at::kStrided) {
    return at::gelu(x, "tanh");
  }
  return FusedGeluTanh::apply(x);
}

}  // namespace tessera::kernels
