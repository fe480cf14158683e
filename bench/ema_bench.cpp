// EMA update benchmark (issue 6): Tessera's ShardedModelEMAManager::update over a model
// of --params parameters (default 100M, split into transformer-like tensors), sharded
// over --world ranks (this process plays one rank: it holds 1/world of every tensor),
// against two baselines over the same bytes, measured in the same run:
//   flat:      one add_ over a flat buffer of equal size, the bandwidth bound (it reads
//              2 buffers and writes 1, like the EMA update);
//   per-param: a mul_ + add_ loop over the parameters, as NeMo's and BAGEL's EMA do;
//   copy:      (--device cuda) a device-to-device copy of a buffer of equal size, the
//              GPU's practical bandwidth; compared by bytes per second.
// Usage: bench_ema_bench [--params N] [--world W] [--iters K] [--device cpu|cuda]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "ema/ema_manager.h"

namespace {

double nowSec() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

bool gOnCuda = false;
void syncDevice() {
  if (gOnCuda) torch::cuda::synchronize();
}

// Median seconds of `iters` runs of fn (after one warm-up run); device work is waited for.
template <typename Fn>
double timeIt(int iters, Fn fn) {
  fn();
  syncDevice();
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    const double s = nowSec();
    fn();
    syncDevice();
    t.push_back(nowSec() - s);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int64_t totalParams = 100'000'000;
  int world = 1;
  int iters = 7;
  CLI::App app{"EMA update benchmark"};
  app.add_option("--params", totalParams, "Model parameters in total")->check(CLI::Range(int64_t{1000}, int64_t{1} << 40));
  app.add_option("--world", world, "Ranks the model is sharded over (this process holds one shard)")->check(CLI::Range(1, 1 << 16));
  app.add_option("--iters", iters, "Timed repetitions (median reported)")->check(CLI::Range(1, 1000));
  std::string deviceName = "cpu";
  app.add_option("--device", deviceName, "Where the model lives")->check(CLI::IsMember({"cpu", "cuda"}));
  CLI11_PARSE(app, argc, argv);
  // Line by line into a log file too: a run stopped by its time limit keeps what it printed
  // (scripts/gpu-session.sh's stages).
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  gOnCuda = deviceName == "cuda";
  if (gOnCuda && !torch::cuda::is_available()) {
    std::fprintf(stderr, "bench_ema_bench: --device cuda but no CUDA device\n");
    return 2;
  }
  const auto device = at::TensorOptions().dtype(at::kFloat).device(gOnCuda ? at::kCUDA : at::kCPU);
  // A GPT-like mix of shapes: per block 4 matrices d x d-ish, plus biases and norms.
  const int64_t d = 1024;
  std::vector<std::vector<int64_t>> shapes;
  int64_t count = 0;
  while (count < totalParams) {
    for (const auto& s : std::vector<std::vector<int64_t>>{{3 * d, d}, {3 * d}, {d, d}, {d}, {4 * d, d}, {4 * d}, {d, 4 * d}, {d}, {d}, {d}}) {
      int64_t n = 1;
      for (auto x : s) n *= x;
      shapes.push_back(s);
      count += n;
    }
  }

  tessera::ema::EmaOptions options;
  options.decays = {0.999};
  tessera::ema::ShardedModelEMAManager ema(options);
  std::vector<at::Tensor> live;
  int64_t localElems = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    tessera::dtensor::ShardSpec spec(shapes[i], at::kFloat, world, 0);
    live.push_back(at::randn(spec.localShape(), device));
    ema.addParam("p" + std::to_string(i), spec, live.back());
    localElems += spec.paddedNumel();
  }
  const double bytesMoved = 3.0 * static_cast<double>(localElems) * 4.0;  // read e, read p, write e

  at::Tensor flatE = at::randn({localElems}, device);
  at::Tensor flatP = at::randn({localElems}, device);
  std::vector<at::Tensor> emaCopies;
  for (const auto& t : live) emaCopies.push_back(t.clone());

  int64_t step = 0;
  const double tTessera = timeIt(iters, [&] { ema.update(++step); });
  const double tFlat = timeIt(iters, [&] { flatE.add_(flatP, 0.001); });
  const double tLoop = timeIt(iters, [&] {
    for (size_t i = 0; i < live.size(); ++i) emaCopies[i].mul_(0.999).add_(live[i], 0.001);
  });

  double tCopy = 0;
  if (gOnCuda) {
    // The same bytes as the EMA update's three streams: 1.5x its elements read + written.
    at::Tensor src = at::randn({localElems * 3 / 2}, device);
    at::Tensor dst = at::empty_like(src);
    tCopy = timeIt(iters, [&] { dst.copy_(src); });
  }

  std::printf("EMA update benchmark: %lld parameters (%zu tensors) sharded over %d ranks: %lld fp32 elements on this rank, on %s\n",
              static_cast<long long>(count), shapes.size(), world, static_cast<long long>(localElems),
              gOnCuda ? "cuda" : (std::to_string(at::get_num_threads()) + " CPU threads").c_str());
  std::printf("  %-34s %9.2f ms  %7.2f GB/s\n", "tessera ShardedModelEMAManager", tTessera * 1e3, bytesMoved / tTessera / 1e9);
  std::printf("  %-34s %9.2f ms  %7.2f GB/s\n", "baseline: one fused add_ (flat)", tFlat * 1e3, bytesMoved / tFlat / 1e9);
  std::printf("  %-34s %9.2f ms  %7.2f GB/s\n", "baseline: per-param mul_+add_ loop", tLoop * 1e3, bytesMoved / tLoop / 1e9);
  if (gOnCuda) {
    std::printf("  %-34s %9.2f ms  %7.2f GB/s\n", "baseline: device-to-device copy", tCopy * 1e3, bytesMoved / tCopy / 1e9);
    std::printf("  bandwidth tessera / copy        = %.3f  (target >= 0.9)\n", tCopy / tTessera);
  }
  std::printf("  ratio tessera / flat add_       = %.3f  (target <= 1.15)\n", tTessera / tFlat);
  std::printf("  ratio tessera / per-param loop  = %.3f  (target < 1)\n", tTessera / tLoop);
  return 0;
}
