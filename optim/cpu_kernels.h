// Single-pass CPU loops for the step's elementwise work over fp32 buffers: the Adam /
// AdamW update (instead of torch's ten tensor-wide operations, each a pass over memory
// and two allocating a temporary as large as the parameter) and the squared L2 norm of a
// gradient (instead of a double copy, its square and a sum). ShardedOptimizer and
// grad_clip use them for CPU tensors, tensor operations elsewhere.
#pragma once

#include <cstdint>

namespace tessera::optim {

struct AdamScalars {
  float paramScale = 1;    // AdamW's decoupled decay: 1 - lr * weight_decay (1 for Adam)
  float gradDecay = 0;     // Adam's L2 term: the gradient gets + gradDecay * param (0 for AdamW)
  float beta1 = 0.9f, oneMinusBeta1 = 0.1f;
  float beta2 = 0.999f, oneMinusBeta2 = 0.001f;
  float sqrtBiasCorrection2 = 1;  // sqrt(1 - beta2^t)
  float eps = 1e-8f;
  float negStepSize = 0;   // -lr / (1 - beta1^t)
};

// For every i < n, in fp32, torch's single-tensor AdamW operation by operation and
// rounding as Debian's LibTorch 1.13 does on this CPU (fma = one rounding: ATen's add
// with alpha is a fused multiply-add, its addcmul is contracted into one; measured
// bitwise, tests/optim/cpu_kernels_test.cpp):
//   p *= paramScale;  g' = fma(gradDecay, p, g)  (Adam with weight decay only)
//   m = fma(oneMinusBeta1, g', m * beta1);  v = fma(oneMinusBeta2 * g', g', v * beta2)
//   p = p + (negStepSize * m) / (sqrt(v) / sqrtBiasCorrection2 + eps)
// Each element is computed alike wherever it sits (no implicit contraction), so an
// element's update does not depend on its position in a shard.
void fusedAdamStep(float* param, const float* grad, float* expAvg, float* expAvgSq, int64_t n, const AdamScalars& s);

// Sum of x[i]^2 over i < n, accumulated in double in a fixed order (deterministic for a
// given n, whatever the thread count).
double squaredNorm(const float* x, int64_t n);

}  // namespace tessera::optim
