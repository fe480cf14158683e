// The single-pass CPU loops (see cpu_kernels.h). Built with -O3 -ffp-contract=off
// -fno-math-errno (sharding/CMakeLists.txt): vectorised, sqrt inlined, and no multiply-add
// contraction that would round the vector body and the scalar tail differently.
#include "sharding/cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace tessera::sharding {
namespace {

// The element loop, compiled once for AVX2 and once for the baseline x86-64 (the loader
// picks one for this CPU); bitwise the same results either way (IEEE operations only).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
void adamRange(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v, int64_t begin,
               int64_t end, const AdamScalars s) {
  for (int64_t i = begin; i < end; ++i) {
    float param = p[i] * s.paramScale;
    const float grad = s.gradDecay != 0 ? g[i] + s.gradDecay * param : g[i];
    const float avg = m[i] * s.beta1 + s.oneMinusBeta1 * grad;
    const float avgSq = v[i] * s.beta2 + s.oneMinusBeta2 * grad * grad;
    const float denom = std::sqrt(avgSq) / s.sqrtBiasCorrection2 + s.eps;
    param = param + s.negStepSize * avg / denom;
    p[i] = param;
    m[i] = avg;
    v[i] = avgSq;
  }
}

// Eight partial sums (one AVX2 register of doubles twice over), each taking every eighth
// element, then added in a fixed order: vectorisable without reassociating.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
double squaredNormRange(const float* __restrict x, int64_t begin, int64_t end) {
  double partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    for (int k = 0; k < 8; ++k) {
      const double value = x[i + k];
      partial[k] += value * value;
    }
  }
  for (int k = 0; i < end; ++i, ++k) {
    const double value = x[i];
    partial[k] += value * value;
  }
  double sum = 0;
  for (double p : partial) sum += p;
  return sum;
}

}  // namespace

double squaredNorm(const float* x, int64_t n) {
  // Fixed blocks, summed in block order: the same result on any number of threads.
  constexpr int64_t kBlock = int64_t{1} << 16;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  if (blocks <= 1) return squaredNormRange(x, 0, n);
  std::vector<double> sums(static_cast<size_t>(blocks), 0.0);
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      sums[static_cast<size_t>(b)] = squaredNormRange(x, b * kBlock, std::min(n, (b + 1) * kBlock));
    }
  });
  double sum = 0;
  for (double s : sums) sum += s;
  return sum;
}

void fusedAdamStep(float* param, const float* grad, float* expAvg, float* expAvgSq, int64_t n, const AdamScalars& s) {
  constexpr int64_t kGrain = int64_t{1} << 16;
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { adamRange(param, grad, expAvg, expAvgSq, begin, end, s); });
}

}  // namespace tessera::sharding
