// The tanh-approximated GELU's autograd function and dispatch (see gelu.h); the loops are
// gelu_avx2.cpp's.
#include "kernels/gelu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>

namespace tessera::kernels {
namespace avx2 {
void geluTanhForward(const float* x, float* y, int64_t n);
void geluTanhBackward(const float* x, const float* gradOut, float* gradIn, int64_t n);
// bf16 as its bits:
void geluTanhForward(const uint16_t* x, uint16_t* y, int64_t n);
void geluTanhBackward(const uint16_t* x, const uint16_t* gradOut, uint16_t* gradIn, int64_t n);
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

// A tensor's elements as the loops take them: fp32, or bf16 as its bits (geluTanh passes only
// those two dtypes).
template <typename T>
T* elements(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// The loops over fp32 (T = float) or bf16 (T = uint16_t) tensors, in chunks on LibTorch's threads.
template <typename T>
void forwardLoop(const at::Tensor& x, const at::Tensor& y) {
  const T* in = elements<const T>(x);
  T* out = elements<T>(y);
  at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
    avx2::geluTanhForward(in + begin, out + begin, end - begin);
  });
}

template <typename T>
void backwardLoop(const at::Tensor& x, const at::Tensor& g, const at::Tensor& dx) {
  const T* in = elements<const T>(x);
  const T* gradOut = elements<const T>(g);
  T* gradIn = elements<T>(dx);
  at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
    avx2::geluTanhBackward(in + begin, gradOut + begin, gradIn + begin, end - begin);
  });
}

struct FusedGeluTanh : public torch::autograd::Function<FusedGeluTanh> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input) {
    const at::Tensor x = input.contiguous();
    at::Tensor y = at::empty_like(x);
    if (x.scalar_type() == at::kFloat) {
      forwardLoop<float>(x, y);
    } else {
      forwardLoop<uint16_t>(x, y);
    }
    ctx->save_for_backward({x});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const at::Tensor g = grads[0].to(x.scalar_type()).contiguous();
    at::Tensor dx = at::empty_like(x);
    if (x.scalar_type() == at::kFloat) {
      backwardLoop<float>(x, g, dx);
    } else {
      backwardLoop<uint16_t>(x, g, dx);
    }
    return {dx};
  }
};

}  // namespace

at::Tensor geluTanh(const at::Tensor& x) {
  if (!coreHasAvx2() || !x.device().is_cpu() || (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16) ||
      x.layout() != at::kStrided) {
    return at::gelu(x, "tanh");
  }
  return FusedGeluTanh::apply(x);
}

}  // namespace tessera::kernels
