// The single-pass CPU loops (see cpu_kernels.h). Built with -O3 -ffp-contract=off
// -fno-math-errno (sharding/CMakeLists.txt): vectorised, sqrt inlined, and no implicit
// multiply-add contraction that would round the vector body and the scalar tail
// differently; the fused multiply-adds torch performs are written as std::fma.
#include "optim/cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace tessera::optim {
namespace {

// The element loop, inlined into two versions: one for CPUs with AVX2 and FMA (the fma
// vectorises) and the baseline x86-64 one (fma through libm: slow, the same rounding);
// adamRange picks by what this CPU supports. Bitwise the same results either way.
__attribute__((always_inline)) inline void adamLoop(float* __restrict p, const float* __restrict g,
                                                    float* __restrict m, float* __restrict v, int64_t begin,
                                                    int64_t end, const AdamScalars& s) {
  for (int64_t i = begin; i < end; ++i) {
    float param = p[i] * s.paramScale;
    // torch's add(x, alpha=a) is a fused multiply-add in ATen's vector kernels: std::fma
    // rounds once the same way (explicit, so -ffp-contract=off leaves it fused).
    const float grad = s.gradDecay != 0 ? std::fma(s.gradDecay, param, g[i]) : g[i];
    const float avg = std::fma(s.oneMinusBeta1, grad, m[i] * s.beta1);
    const float avgSq = std::fma(s.oneMinusBeta2 * grad, grad, v[i] * s.beta2);  // addcmul, contracted in ATen
    const float denom = std::sqrt(avgSq) / s.sqrtBiasCorrection2 + s.eps;
    param = param + s.negStepSize * avg / denom;
    p[i] = param;
    m[i] = avg;
    v[i] = avgSq;
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma"))) void adamRangeAvx2(float* p, const float* g, float* m, float* v, int64_t begin,
                                                       int64_t end, const AdamScalars& s) {
  adamLoop(p, g, m, v, begin, end, s);
}
bool hasAvx2Fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#endif

void adamRange(float* p, const float* g, float* m, float* v, int64_t begin, int64_t end, const AdamScalars& s) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (hasAvx2Fma()) return adamRangeAvx2(p, g, m, v, begin, end, s);
#endif
  adamLoop(p, g, m, v, begin, end, s);
}

// Eight partial sums (one AVX2 register of doubles twice over), each taking every eighth
// element, then added in a fixed order: vectorisable without reassociating (an AVX2
// version and the baseline one, chosen by the loader; no fma involved).
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

}  // namespace tessera::optim
