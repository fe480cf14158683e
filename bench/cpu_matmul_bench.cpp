// fp32 matrix products on the CPU (issue 45): oneDNN's sgemm (kernels/cpu_matmul.h, what the
// built-in models use) against LibTorch's own product (the system BLAS, OpenBLAS on Debian),
// in the same run:
//  1. GFLOP/s of one product, on the MFU probe's square and the main job's shapes, and the
//     time of the tanh GELU (fused, kernels/gelu.h, against at::gelu) on the main job's MLP;
//  2. the main job's step (configs/dit_quick.yaml, 2 ranks under tessera-run) with each
//     path, under OpenBLAS's own choice of kernel and under OPENBLAS_CORETYPE=Prescott (its
//     generic kernel, which OpenBLAS 0.3.21 picks on cores its table does not know), and
//     with the Linear layers in bf16 (run.matmul_dtype: bf16; its products are oneDNN's
//     whatever OpenBLAS picks). The variable is set in the benchmark's own child commands
//     only, never in tests or CI.
// Usage (from the repository root):
//   bench_cpu_matmul_bench [--steps 150] [--reps 2] [--skip-step] [--config configs/dit_quick.yaml]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "common/app_main.h"
#include "common/filesystem.h"
#include "kernels/cpu_matmul.h"
#include "kernels/gelu.h"
#include "sharding/host_allocator.h"

namespace {

namespace fs = std::filesystem;
using tessera::kernels::CpuMatmulPath;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Shape {
  const char* what;
  int64_t m, n, k;
};

// Forward + backward of the tanh GELU on the main job's MLP activations, ms per call.
double geluMs(bool fused) {
  const at::Tensor x = at::randn({32, 49, 256}).requires_grad_(true);
  const at::Tensor upstream = at::randn({32, 49, 256});
  const auto once = [&] {
    const at::Tensor y = fused ? tessera::kernels::geluTanh(x) : at::gelu(x, "tanh");
    y.backward(upstream);
    x.mutable_grad().reset();
  };
  once();
  std::vector<double> ms;
  for (int i = 0; i < 30; ++i) {
    const auto start = std::chrono::steady_clock::now();
    once();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  return median(ms);
}

void productTable() {
  at::set_num_threads(1);
  // The main job: micro-batches of 32 images of 49 tokens (1568 rows), width 64, MLP 256.
  const std::vector<Shape> shapes = {{"MFU probe, square", 1024, 1024, 1024},
                                     {"DiT qkv forward", 1568, 192, 64},
                                     {"DiT fc1 forward", 1568, 256, 64},
                                     {"DiT fc2 forward", 1568, 64, 256},
                                     {"DiT fc1 weight gradient", 256, 64, 1568},
                                     {"attention scores, one head", 49, 49, 16}};
  std::printf("one product, 1 thread, GFLOP/s (OpenBLAS names this core '%s')\n",
              tessera::kernels::openblasCoreName().c_str());
  std::printf("| product | m x n x k | LibTorch (BLAS) | oneDNN sgemm | oneDNN / LibTorch | oneDNN bf16 (fp32 out) | "
              "bf16 / oneDNN fp32 |\n|---|---|---|---|---|---|---|\n");
  for (const Shape& s : shapes) {
    const double seconds = 0.3;
    const double aten = tessera::kernels::measureCpuSgemmFlops(CpuMatmulPath::kAten, s.m, s.n, s.k, seconds);
    const double onednn = tessera::kernels::haveOnednn()
                              ? tessera::kernels::measureCpuSgemmFlops(CpuMatmulPath::kOnednn, s.m, s.n, s.k, seconds)
                              : 0;
    const double bf16 = tessera::kernels::measureCpuBf16Flops(s.m, s.n, s.k, seconds);
    std::printf("| %s | %lld x %lld x %lld | %.1f | %.1f | %.2fx | %.1f | %.2fx |\n", s.what,
                static_cast<long long>(s.m), static_cast<long long>(s.n), static_cast<long long>(s.k), aten / 1e9,
                onednn / 1e9, onednn / aten, bf16 / 1e9, onednn > 0 ? bf16 / onednn : 0.0);
  }
  std::printf("bf16 kernel: %s\n", tessera::kernels::bf16MatmulKernel().c_str());
  const double atenGelu = geluMs(false), fusedGelu = geluMs(true);
  std::printf("\ntanh GELU, forward + backward of [32, 49, 256], 1 thread: at::gelu %.3f ms, fused %.3f ms (%.2fx)\n",
              atenGelu, fusedGelu, atenGelu / fusedGelu);
}

// The median step time (ms) of a short main-job run, from metrics.jsonl's windows after the first.
double mainJobStepMs(const std::string& env, const std::string& args, const std::string& config, int64_t steps) {
  const fs::path runDir = fs::temp_directory_path() / ("tessera_matmul_bench_" + std::to_string(::getpid()));
  tessera::removeTree(runDir);
  const std::string bin = "build/bin";
  const std::string command = "env " + env + " " + bin + "/tessera-run --standalone --nproc-per-node 2 " + bin +
                              "/tessera-train --config " + config + " --set run.steps=" + std::to_string(steps) +
                              " --set run.log_every=" + std::to_string(steps / 5) +
                              " --set run.eval_every=0 --set checkpoint.every_steps=0 --set checkpoint.at_end=false" +
                              " --set checkpoint.export=[] " + args + " --set run.dir=" + runDir.string() + " > " + runDir.string() +
                              ".log 2>&1";
  const int status = std::system(command.c_str());
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "tessera-train failed (%s); log: %s.log\n", env.c_str(), runDir.c_str());
    std::exit(1);
  }
  std::vector<double> windows;
  std::ifstream in(runDir / "metrics.jsonl");
  bool first = true;
  for (std::string line; std::getline(in, line);) {
    if (!first) windows.push_back(nlohmann::json::parse(line).at("step_time_ms").get<double>());
    first = false;
  }
  tessera::removeTree(runDir);
  fs::remove(runDir.string() + ".log");
  return median(windows);
}

void stepTable(const std::string& config, int64_t steps, int reps) {
  struct Variant {
    std::string name, env, args;
    std::vector<double> ms;
  };
  const std::string bf16 = "--set run.matmul_dtype=bf16";
  std::vector<Variant> variants = {
      {"oneDNN, OpenBLAS's own kernel", "TESSERA_CPU_MATMUL=onednn", "", {}},
      {"LibTorch, OpenBLAS's own kernel", "TESSERA_CPU_MATMUL=aten", "", {}},
      {"oneDNN, OPENBLAS_CORETYPE=Prescott", "TESSERA_CPU_MATMUL=onednn OPENBLAS_CORETYPE=Prescott", "", {}},
      {"LibTorch, OPENBLAS_CORETYPE=Prescott", "TESSERA_CPU_MATMUL=aten OPENBLAS_CORETYPE=Prescott", "", {}},
      {"bf16 Linears (run.matmul_dtype), OpenBLAS's own kernel", "TESSERA_CPU_MATMUL=onednn", bf16, {}},
      {"bf16 Linears (run.matmul_dtype), OPENBLAS_CORETYPE=Prescott",
       "TESSERA_CPU_MATMUL=onednn OPENBLAS_CORETYPE=Prescott", bf16, {}}};
  for (int rep = 0; rep < reps; ++rep) {  // interleaved: the machine's noise falls on all alike
    for (auto& v : variants) v.ms.push_back(mainJobStepMs(v.env, v.args, config, steps));
  }
  const double best = median(variants[0].ms);
  std::printf("\nthe main job's step (%s, 2 ranks, %lld steps, median of %d runs)\n", config.c_str(),
              static_cast<long long>(steps), reps);
  std::printf("| products | step ms | against oneDNN fp32 |\n|---|---|---|\n");
  for (const auto& v : variants) std::printf("| %s | %.1f | %.2fx |\n", v.name.c_str(), median(v.ms), median(v.ms) / best);
}

}  // namespace

int main(int argc, char** argv) {
  return tessera::runMain("bench_cpu_matmul_bench", [&]() -> int {
    CLI::App app("CPU matrix products: oneDNN sgemm against LibTorch's BLAS, and bf16 Linears; one product and the main job's step");
    int64_t steps = 150;
    int reps = 2;
    bool skipStep = false;
    std::string config = "configs/dit_quick.yaml";
    app.add_option("--steps", steps, "steps of each main-job run")->check(CLI::Range(10, 100000));
    app.add_option("--reps", reps, "runs of each variant")->check(CLI::Range(1, 20));
    app.add_option("--config", config, "the run whose step is timed");
    app.add_flag("--skip-step", skipStep, "only the one-product table");
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return app.exit(e);
    }
    tessera::sharding::useCachingHostAllocator();  // as tessera-train: no page faults per tensor
    productTable();
    if (!skipStep) stepTable(config, steps, reps);
    return 0;
  });
}
