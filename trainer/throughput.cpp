// Throughput, MFU and the matrix-product probe (see throughput.h).
#include "trainer/throughput.h"

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>

#include "common/clock.h"
#include "common/errors.h"
#include "kernels/cpu_matmul.h"
#include "sharding/mixed_precision.h"

namespace tessera::trainer {
namespace {

void synchronize(at::Device device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// What /proc/cpuinfo says of the first core.
struct CpuId {
  std::string vendor;
  int family = -1, model = -1;
  double mhz = 0;
  std::string flags;  // space-padded: " avx512f avx2 ... "
  bool has(const char* flag) const { return flags.find(strCat(" ", flag, " ")) != std::string::npos; }
};

CpuId readCpuInfo() {
  CpuId id;
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line) && !line.empty();) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, colon);
    key.erase(key.find_last_not_of(" \t") + 1);
    const std::string value = colon + 2 <= line.size() ? line.substr(colon + 2) : "";
    if (key == "vendor_id") id.vendor = value;
    if (key == "cpu family") id.family = std::atoi(value.c_str());
    if (key == "model") id.model = std::atoi(value.c_str());
    if (key == "cpu MHz") id.mhz = std::atof(value.c_str());
    if (key == "flags") id.flags = " " + value + " ";
  }
  return id;
}

// fp32 FLOP per cycle of one core (2 per FMA lane), and the generation's name; 0 unknown.
// AMD: Zen 1 two 128-bit FMA pipes; Zen 2-4 two 256-bit (Zen 4 runs AVX-512 as two halves);
// Zen 5 server and desktop two 512-bit. Intel: two 256-bit FMA units from Haswell; with
// AVX-512 two 512-bit units is assumed (Xeon Gold 6xxx / Platinum; some SKUs have one).
std::pair<double, std::string> fp32FlopsPerCycle(const CpuId& id) {
  if (id.vendor == "AuthenticAMD") {
    if (id.family == 0x17) return id.model < 0x30 ? std::pair{16.0, "Zen 1 (2 x 128-bit FMA)"}
                                                  : std::pair{32.0, "Zen 2 (2 x 256-bit FMA)"};
    if (id.family == 0x19) {
      return id.has("avx512f") ? std::pair{32.0, "Zen 4 (2 x 256-bit FMA; AVX-512 in two halves)"}
                               : std::pair{32.0, "Zen 3 (2 x 256-bit FMA)"};
    }
    if (id.family == 0x1A && id.has("avx512f") && (id.model < 0x20 || (id.model >= 0x40 && id.model < 0x50))) {
      return {64.0, "Zen 5 (2 x 512-bit FMA)"};
    }
  } else if (id.vendor == "GenuineIntel" && id.family == 6 && id.has("fma")) {
    return id.has("avx512f") ? std::pair{64.0, "Intel AVX-512 (2 x 512-bit FMA assumed)"}
                             : std::pair{32.0, "Intel AVX2 (2 x 256-bit FMA)"};
  }
  return {0.0, ""};
}

}  // namespace

double measureCoreClockHz(double seconds) {
  // Blocks of 64 adds, each waiting on the one before: 64 cycles a block at any clock (the
  // loop's own counter runs beside the chain on another ALU). Register operands, not
  // immediates: Intel cores from Golden Cove fold chains of add-immediate at rename, several
  // a cycle (a Xeon measured 18.5 GHz that way). The fastest of 10 windows: time the thread
  // spends descheduled (a loaded host) only slows a window down.
  uint64_t x = 0;
  const uint64_t one = 1;
  double best = 0;
  for (int window = 0; window < 10; ++window) {
    uint64_t blocks = 0;
    const double start = steadySeconds();
    double elapsed = 0;
    while (elapsed < seconds / 10) {
      for (int i = 0; i < 1024; ++i) {
#if defined(__x86_64__)
        asm volatile(
            ".rept 64\n\t"
            "add %1, %0\n\t"
            ".endr"
            : "+r"(x)
            : "r"(one));
#elif defined(__aarch64__)
        asm volatile(
            ".rept 64\n\t"
            "add %0, %0, %1\n\t"
            ".endr"
            : "+r"(x)
            : "r"(one));
#else
        return 0;
#endif
      }
      blocks += 1024;
      elapsed = steadySeconds() - start;
    }
    best = std::max(best, 64.0 * static_cast<double>(blocks) / elapsed);
  }
  return x == 0 ? 0 : best;
}

DatasheetPeak cpuDatasheetPeak(at::ScalarType dtype, int threads) {
  DatasheetPeak peak;
  const CpuId id = readCpuInfo();
  auto [perCycle, generation] = fp32FlopsPerCycle(id);
  if (perCycle <= 0) return peak;
  std::string dtypeWhat = "fp32";
  if (dtype == at::kBFloat16) {
    if (id.has("avx512_bf16")) {
      perCycle *= 2;
      dtypeWhat = "bf16 (AVX512-BF16 dot products at twice fp32's rate, assumed)";
    } else {
      dtypeWhat = "bf16 (no AVX512-BF16: fp32's rate)";
    }
  }
  peak.flopsPerCycle = perCycle;
  peak.nominalHz = id.mhz * 1e6;
  peak.clockHz = measureCoreClockHz(0.05);
  if (peak.clockHz <= 0) return peak;
  peak.flopsPerSec = perCycle * peak.clockHz * threads;
  peak.source = strCat(generation, " family ", id.family, " model ", id.model, ": ", perCycle, " ", dtypeWhat,
                       " FLOP/cycle x ", peak.clockHz / 1e9, " GHz measured (", peak.nominalHz / 1e9,
                       " nominal) x ", threads, " thread", threads == 1 ? "" : "s", " = ",
                       static_cast<int64_t>(peak.flopsPerSec / 1e9), " GFLOP/s per rank");
  return peak;
}

double measureMatmulFlops(at::Device device, at::ScalarType dtype, int64_t size, double seconds) {
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  const at::Tensor a = at::randn({size, size}, options.dtype(at::kFloat)).to(dtype);
  const at::Tensor b = at::randn({size, size}, options.dtype(at::kFloat)).to(dtype);
  at::Tensor c = at::mm(a, b);  // warm-up: kernels chosen, memory allocated
  synchronize(device);
  int64_t reps = 0;
  const double start = steadySeconds();
  double elapsed = 0;
  while (reps < 2 || elapsed < seconds) {
    at::mm_out(c, a, b);
    ++reps;
    if (device.is_cuda() && reps % 8 != 0) continue;  // launches are asynchronous: time batches
    synchronize(device);
    elapsed = steadySeconds() - start;
  }
  synchronize(device);
  elapsed = steadySeconds() - start;
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
                                                int64_t tokensPerSample, bool images, double peakFlopsPerSec,
                                                double datasheetFlopsPerSec) {
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
    if (datasheetFlopsPerSec > 0) out["mfu_datasheet"] = achieved / datasheetFlopsPerSec;
  }
  return out;
}

}  // namespace tessera::trainer
