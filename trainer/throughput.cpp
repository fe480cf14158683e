// Throughput, MFU and the matrix-product probe (see throughput.h).
#include "trainer/throughput.h"

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <chrono>

#include "common/errors.h"
#include "kernels/cpu_matmul.h"
#include "sharding/mixed_precision.h"

namespace tessera::trainer {
namespace {

double nowSec() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void synchronize(at::Device device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

}  // namespace

double measureMatmulFlops(at::Device device, at::ScalarType dtype, int64_t size, double seconds) {
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  const at::Tensor a = at::randn({size, size}, options.dtype(at::kFloat)).to(dtype);
  const at::Tensor b = at::randn({size, size}, options.dtype(at::kFloat)).to(dtype);
  at::Tensor c = at::mm(a, b);  // warm-up: kernels chosen, memory allocated
  synchronize(device);
  int64_t reps = 0;
  const double start = nowSec();
  double elapsed = 0;
  while (reps < 2 || elapsed < seconds) {
    at::mm_out(c, a, b);
    ++reps;
    if (device.is_cuda() && reps % 8 != 0) continue;  // launches are asynchronous: time batches
    synchronize(device);
    elapsed = nowSec() - start;
  }
  synchronize(device);
  elapsed = nowSec() - start;
  const double n = static_cast<double>(size);
  return 2.0 * n * n * n * static_cast<double>(reps) / elapsed;
}

PeakFlops peakFlops(double configured, at::Device device, at::ScalarType dtype) {
  PeakFlops peak;
  const int64_t size = device.is_cuda() ? 8192 : 1024;
  const double seconds = device.is_cuda() ? 0.2 : 0.1;
  const std::string what = strCat(size, "x", size, " ", enumName(sharding::kFloatDtypeNames, dtype), " matrix products");
  if (device.is_cpu() && dtype == at::kFloat && kernels::cpuLinearDtype() == at::kBFloat16) {
    const double bf16 = kernels::measureCpuBf16Flops(size, size, size, seconds);
    const double fp32 = kernels::haveOnednn()
                            ? kernels::measureCpuSgemmFlops(kernels::CpuMatmulPath::kOnednn, size, seconds)
                            : measureMatmulFlops(device, at::kFloat, size, seconds);
    const std::string bf16What = strCat(size, "x", size, " bf16 matrix products");
    peak.matmulPath = strCat("Linear layers in bf16 (", kernels::bf16MatmulKernel(), ", fp32 accumulation), ",
                             static_cast<int64_t>(bf16 / 1e9), " GFLOP/s per rank on ", bf16What, ", ", bf16 / fp32,
                             "x fp32's ", static_cast<int64_t>(fp32 / 1e9));
    if (bf16 < fp32) {
      peak.slowWarning = strCat("bf16 products run at ", static_cast<int64_t>(bf16 / 1e9),
                                " GFLOP/s, below fp32's ", static_cast<int64_t>(fp32 / 1e9),
                                " on this core (", kernels::bf16MatmulKernel(),
                                "); run.matmul_dtype: fp32 is faster here");
    }
    if (configured <= 0) {
      peak.flopsPerSec = bf16;
      peak.source = strCat("measured by ", bf16What, " (run.matmul_dtype bf16; set run.peak_flops for the "
                           "hardware's datasheet figure)");
    }
  } else if (device.is_cpu() && dtype == at::kFloat) {
    using kernels::CpuMatmulPath;
    const CpuMatmulPath path = kernels::cpuMatmulPath();
    const double core = kernels::haveOnednn() ? kernels::measureCpuSgemmFlops(CpuMatmulPath::kOnednn, size, seconds) : 0;
    const double inUse = path == CpuMatmulPath::kOnednn ? core : kernels::measureCpuSgemmFlops(path, size, seconds);
    peak.matmulPath = strCat(kernels::cpuMatmulPathName(path), ", ", static_cast<int64_t>(inUse / 1e9),
                             " GFLOP/s per rank on ", what);
    if (core > 0 && inUse < 0.5 * core) {
      peak.slowWarning = strCat("fp32 products run through ", kernels::cpuMatmulPathName(path), " at ",
                                static_cast<int64_t>(inUse / 1e9), " GFLOP/s, ", inUse / core,
                                "x of oneDNN's ", static_cast<int64_t>(core / 1e9),
                                " on this core (unset TESSERA_CPU_MATMUL to use oneDNN)");
    }
    if (configured <= 0) {
      peak.flopsPerSec = core > 0 ? core : inUse;
      peak.source = strCat("measured by ", what, " through ", core > 0 ? "oneDNN sgemm" : peak.matmulPath,
                           " (set run.peak_flops for the hardware's datasheet figure)");
    }
  } else if (configured <= 0) {
    peak.flopsPerSec = measureMatmulFlops(device, dtype, size, seconds);
    peak.source = strCat("measured by ", what, " on ", device, " (set run.peak_flops for the hardware's datasheet figure)");
  }
  if (configured > 0) {
    peak.flopsPerSec = configured;
    peak.source = "run.peak_flops";
  }
  return peak;
}

std::map<std::string, double> throughputFigures(double samplesPerSec, int worldSize, double trainFlopsPerSample,
                                                int64_t tokensPerSample, bool images, double peakFlopsPerSec) {
  std::map<std::string, double> out;
  const double perRank = samplesPerSec / static_cast<double>(worldSize);
  if (tokensPerSample > 0) {
    out["tokens_per_sec"] = samplesPerSec * static_cast<double>(tokensPerSample);
    out["tokens_per_sec_per_rank"] = perRank * static_cast<double>(tokensPerSample);
  } else if (images) {
    out["images_per_sec"] = samplesPerSec;
    out["images_per_sec_per_rank"] = perRank;
  }
  if (trainFlopsPerSample > 0) {
    const double achieved = trainFlopsPerSample * perRank;
    out["tflops_per_rank"] = achieved / 1e12;
    if (peakFlopsPerSec > 0) out["mfu"] = achieved / peakFlopsPerSec;
  }
  return out;
}

}  // namespace tessera::trainer
