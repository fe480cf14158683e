// Throughput and MFU: the model FLOPs a rank computes per second against the peak it could
// compute at, which is run.peak_flops or, when unset, measured at start by a probe; and on a
// CPU also against the core's datasheet peak (vector width x FMA units x measured clock).
#pragma once

#include <ATen/core/TensorBody.h>

#include <map>
#include <string>

namespace tessera::trainer {

// A rank's peak FLOP/s and where the figure comes from (for the log).
struct PeakFlops {
  double flopsPerSec = 0;
  std::string source;
  // On a CPU in fp32: the path the model's products take and its measured speed ("" elsewhere),
  // and a warning when that path runs far below the core (a BLAS on its generic kernel).
  std::string matmulPath;
  std::string slowWarning;
};

// A CPU core's datasheet peak: FLOP per cycle from its generation's vector width and FMA
// units (looked up by vendor, family and model in /proc/cpuinfo), times the clock it runs at,
// measured by a chain of dependent integer adds (one cycle each) since a virtual machine
// reports only its TSC. flopsPerSec is per rank (x the rank's intra-op threads); 0 when the
// core is not in the table. `source` spells the formula out for the log.
struct DatasheetPeak {
  double flopsPerCycle = 0;  // per core, in the dtype asked for
  double clockHz = 0;        // measured
  double nominalHz = 0;      // /proc/cpuinfo's "cpu MHz" (a VM's TSC)
  double flopsPerSec = 0;
  std::string source;
};

// The rank's datasheet peak for products in `dtype` (fp32, or bf16 where the core has
// AVX512-BF16: its dot products at twice fp32's rate, an assumption the source names).
DatasheetPeak cpuDatasheetPeak(at::ScalarType dtype, int threads);

// The clock this thread runs at, in Hz, from `seconds` of dependent adds.
double measureCoreClockHz(double seconds);

// FLOP/s of square `size` x `size` matrix products in `dtype` on `device` (CPU or CUDA),
// timed for about `seconds` after a warm-up product.
double measureMatmulFlops(at::Device device, at::ScalarType dtype, int64_t size, double seconds);

// `configured` (run.peak_flops) when > 0; else the probe on the run's device and compute
// dtype: 1024-square products on a CPU (the rank's own threads), 8192-square on a GPU. On a
// CPU in fp32 the probe is oneDNN's sgemm, which runs at the core's speed whatever kernel
// the loaded BLAS picked, so MFU is against the core, not against a slow kernel; with the
// Linear products in bf16 (run.matmul_dtype, kernels::cpuLinearDtype()) it is oneDNN's bf16
// matmul, and a warning says so when that runs no faster than fp32 on this core.
PeakFlops peakFlops(double configured, at::Device device, at::ScalarType dtype);

// The throughput figures of a logged window: samples/s over all ranks -> per rank, tokens/s
// or images/s (whole run and per rank), TFLOP/s per rank and MFU (when the FLOPs of a
// sample are counted). Keys as metrics.jsonl names them.
// mfu_datasheet is written when `datasheetFlopsPerSec` > 0.
std::map<std::string, double> throughputFigures(double samplesPerSec, int worldSize, double trainFlopsPerSample,
                                                int64_t tokensPerSample, bool images, double peakFlopsPerSec,
                                                double datasheetFlopsPerSec = 0);

}  // namespace tessera::trainer
