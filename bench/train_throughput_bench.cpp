// Training throughput benchmark (issue 8): samples per second of tessera-train (by
// default configs/default.yaml: zero3 at world size 2 under tessera-run, EMA at two
// decays) against the same model and global batch trained by a plain single-process
// LibTorch loop (the built-in model without any sharding, torch::optim::AdamW, gradient
// clipping, the same micro-batches), measured in the same run, interleaved rep by rep.
//
// The baseline runs with 1 intra-op thread and with --threads (default 2: the cores the
// 2 ranks use). Tessera's figure is the steady state from its metrics.jsonl (every
// logged window after the first, which holds the warm-up), and the wall time of the
// whole command (process start, rendezvous, model build) is reported beside it.
// Usage (from the repository root):
//   bench_train_throughput_bench [--config configs/default.yaml] [--steps 200] [--reps 3]
//                                [--nproc 2] [--threads 2] [--set key=value ...]
//   bench_train_throughput_bench --logging-overhead ...   (issue 33: what logging costs)
//   bench_train_throughput_bench --flight-overhead ...    (issue 34: what the flight recorder costs)
//   bench_train_throughput_bench --plain-only --json ...  (issue 73: the plain loop alone, in its own
//       process, with Tessera's optimizer kernels, its EMA and a prefetching loader: the baseline
//       side of bench/compare_fixed.py, which alternates it with tessera-train)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <torch/types.h>  // before clip_grad.h, which uses torch::Tensor without including it
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <numeric>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/app_main.h"
#include "common/trace.h"
#include "datasets/batch_loader.h"
#include "optim/cpu_kernels.h"
#include "common/filesystem.h"
#include "sharding/host_allocator.h"
#include "datasets/dataset.h"
#include "models/models.h"
#include "datasets/text_dataset.h"
#include "recipes/recipes.h"
#include "trainer/profiler.h"
#include "trainer/train_config.h"

namespace {

namespace fs = std::filesystem;
using tessera::trainer::TrainConfig;

double nowSec() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

const char* strategyName(const TrainConfig& cfg) {
  return tessera::sharding::strategyKindName(cfg.models.front().sharding.strategy);
}

// The plain loop: samples per second over `steps` steps after 10 warm-up steps.
double plainLoopSamplesPerSec(const TrainConfig& cfg, int threads, int64_t steps) {
  at::set_num_threads(threads);
  torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
  const tessera::trainer::ModelEntry& m = cfg.models.front();
  auto data = tessera::datasets::makeDataset(cfg.data, tessera::models::tokenWindows(m.model));
  auto model = tessera::models::makeModel(m.model, data->spec());
  tessera::models::initializeModel(*model, static_cast<uint64_t>(cfg.run.seed));
  const tessera::optim::OptimizerOptions& o = m.sharding.optimizer;
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(m.schedule.baseLr)
                                                         .betas({o.beta1, o.beta2})
                                                         .eps(o.eps)
                                                         .weight_decay(o.weightDecay));
  tessera::datasets::DistributedSampler sampler(data->trainSamples(), cfg.data.global_batch, cfg.run.seed,
                                               cfg.data.shuffle);
  const int64_t micro = cfg.data.micro_batch, accumulation = cfg.data.global_batch / micro;
  auto step = [&](int64_t s) {
    optimizer.zero_grad();
    const std::vector<int64_t> indices = sampler.indicesFor(s, 0, 1);
    for (int64_t m = 0; m < accumulation; ++m) {
      const std::vector<int64_t> slice(indices.begin() + m * micro, indices.begin() + (m + 1) * micro);
      tessera::datasets::Batch batch = data->trainBatch(slice);
      tessera::datasets::seedNoise(batch, cfg.run.seed, s, slice);
      (model->losses(batch).mean() / static_cast<double>(accumulation)).backward();
    }
    if (m.sharding.gradClip > 0) torch::nn::utils::clip_grad_norm_(model->parameters(), m.sharding.gradClip);
    optimizer.step();
  };
  for (int64_t s = 0; s < 10; ++s) step(s);
  const double start = nowSec();
  for (int64_t s = 10; s < 10 + steps; ++s) step(s);
  return static_cast<double>(cfg.data.global_batch * steps) / (nowSec() - start);
}

// How the plain-only loop (issue 73) steps, loads and averages: by default as tessera-train
// does, so that only the sharding runtime differs between the two.
struct PlainSettings {
  std::string optimizer = "fused";  // fused: Tessera's one-pass AdamW and norm; torch: torch::optim::AdamW + clip_grad_norm_
  int emaDecays = -1;               // EMA copies blended each step (-1: as the config's ema section)
  std::string data = "prefetch";    // prefetch: datasets::BatchLoader one step ahead; inline: on the step's thread
  int threads = 1;
  int64_t warmup = 10, steps = 200;
  int64_t traceSteps = 0;  // then this many more steps traced with every LibTorch operator (issue 73)
  std::string traceFile;   // into this Chrome trace, as tessera-train's profile.aten_ops writes
};

// The plain loop alone, timed step by step; prints one JSON line. Its optimizer "fused" is
// the kernel tessera-train's CPU AdamW runs (optim/cpu_kernels.h), decay on every
// parameter as torch's AdamW (Tessera skips 1-D ones: a few hundred elements).
void plainOnly(const TrainConfig& cfg, const PlainSettings& p) {
  at::set_num_threads(p.threads);
  torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
  const tessera::trainer::ModelEntry& entry = cfg.models.front();
  auto data = tessera::datasets::makeDataset(cfg.data, tessera::models::tokenWindows(entry.model));
  auto model = tessera::models::makeModel(entry.model, data->spec());
  tessera::models::initializeModel(*model, static_cast<uint64_t>(cfg.run.seed));
  std::vector<at::Tensor> params = model->parameters();
  const tessera::optim::OptimizerOptions& o = entry.sharding.optimizer;
  const double lr = entry.schedule.baseLr, clip = entry.sharding.gradClip;
  std::unique_ptr<torch::optim::AdamW> torchAdam;
  if (p.optimizer == "torch") {
    torchAdam = std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weightDecay));
  }
  std::vector<at::Tensor> expAvg, expAvgSq;
  for (const at::Tensor& q : params) {
    expAvg.push_back(at::zeros_like(q));
    expAvgSq.push_back(at::zeros_like(q));
  }
  const int decays = p.emaDecays >= 0 ? p.emaDecays
                                      : (entry.ema.enabled ? static_cast<int>(entry.ema.options.decays.size()) : 0);
  std::vector<std::vector<at::Tensor>> ema(static_cast<size_t>(decays));
  for (auto& copy : ema) {
    for (const at::Tensor& q : params) copy.push_back(q.detach().clone());
  }
  tessera::datasets::DistributedSampler sampler(data->trainSamples(), cfg.data.global_batch, cfg.run.seed,
                                               cfg.data.shuffle);
  std::unique_ptr<tessera::datasets::BatchLoader> loader;
  if (p.data == "prefetch") {
    loader = std::make_unique<tessera::datasets::BatchLoader>(*data, sampler, 0, 1, cfg.run.seed, cfg.data.hflip);
  }
  const int64_t micro = cfg.data.micro_batch, accumulation = cfg.data.global_batch / micro;
  auto step = [&](int64_t s) {
    for (at::Tensor& q : params) q.mutable_grad() = at::Tensor();
    tessera::datasets::StepBatch whole;
    if (loader) {
      whole = loader->take(s);
    } else {
      whole.indices = sampler.indicesFor(s, 0, 1);
      whole.batch = data->trainBatch(whole.indices);
      tessera::datasets::seedNoise(whole.batch, cfg.run.seed, s, whole.indices);
      if (cfg.data.hflip) tessera::datasets::flipHalfHorizontally(whole.batch);
    }
    for (int64_t m = 0; m < accumulation; ++m) {
      const tessera::datasets::Batch batch = tessera::datasets::sliceBatch(whole.batch, m * micro, (m + 1) * micro);
      (model->losses(batch).mean() / static_cast<double>(accumulation)).backward();
    }
    if (torchAdam) {
      if (clip > 0) torch::nn::utils::clip_grad_norm_(params, clip);
      torchAdam->step();
    } else {
      double squares = 0;
      for (const at::Tensor& q : params) squares += tessera::optim::squaredNorm(q.grad().data_ptr<float>(), q.numel());
      const double norm = std::sqrt(squares), scale = clip > 0 && norm > clip ? clip / (norm + 1e-6) : 1.0;
      const int64_t t = s + 1;
      tessera::optim::AdamScalars a;
      a.paramScale = static_cast<float>(1.0 - lr * o.weightDecay);
      a.beta1 = static_cast<float>(o.beta1);
      a.oneMinusBeta1 = static_cast<float>(1.0 - o.beta1);
      a.beta2 = static_cast<float>(o.beta2);
      a.oneMinusBeta2 = static_cast<float>(1.0 - o.beta2);
      a.sqrtBiasCorrection2 = static_cast<float>(std::sqrt(1.0 - std::pow(o.beta2, static_cast<double>(t))));
      a.eps = static_cast<float>(o.eps);
      a.negStepSize = static_cast<float>(-lr / (1.0 - std::pow(o.beta1, static_cast<double>(t))));
      at::NoGradGuard noGrad;
      for (size_t i = 0; i < params.size(); ++i) {
        at::Tensor g = params[i].grad();
        if (scale != 1.0) g.mul_(scale);
        tessera::optim::fusedAdamStep(params[i].data_ptr<float>(), g.data_ptr<float>(), expAvg[i].data_ptr<float>(),
                                      expAvgSq[i].data_ptr<float>(), params[i].numel(), a);
      }
    }
    at::NoGradGuard noGrad;
    for (int d = 0; d < decays; ++d) {
      const std::vector<double>& configured = entry.ema.options.decays;
      const double decay = configured.at(static_cast<size_t>(d) % configured.size());
      for (size_t i = 0; i < params.size(); ++i) ema[static_cast<size_t>(d)][i].lerp_(params[i], 1.0 - decay);
    }
  };
  for (int64_t s = 0; s < p.warmup; ++s) step(s);
  std::vector<double> times;
  for (int64_t s = p.warmup; s < p.warmup + p.steps; ++s) {
    const double start = nowSec();
    step(s);
    times.push_back(nowSec() - start);
  }
  if (p.traceSteps > 0) {
    // The steps as tessera-train's profile window records them: a "step N" span on the main
    // track, the operators inside, the loader's on its own track.
    tessera::trace::start();
    const int64_t originNs = tessera::trace::nowNs();
    {
      tessera::trainer::AtenOpRecorder ops;
      for (int64_t s = p.warmup + p.steps; s < p.warmup + p.steps + p.traceSteps; ++s) {
        tessera::trace::Span span("step", "step " + std::to_string(s + 1));
        step(s);
      }
    }
    const std::string events = tessera::trainer::chromeTraceEvents(tessera::trace::stop(), 0, originNs);
    std::ofstream(p.traceFile) << "{\"traceEvents\": " << events << "}\n";
  }
  const double mean = std::accumulate(times.begin(), times.end(), 0.0) / static_cast<double>(times.size());
  nlohmann::json out = {{"framework", "plain"},
                        {"world", 1},
                        {"step_s_mean", mean},
                        {"median_s", median(times)},
                        {"samples_per_sec", static_cast<double>(cfg.data.global_batch) / mean},
                        {"times_s", times},
                        {"settings",
                         {{"optimizer", p.optimizer == "torch" ? "torch::optim::AdamW + clip_grad_norm_"
                                                               : "tessera fusedAdamStep + squaredNorm clip"},
                          {"ema_decays", decays},
                          {"data", p.data == "prefetch" ? "BatchLoader (one step ahead)" : "inline"},
                          {"threads", p.threads},
                          {"warmup", p.warmup},
                          {"steps", p.steps}}}};
  std::printf("%s\n", out.dump().c_str());
}

struct TesseraRun {
  double steadySamplesPerSec = 0;  // metrics.jsonl, windows after the first
  double wallSamplesPerSec = 0;    // steps x global batch / wall time of the whole command
  double loopSamplesPerSec = 0;    // the "done:" line: the train loop with its logging, set-up excluded
};

// The samples/s of tessera-train's "done: ... N samples/s" line in `log` (0 if none).
double loopRate(const std::string& log) {
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);) {
    const size_t done = line.find("] done: "), unit = line.rfind(" samples/s");
    if (done == std::string::npos || unit == std::string::npos) continue;
    const size_t start = line.rfind(' ', unit - 1);
    return std::atof(line.substr(start + 1, unit - start - 1).c_str());
  }
  return 0;
}

TesseraRun tesseraSamplesPerSec(const std::string& binDir, const std::string& config, const std::vector<std::string>& sets,
                                const TrainConfig& cfg, int nproc, int64_t steps, int64_t logEvery = 0) {
  const fs::path runDir = fs::temp_directory_path() / ("tessera_throughput_" + std::to_string(::getpid()));
  tessera::removeTree(runDir);
  std::string command = binDir + "/tessera-run --standalone --nproc-per-node " + std::to_string(nproc) + " " + binDir +
                        "/tessera-train --config " + config;
  for (const auto& s : sets) command += " --set " + s;
  command += " --set run.steps=" + std::to_string(steps + steps / 4) + " --set run.log_every=" +
             std::to_string(logEvery > 0 ? logEvery : steps / 4) + " --set run.eval_every=0 --set checkpoint.every_steps=0" +
             " --set checkpoint.at_end=false --set checkpoint.export=[] --set log.per_rank_files=false" +
             " --set run.dir=" + runDir.string() + " > " + runDir.string() + ".log 2>&1";
  const double start = nowSec();
  const int status = std::system(command.c_str());
  const double wall = nowSec() - start;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "tessera-train failed (status %d); log: %s.log\n", status, runDir.c_str());
    std::exit(1);
  }
  TesseraRun r;
  std::ifstream in(runDir / "metrics.jsonl");
  double samples = 0, seconds = 0;
  bool first = true;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (first) {
      first = false;
      continue;
    }
    const double sps = j.at("samples_per_sec").get<double>();
    const double windowSamples =
        static_cast<double>(cfg.data.global_batch) * static_cast<double>(logEvery > 0 ? logEvery : steps / 4);
    samples += windowSamples;
    seconds += windowSamples / sps;
  }
  r.steadySamplesPerSec = seconds > 0 ? samples / seconds : 0;
  r.wallSamplesPerSec = static_cast<double>(cfg.data.global_batch * (steps + steps / 4)) / wall;
  r.loopSamplesPerSec = loopRate(runDir.string() + ".log");
  tessera::removeTree(runDir);
  fs::remove(runDir.string() + ".log");
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string config = "configs/default.yaml";
  int64_t steps = 200;
  int reps = 3, nproc = 2, threads = 2;
  std::vector<std::string> sets;
  CLI::App app{"tessera-train throughput vs a plain single-process LibTorch loop"};
  app.add_option("--config", config, "Run config (the model, data and batch of both)");
  app.add_option("--steps", steps, "Timed optimizer steps per run (a multiple of 4)")->check(CLI::Range(int64_t{8}, int64_t{100000}));
  app.add_option("--reps", reps, "Interleaved repetitions (median reported)")->check(CLI::Range(1, 100));
  app.add_option("--nproc", nproc, "Ranks of the tessera-train run")->check(CLI::Range(1, 64));
  app.add_option("--threads", threads, "Intra-op threads of the second baseline")->check(CLI::Range(1, 256));
  app.add_option("--set", sets, "Config override for both (key=value), repeatable");
  bool loggingOverhead = false;
  int64_t logEvery = 10;
  app.add_flag("--logging-overhead", loggingOverhead,
               "Instead: tessera-train logging everything (metrics.jsonl, TensorBoard, MFU, the memory breakdown) "
               "every --log-every steps against TensorBoard off and one metrics line per run, interleaved; the train "
               "loop's samples/s of each");
  app.add_option("--log-every", logEvery, "With --logging-overhead: run.log_every of the logging run")
      ->check(CLI::Range(int64_t{1}, int64_t{100000}));
  bool flightOverhead = false;
  app.add_flag("--flight-overhead", flightOverhead,
               "Instead: tessera-train with the flight recorder on (diagnostics.flight_entries 2000, the default) "
               "against off (0), interleaved; the train loop's samples/s of each");
  bool plainOnlyMode = false, json = false;
  PlainSettings plain;
  app.add_flag("--plain-only", plainOnlyMode,
               "Instead: only the plain loop, with --threads threads, --warmup untimed then --steps timed steps");
  app.add_flag("--json", json, "With --plain-only: print one JSON line (per-step times, settings)");
  app.add_option("--plain-optimizer", plain.optimizer,
                 "With --plain-only: fused (Tessera's CPU AdamW kernel and one-pass norm, as tessera-train) or torch "
                 "(torch::optim::AdamW + clip_grad_norm_)")
      ->check(CLI::IsMember({"fused", "torch"}));
  app.add_option("--plain-ema", plain.emaDecays, "With --plain-only: EMA copies blended per step (-1: as the config)")
      ->check(CLI::Range(-1, 16));
  app.add_option("--plain-data", plain.data, "With --plain-only: prefetch (a BatchLoader thread, as tessera-train) or inline")
      ->check(CLI::IsMember({"prefetch", "inline"}));
  app.add_option("--warmup", plain.warmup, "With --plain-only: untimed steps first")
      ->check(CLI::Range(int64_t{0}, int64_t{100000}));
  app.add_option("--trace", plain.traceFile,
                 "With --plain-only: after the timed steps, trace --trace-steps more with every LibTorch operator "
                 "into this Chrome-trace file (as tessera-train's profile.aten_ops)");
  app.add_option("--trace-steps", plain.traceSteps, "With --trace: how many steps")
      ->check(CLI::Range(int64_t{1}, int64_t{1000}));
  CLI11_PARSE(app, argc, argv);
  if (plainOnlyMode) {
    if (!json) {
      std::fprintf(stderr, "bench_train_throughput_bench: --plain-only prints JSON only: add --json\n");
      return 2;
    }
    plain.threads = threads;
    plain.steps = steps;
    if (!plain.traceFile.empty() && plain.traceSteps == 0) plain.traceSteps = 20;
  }
  steps = steps / 4 * 4;
  // The baseline loop runs under the host allocator tessera-train uses for itself.
  tessera::sharding::useCachingHostAllocator();

  try {
    tessera::recipes::addBuiltinRecipes();
    const TrainConfig cfg = tessera::trainer::loadTrainConfig(config, sets, nproc).config;
    if (plainOnlyMode) {
      plainOnly(cfg, plain);
      return 0;
    }
    const std::string binDir = fs::absolute(fs::path(argv[0])).parent_path().string();
    std::printf("config %s: model %s, global batch %lld (micro-batches of %lld), strategy %s on %d ranks, %lld steps\n",
                config.c_str(), cfg.models.front().model.arch.c_str(), static_cast<long long>(cfg.data.global_batch),
                static_cast<long long>(cfg.data.micro_batch), strategyName(cfg), nproc,
                static_cast<long long>(steps));
    if (flightOverhead) {
      std::vector<double> on, off;
      for (int rep = 0; rep < reps; ++rep) {
        std::vector<std::string> recorded = sets, unrecorded = sets;
        recorded.push_back("diagnostics.flight_entries=2000");
        unrecorded.push_back("diagnostics.flight_entries=0");
        // Alternating which goes first: the machine's drift does not favour one side.
        if (rep % 2 == 0) on.push_back(tesseraSamplesPerSec(binDir, config, recorded, cfg, nproc, steps).loopSamplesPerSec);
        off.push_back(tesseraSamplesPerSec(binDir, config, unrecorded, cfg, nproc, steps).loopSamplesPerSec);
        if (rep % 2 == 1) on.push_back(tesseraSamplesPerSec(binDir, config, recorded, cfg, nproc, steps).loopSamplesPerSec);
        std::printf("rep %d: train loop samples/s, flight recorder on %.0f, off %.0f\n", rep, on.back(), off.back());
      }
      const double a = median(on), b = median(off);
      std::printf("\nmedian train loop samples/s: flight recorder on %.0f, off %.0f: the recorder costs %.2f%% of step "
                  "time\n",
                  a, b, 100.0 * (b / a - 1.0));
      return 0;
    }
    if (loggingOverhead) {
      std::vector<double> on, off;
      for (int rep = 0; rep < reps; ++rep) {
        std::vector<std::string> withLogs = sets, without = sets;
        withLogs.push_back("log.tensorboard=true");
        without.push_back("log.tensorboard=false");
        on.push_back(tesseraSamplesPerSec(binDir, config, withLogs, cfg, nproc, steps, logEvery).loopSamplesPerSec);
        off.push_back(tesseraSamplesPerSec(binDir, config, without, cfg, nproc, steps, steps + steps / 4)
                          .loopSamplesPerSec);
        std::printf("rep %d: train loop samples/s, logging every %lld steps %.0f, logging once %.0f\n", rep,
                    static_cast<long long>(logEvery), on.back(), off.back());
      }
      const double a = median(on), b = median(off);
      std::printf("\nmedian train loop samples/s: everything logged every %lld steps %.0f, once per run %.0f: "
                  "logging costs %.2f%% of step time\n",
                  static_cast<long long>(logEvery), a, b, 100.0 * (b / a - 1.0));
      return 0;
    }
    std::vector<double> plain1, plainN, steady, wall;
    for (int rep = 0; rep < reps; ++rep) {
      plain1.push_back(plainLoopSamplesPerSec(cfg, 1, steps));
      plainN.push_back(plainLoopSamplesPerSec(cfg, threads, steps));
      const TesseraRun t = tesseraSamplesPerSec(binDir, config, sets, cfg, nproc, steps);
      steady.push_back(t.steadySamplesPerSec);
      wall.push_back(t.wallSamplesPerSec);
      std::printf("rep %d: plain 1 thread %.0f, plain %d threads %.0f, tessera steady %.0f, tessera wall %.0f samples/s\n",
                  rep, plain1.back(), threads, plainN.back(), steady.back(), wall.back());
    }
    const double p1 = median(plain1), pn = median(plainN), st = median(steady), wa = median(wall);
    std::printf("\nmedian samples/s: plain LibTorch loop (AdamW) 1 thread %.0f, %d threads %.0f; tessera-train %s x%d "
                "steady %.0f (%.2fx / %.2fx), whole command %.0f (%.2fx / %.2fx)\n",
                p1, threads, pn, strategyName(cfg), nproc, st, st / p1, st / pn, wa, wa / p1, wa / pn);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_train_throughput_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
