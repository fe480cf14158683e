// The tanh-approximated GELU's loops in AVX2 + FMA intrinsics (kernels/CMakeLists.txt sets
// the flags on this file alone; gelu.cpp calls it only on a core that has both). Nothing
// here includes a header with non-intrinsic inline functions: an AVX2 copy of one could be
// the copy the linker keeps for every other file.
//
// 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): an exponential
// instead of a tanh, which LibTorch 1.13 computes with Sleef's tanh at about a quarter of
// the speed. Intrinsics rather than a loop the compiler vectorises: GCC's if-conversion of
// the clamps divided by exp(88) on every lane, whose denormal results cost microcode assists
// (2x slower, and slower still on shuffled data).
//
// Each loop also reads and writes bf16 (sharding.param_dtype bf16's activations), computing in
// fp32 and rounding once, at about the fp32 loop's speed: LibTorch 1.13's bf16 tanh GELU runs
// at half its slow fp32 one and rounds its intermediates to bf16.
#include <immintrin.h>

#include <cstdint>

namespace tessera::kernels::avx2 {
namespace {

// exp(x) on 8 lanes by Cody-Waite range reduction and Cephes' expf polynomial (about 1 ulp),
// x clamped to [-87, 80] (a NaN lane becomes -87: callers carry NaN through x itself). The
// top is 80, not expf's 88: the sigmoid 1 / (1 + exp(80)) is still a normal float (2e-35),
// while exp(88)'s reciprocal is a denormal, whose arithmetic costs microcode assists (3x
// slower on activations with many values below -10).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(80.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// sigmoid(z) for z = 2 sqrt(2/pi) (x + 0.044715 x^3); with `oneMinus`, also 1 - sigmoid(z)
// as exp(-z) sigmoid(z) (not 1 minus it, which cancels where the sigmoid is near 1) and dz/dx.
inline __m256 sigmoidOfU(__m256 x, __m256* oneMinus, __m256* dzdx) {
  const __m256 k = _mm256_set1_ps(1.5957691216057308f);  // 2 sqrt(2/pi)
  const __m256 cubic = _mm256_set1_ps(0.044715f);
  const __m256 x2 = _mm256_mul_ps(x, x);
  const __m256 z = _mm256_mul_ps(k, _mm256_fmadd_ps(_mm256_mul_ps(cubic, x2), x, x));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), z));
  const __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, e));
  if (oneMinus != nullptr) {
    *oneMinus = _mm256_mul_ps(e, s);
    *dzdx = _mm256_mul_ps(k, _mm256_fmadd_ps(_mm256_set1_ps(3.0f * 0.044715f), x2, one));
  }
  return s;
}

// 8 lanes from and to fp32, or bf16 (the top half of an fp32's bits: widened by a shift, and
// narrowed with round-to-nearest-even and a NaN kept a quiet NaN, as c10::BFloat16 does).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline __m256 load8(const uint16_t* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline void store8(uint16_t* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  top = _mm256_blendv_epi8(top, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// out[i] = body(a[i], b[i]) over n values (b may be null: its lanes are then zero), the last
// n % 8 through a full vector loaded from a zeroed buffer and stored back in part.
template <typename T, typename Body>
void map8(int64_t n, const T* a, const T* b, T* out, Body body) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(out + i, body(load8(a + i), b != nullptr ? load8(b + i) : _mm256_setzero_ps()));
  if (i == n) return;
  alignas(32) T bufA[8] = {}, bufB[8] = {}, bufOut[8];
  for (int64_t j = 0; i + j < n; ++j) {
    bufA[j] = a[i + j];
    if (b != nullptr) bufB[j] = b[i + j];
  }
  store8(bufOut, body(load8(bufA), load8(bufB)));
  for (int64_t j = 0; i + j < n; ++j) out[i + j] = bufOut[j];
}

// Lambdas rather than functions, so that map8 inlines them instead of calling through a pointer.
constexpr auto forwardBody = [](__m256 v, __m256) { return _mm256_mul_ps(v, sigmoidOfU(v, nullptr, nullptr)); };

// d/dx [x s(z)] = s + x s (1 - s) dz/dx.
constexpr auto backwardBody = [](__m256 v, __m256 g) {
  __m256 oneMinusS, dz;
  const __m256 s = sigmoidOfU(v, &oneMinusS, &dz);
  const __m256 slope = _mm256_mul_ps(_mm256_mul_ps(v, s), _mm256_mul_ps(oneMinusS, dz));
  return _mm256_mul_ps(g, _mm256_add_ps(s, slope));
};

}  // namespace

void geluTanhForward(const float* x, float* y, int64_t n) { map8(n, x, static_cast<const float*>(nullptr), y, forwardBody); }
void geluTanhBackward(const float* x, const float* gradOut, float* gradIn, int64_t n) {
  map8(n, x, gradOut, gradIn, backwardBody);
}
void geluTanhForward(const uint16_t* x, uint16_t* y, int64_t n) {
  map8(n, x, static_cast<const uint16_t*>(nullptr), y, forwardBody);
}
void geluTanhBackward(const uint16_t* x, const uint16_t* gradOut, uint16_t* gradIn, int64_t n) {
  map8(n, x, gradOut, gradIn, backwardBody);
}

}  // namespace tessera::kernels::avx2
