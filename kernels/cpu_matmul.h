// Matrix products on the CPU at the core's speed whatever BLAS LibTorch happens to load.
// Debian's LibTorch calls the system libblas.so.3 (OpenBLAS 0.3.21) for fp32 products, and
// OpenBLAS picks its kernel from a CPU table: on cores it does not know (Xeons with AMX that
// report a generic model name) it runs its generic SSE3 "Prescott" kernel at an eighth of the
// core's speed. oneDNN's sgemm detects the core's instructions itself (AVX2, AVX-512, AMX),
// so fp32 products of CPU tensors go through it; everything else (CUDA, bf16, which LibTorch
// already sends to oneDNN, other dtypes) is LibTorch's own product.
//
// TESSERA_CPU_MATMUL=aten sends fp32 products to LibTorch as well: benchmarks compare the two
// paths in one run with it (tests and CI never set it).
//
// setCpuLinearDtype(bf16) (tessera-train's run.matmul_dtype) multiplies the fp32 Linear layers
// in bf16 instead: bf16 copies of the input, weight and output gradient go through oneDNN's
// matmul, which accumulates and writes fp32, so everything around the products (norms,
// activations, masters, the optimizer) stays fp32. On cores with AVX512-BF16 or AMX that is
// about twice the fp32 products' speed; attention's small per-head products stay fp32.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace tessera::kernels {

enum class CpuMatmulPath { kOnednn, kAten };

// Whether this build has oneDNN (libdnnl-dev at build time).
bool haveOnednn();
// The path fp32 CPU products take in this process: oneDNN when Tessera was built with it,
// unless TESSERA_CPU_MATMUL=aten. Read once; an unknown value throws tessera::ConfigError naming it.
CpuMatmulPath cpuMatmulPath();
// "oneDNN sgemm" or "LibTorch (BLAS: <what libblas.so.3 is>)", for the start-up line.
std::string cpuMatmulPathName(CpuMatmulPath path);
// OpenBLAS's name for this core ("Haswell", "SkylakeX", "Prescott" for its generic kernel),
// or "" when the loaded BLAS is not OpenBLAS.
std::string openblasCoreName();

// The dtype fp32 CPU Linear products are multiplied in, process-wide: at::kFloat (the default)
// or at::kBFloat16; any other throws tessera::ConfigError.
void setCpuLinearDtype(at::ScalarType dtype);
at::ScalarType cpuLinearDtype();
// Whether bf16 products go through oneDNN: it needs AVX-512 at least. Elsewhere (and in a
// build without oneDNN, or under TESSERA_CPU_MATMUL=aten) they are LibTorch's own, slower
// than fp32 and with their output rounded to bf16.
bool haveOnednnBf16();
// Whether the core multiplies bf16 in hardware (AVX512-BF16 or AMX-BF16): where it does not,
// bf16 products are emulated (AVX-512) or LibTorch's own loops, and bf16 parameters have not
// been measured faster than fp32.
bool coreHasBf16Instructions();
// What bf16 products run on: "oneDNN's matmul, kernel brg:avx512_core_bf16" (or _amx, ...),
// or "LibTorch's bf16 product (...)" where oneDNN has none.
std::string bf16MatmulKernel();

// y = x W^T + b as at::linear (x [..., in], W [out, in], b [out] or undefined), with its
// backward, through cpuMatmulPath() for fp32 CPU tensors, in cpuLinearDtype().
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);
// a @ b for a [..., M, K] and b [..., K, N] with the same leading dimensions (attention's
// products), with its backward, through cpuMatmulPath() for fp32 CPU tensors.
at::Tensor batchedMatmul(const at::Tensor& a, const at::Tensor& b);

// FLOP/s of fp32 products [m, k] x [k, n] on this thread's CPU threads through `path`, timed
// for at least `seconds` after a warm-up product (the MFU probe, the start-up line, bench/).
double measureCpuSgemmFlops(CpuMatmulPath path, int64_t m, int64_t n, int64_t k, double seconds);
inline double measureCpuSgemmFlops(CpuMatmulPath path, int64_t size, double seconds) {
  return measureCpuSgemmFlops(path, size, size, size, seconds);
}
// FLOP/s of the bf16 products setCpuLinearDtype(bf16) uses ([m, k] x [k, n], fp32 out), timed
// the same way.
double measureCpuBf16Flops(int64_t m, int64_t n, int64_t k, double seconds);

}  // namespace tessera::kernels
