// GELU with the tanh approximation (DiT's MLP activation) on the CPU in fp32 or bf16 through a
// fused, vectorised kernel: LibTorch 1.13 computes it with Sleef's tanh, which took a fifth of
// the main job's step, and its bf16 one at half that speed again. bf16 is computed in fp32 and
// rounded once (LibTorch's bf16 GELU also rounds its intermediates, and is less exact). Other devices, dtypes and cores without AVX2 + FMA take at::gelu.
#pragma once

#include <ATen/core/Tensor.h>

namespace tessera::kernels {

// at::gelu(x, "tanh"), with its backward; equal to it within float rounding (1.3e-6 relative)
// in fp32, and in bf16 to the fp32 result rounded to bf16 (one bf16 step apart where the
// two fp32 results straddle a rounding boundary).
at::Tensor geluTanh(const at::Tensor& x);

}  // namespace tessera::kernels
