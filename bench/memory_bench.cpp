// Memory benchmark (the ZeRO formulas): the peak resident memory of every rank over a
// whole tessera-train run, set-up included (VmHWM, as metrics.jsonl reports it: the
// largest over the ranks), minus the same figure for a tiny model run the same way, next
// to what ZeRO says a rank must hold:
//   no_shard  16 Psi                       (fp32 parameters, gradients, AdamW moments)
//   zero1     8 Psi + 8 Psi / N            (parameters and gradients full; moments sharded)
//   zero2     4 Psi + 12 Psi / N           (parameters full; gradients, moments sharded)
//   zero3     16 Psi / N + 3 units         (everything sharded; the running unit, the one
//                                            prefetched and the root gathered)
// Default model: an MLP 1024 - [2048 x 16] - 1024 (67M parameters, 268 MB in fp32) on
// random tensor data, AdamW, one micro-batch of 8 per rank, 5 steps, EMA off, no
// checkpoints; world sizes 2, 4 and 8, all in one run.
// Usage (from the repository root):
//   bench_memory_bench [--worlds 2,4,8] [--strategies no_shard,zero2,zero3] [--width 2048]
//                      [--layers 16] [--features 1024] [--steps 5] [--set key=value ...]
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "common/errors.h"
#include "common/filesystem.h"

namespace {

namespace fs = std::filesystem;

struct Shape {
  int64_t features = 1024, width = 2048, layers = 16;
  // Parameters of features - [width x layers] - features (a Linear per arrow, with bias).
  int64_t params() const {
    return features * width + width + (layers - 1) * (width * width + width) + width * features + features;
  }
};

// The peak RSS (MiB, largest over the ranks) tessera-train reported at its last step.
double peakRssMiB(const std::string& binDir, const std::string& data, const Shape& shape, const std::string& strategy,
                  int world, int64_t steps, const std::vector<std::string>& sets, const fs::path& runDir) {
  std::string hidden = "[";
  for (int64_t i = 0; i < shape.layers; ++i) hidden += (i ? "," : "") + std::to_string(shape.width);
  hidden += "]";
  std::string command = binDir + "/tessera-run --standalone --nproc-per-node " + std::to_string(world) + " " + binDir +
                        "/tessera-train --config configs/default.yaml --set model.arch=mlp --set model.hidden=" +
                        hidden + " --set data.kind=tensors --set data.path=" + data +
                        " --set data.global_batch=" + std::to_string(8 * world) + " --set data.micro_batch=8" +
                        " --set data.eval_fraction=0.1 --set run.steps=" + std::to_string(steps) +
                        " --set run.log_every=" + std::to_string(steps) + " --set run.eval_every=0" +
                        " --set optim.schedule.warmup_steps=0 --set ema.enabled=false --set checkpoint.at_end=false" +
                        " --set checkpoint.every_steps=0 --set checkpoint.export=[] --set log.per_rank_files=false" +
                        " --set sharding.strategy=" + strategy;
  for (const auto& s : sets) command += " --set " + s;
  command += " --set run.dir=" + runDir.string() + " > " + runDir.string() + ".log 2>&1";
  const int status = std::system(command.c_str());
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "tessera-train failed (status %d); log: %s.log\n", status, runDir.c_str());
    std::exit(1);
  }
  std::ifstream in(runDir / "metrics.jsonl");
  double peak = 0;
  for (std::string line; std::getline(in, line);) peak = nlohmann::json::parse(line).at("peak_rss_mib").get<double>();
  tessera::removeTree(runDir.string());
  fs::remove(runDir.string() + ".log");
  return peak;
}

// What ZeRO says a rank of `strategy` holds, in MiB, and the formula's text (zero1 was
// given zero3's formula before; a strategy without one is refused).
struct Formula {
  double mib;
  const char* text;
};
Formula formulaOf(const std::string& strategy, const Shape& shape, int world) {
  const double psi = static_cast<double>(shape.params()), n = world, mib = 1024.0 * 1024.0;
  if (strategy == "no_shard") return {16 * psi / mib, "16 Psi"};
  if (strategy == "zero1") return {(8 * psi + 8 * psi / n) / mib, "8 Psi + 8 Psi/N"};
  if (strategy == "zero2") return {(4 * psi + 12 * psi / n) / mib, "4 Psi + 12 Psi/N"};
  if (strategy == "zero3") {
    const double unit = 4.0 * static_cast<double>(shape.width * shape.width + shape.width);
    return {(16 * psi / n + 3 * unit) / mib, "16 Psi/N + 3 units"};
  }
  throw tessera::UsageError("no ZeRO formula for strategy '" + strategy +
                            "' (no_shard, zero1, zero2, zero3)");
}

std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = list.find(',', start);
    out.push_back(list.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string worlds = "2,4,8", strategies = "no_shard,zero2,zero3";
  Shape shape;
  int64_t steps = 5;
  std::vector<std::string> sets;
  CLI::App app{"Peak memory per rank of tessera-train against the ZeRO formulas"};
  app.add_option("--worlds", worlds, "World sizes, comma-separated");
  app.add_option("--strategies", strategies, "Strategies, comma-separated");
  app.add_option("--features", shape.features, "Input features and classes")->check(CLI::Range(int64_t{2}, int64_t{1} << 20));
  app.add_option("--width", shape.width, "Hidden width")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--layers", shape.layers, "Hidden layers (the zero3 units)")->check(CLI::Range(int64_t{1}, int64_t{1000}));
  app.add_option("--steps", steps, "Optimizer steps per run")->check(CLI::Range(int64_t{1}, int64_t{1000}));
  app.add_option("--set", sets, "Config override for every run (key=value), repeatable");
  CLI11_PARSE(app, argc, argv);

  try {
    const std::string binDir = fs::absolute(fs::path(argv[0])).parent_path().string();
    const fs::path work = fs::temp_directory_path() / ("tessera_memory_bench_" + std::to_string(::getpid()));
    fs::create_directories(work);
    // Random inputs [256, features] and class ids in [0, features): the data is the same
    // for every run, and small (1 MiB).
    const std::string data = (work / "data.safetensors").string();
    at::manual_seed(0);
    tessera::checkpoint::saveSafetensors(data, {{"inputs", at::randn({256, shape.features})},
                                                {"targets", at::randint(shape.features, {256}, at::kLong)}});
    const Shape tiny{shape.features, 8, 1};
    std::printf("model %lld - [%lld x %lld] - %lld: Psi = %lld parameters (%.0f MiB in fp32); baseline: the same run "
                "with one hidden layer of 8\n",
                static_cast<long long>(shape.features), static_cast<long long>(shape.width),
                static_cast<long long>(shape.layers), static_cast<long long>(shape.features),
                static_cast<long long>(shape.params()), 4.0 * static_cast<double>(shape.params()) / (1 << 20));
    std::printf("%-9s %3s %12s %12s %14s %22s %7s\n", "strategy", "N", "peak MiB", "baseline MiB", "above baseline",
                "formula MiB", "ratio");
    for (const std::string& strategy : split(strategies)) formulaOf(strategy, shape, 1);  // every one has a formula
    for (const std::string& strategy : split(strategies)) {
      for (const std::string& w : split(worlds)) {
        const int world = std::stoi(w);
        const double peak = peakRssMiB(binDir, data, shape, strategy, world, steps, sets, work / "run");
        const double base = peakRssMiB(binDir, data, tiny, strategy, world, steps, sets, work / "base");
        const double above = peak - base;
        const Formula formula = formulaOf(strategy, shape, world);
        std::printf("%-9s %3d %12.0f %12.0f %14.0f %12.0f %-9s %6.2fx\n", strategy.c_str(), world, peak, base, above,
                    formula.mib, formula.text, above / formula.mib);
        std::fflush(stdout);
      }
    }
    tessera::removeTree(work.string());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_memory_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
