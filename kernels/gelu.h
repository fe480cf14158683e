// GELU with the tanh approximation (DiT's MLP activation) on the CPU in fp32 through a fused,
// vectorised kernel: LibTorch 1.13 computes it with Sleef's tanh, which took a fifth of the
// main job's step. Other devices, dtypes and cores without AVX2 + FMA take at::gelu.
#pragma once

#include <ATen/core/Tensor.h>

namespace tessera::kernels {

// at::gelu(x, "tanh"), with its backward; equal to it within float rounding (1.3e-6 relative).
at::Tensor geluTanh(const at::Tensor& x);

}  // namespace tessera::kernels
