// LayerNorm over the last dimension (the built-in models' norms) whose bf16 CPU inputs are
// normalised in fp32: LibTorch 1.13's bf16 layer_norm on the CPU is a scalar loop, 13x slower
// than its fp32 one (8.7 ms against 0.65 on a [3136, 512] input, one thread), and made
// sharding.param_dtype bf16 slower than fp32. The bf16 input is widened, normalised by
// LibTorch's fp32 kernels and rounded back once, which is what LibTorch's own bf16 kernel
// computes (it accumulates in fp32 too) but with one rounding where it rounds more often; the
// backward keeps the bf16 input (not a widened copy) and each row's fp32 mean and deviation,
// as at::layer_norm does. Everything else (fp32, other devices, other dtypes) is at::layer_norm itself.
#pragma once

#include <ATen/core/Tensor.h>

namespace tessera::kernels {

// at::layer_norm(x, {x.size(-1)}, weight, bias, eps), with its backward. weight and bias are
// both defined ([x.size(-1)], x's dtype) or both undefined (no affine part).
at::Tensor layerNorm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps);

}  // namespace tessera::kernels
