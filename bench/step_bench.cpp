// Training-step benchmark (issue 35): one optimizer step of a built-in model with bf16
// compute and fp32 master weights, three ways in one process, interleaved:
//   tessera: zero3 at world size 1 (FullyShardStrategy, each block a unit, the sharded
//            AdamW over fp32 masters, gradients reduced in --reduce-dtype); on CUDA its
//            all-gathers and reduce-scatters go through the nccl communicator on its own
//            streams (the real NCCL path unless --shortcut answers a world of one locally);
//   plain:   the same model in a LibTorch loop without sharding: a compute-dtype copy of
//            the model runs forward/backward, its gradients are cast into fp32 masters,
//            AdamW steps them and the copy is refreshed. On CUDA with LibTorch 2.x the
//            AdamW is torch's fused kernel (at::_fused_adamw_, torch.optim.AdamW(fused=True)),
//            the one Tessera's optimizer calls there; elsewhere torch::optim::AdamW.
// and on request: --reshard-last (zero3 freeing the last unit after forward, FSDP2's
// default) and --offload (zero3 with CPU offload: masters, gradients and AdamW on the host).
// bench/fsdp2_step.py runs the same model (same names, sizes, batch, dtypes, optimizer)
// under PyTorch FSDP2's fully_shard + MixedPrecisionPolicy(bf16, fp32). --only runs one
// variant, so that scripts/gpu-session.sh alternates them in separate processes
// (bench/step_rounds.py takes the median and range of its rounds).
//
// Models: --model gpt (models/models.h, nanoGPT names: tokens [batch, context], loss the
// cross-entropy at every position) or --model dit (models/dit.h: images [batch, C, H, H],
// random timesteps and labels, loss the MSE against the noise). Per variant: the median
// step time of --steps steps after --warmup (each timed to a device synchronise), tokens/s
// or images/s, model FLOPs per step (formula below), MFU against the peak (--peak-tflops,
// else a bf16 matrix-product probe on the device at start, stated as measured) and the
// peak device memory per step (CUDA caching allocator). --trace FILE writes a Chrome trace
// (Kineto, PyTorch's profiler) of two tessera steps, where the build has it.
//
// Model FLOPs (forward + backward = 3x forward; a multiply-add is 2 FLOPs):
//   gpt: per token 6 N + 6 L T D, N the parameters of the matrix products (blocks and
//        lm_head, not the embeddings), T the context, D the width, L the blocks — the
//        attention scores and their product with V over the full T x T (PaLM's count).
//   dit: per image 6 (P N_tok + N_img) + 12 L P^2 D, P = (H/p)^2 tokens, N_tok the
//        parameters applied per token (patch embedding, qkv, proj, fc1, fc2, final
//        linear), N_img those applied per image (timestep MLP, adaLN modulations).
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>
#include <torch/version.h>
#ifdef TESSERA_TORCH_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif
#ifdef TESSERA_HAS_KINETO
#include <torch/csrc/autograd/profiler_kineto.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/command_line.h"
#include "common/errors.h"
#include "distributed/communicator.h"
#include "distributed/store.h"
#include "sharding/fully_shard.h"
#include "sharding/strategy.h"
#include "models/dit.h"
#include "models/gpt.h"
#include "models/models.h"

namespace {

bool gCuda = false;

double nowSec() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void sync() {
  if (gCuda) torch::cuda::synchronize();
}

// Peak bytes the CUDA caching allocator handed out since the last reset (0 on the CPU).
int64_t peakBytes() {
#ifdef TESSERA_TORCH_HAS_CUDA
  if (gCuda) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
  }
#endif
  return 0;
}

void resetPeak() {
#ifdef TESSERA_TORCH_HAS_CUDA
  if (gCuda) c10::cuda::CUDACachingAllocator::resetPeakStats(0);
#endif
}

struct Measure {
  double medianMs = 0;
  double peakGiB = 0;
  // Where the time goes: medians of steps with a device synchronise between the two.
  double forwardBackwardMs = 0, updateMs = 0;
};

// One variant's step in its two phases: the loss's forward and backward, then what
// turns gradients into new parameters (gradient sync, norm, optimizer, parameter refresh).
struct Step {
  std::function<void()> forwardBackward, update;
  void operator()() const {
    forwardBackward();
    update();
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median step time of `step`, the largest per-step peak of device memory, and (from
// `steps` more steps, each synchronised between its phases) the phases' medians.
Measure measure(int warmup, int steps, const Step& step) {
  for (int i = 0; i < warmup; ++i) step();
  sync();
  std::vector<double> times, forwardBackward, update;
  int64_t peak = 0;
  for (int i = 0; i < steps; ++i) {
    resetPeak();
    const double start = nowSec();
    step();
    sync();
    times.push_back((nowSec() - start) * 1e3);
    peak = std::max(peak, peakBytes());
  }
  for (int i = 0; i < steps; ++i) {
    const double start = nowSec();
    step.forwardBackward();
    sync();
    const double mid = nowSec();
    step.update();
    sync();
    forwardBackward.push_back((mid - start) * 1e3);
    update.push_back((nowSec() - mid) * 1e3);
  }
  return {median(times), static_cast<double>(peak) / (1 << 30), median(forwardBackward), median(update)};
}

// TFLOP/s of a bf16 (fp32 on the CPU) n x n x n matrix product: the peak MFU is taken
// against when --peak-tflops is not given. Mean of 10 after 3 warm-ups.
double probePeakTflops(const at::Device& dev, int64_t n) {
  const auto opts = at::TensorOptions().dtype(gCuda ? at::kBFloat16 : at::kFloat).device(dev);
  const at::Tensor a = at::randn({n, n}, opts), b = at::randn({n, n}, opts);
  at::Tensor c;
  for (int i = 0; i < 3; ++i) c = at::mm(a, b);
  sync();
  const double start = nowSec();
  constexpr int kReps = 10;
  for (int i = 0; i < kReps; ++i) c = at::mm(a, b);
  sync();
  return 2.0 * static_cast<double>(n) * n * n * kReps / (nowSec() - start) / 1e12;
}

// Parameters of `model` whose name matches one of `parts` (substring), summed.
int64_t paramsNamed(torch::nn::Module& model, const std::vector<std::string>& parts) {
  int64_t total = 0;
  for (const auto& p : model.named_parameters()) {
    for (const auto& part : parts) {
      if (p.key().find(part) != std::string::npos) {
        total += p.value().numel();
        break;
      }
    }
  }
  return total;
}

// The workload: how to build its model, its step's loss, and what a step processes.
struct Workload {
  std::function<std::shared_ptr<torch::nn::Module>()> build;  // deferred: no storage yet
  std::function<at::Tensor(torch::nn::Module&, bool sharded)> loss;
  std::string unitPattern;     // sharding.wrap of the blocks
  double itemsPerStep = 0;     // tokens (gpt) or images (dit)
  const char* itemName = "";
  double flopsPerStep = 0;     // model FLOPs, forward + backward
  std::string describe;
};

at::Tensor crossEntropy(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat), targets.reshape({-1}));
}

Workload gptWorkload(const tessera::models::ModelOptions& m, int64_t batch, const at::Device& dev) {
  using tessera::models::Gpt;
  Workload w;
  w.build = [m, dev] { return std::make_shared<Gpt>(m, dev); };
  auto sharded = w.build();
  const auto tokens = at::randint(m.vocab_size, {batch, m.context}, at::TensorOptions().dtype(at::kLong).device(dev));
  const auto targets = at::randint(m.vocab_size, {batch, m.context}, tokens.options());
  // The loss outside the root unit, as bench/fsdp2_step.py computes it outside the model
  // FSDP2 wraps: the root's pre-backward then runs when the logits' gradient is ready.
  w.loss = [tokens, targets](torch::nn::Module& model, bool isSharded) {
    auto& gpt = dynamic_cast<Gpt&>(model);
    const at::Tensor logits =
        isSharded ? tessera::sharding::unitForward(model, tokens, [&gpt](const at::Tensor& in) { return gpt.forward(in); })
                  : gpt.forward(tokens);
    return crossEntropy(logits, targets);
  };
  const int64_t matmulParams = paramsNamed(*sharded, {"h.", "lm_head"});
  const double perToken = 6.0 * static_cast<double>(matmulParams) + 6.0 * m.layers * m.context * m.embed_dim;
  w.itemsPerStep = static_cast<double>(batch * m.context);
  w.itemName = "tokens";
  w.flopsPerStep = perToken * w.itemsPerStep;
  w.unitPattern = "h.*";
  w.describe = tessera::strCat("GPT (embed ", m.embed_dim, ", ", m.layers, " layers, ", m.heads, " heads, context ",
                               m.context, ", vocab ", m.vocab_size, "), batch ", batch);
  return w;
}

Workload ditWorkload(const tessera::models::ModelOptions& m, int64_t image, int64_t channels, int64_t batch,
                     const at::Device& dev) {
  using tessera::models::DiT;
  Workload w;
  const std::vector<int64_t> shape{channels, image, image};
  w.build = [m, shape, dev] { return std::make_shared<DiT>(m, shape, m.classes, dev); };
  auto sharded = w.build();
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
  const auto i64 = at::TensorOptions().dtype(at::kLong).device(dev);
  const at::Tensor x = at::randn({batch, channels, image, image}, f32);
  const at::Tensor noise = at::randn({batch, channels, image, image}, f32);
  const at::Tensor t = at::randint(m.timesteps, {batch}, i64);
  const at::Tensor y = at::randint(m.classes + 1, {batch}, i64);
  w.loss = [x, noise, t, y](torch::nn::Module& model, bool isSharded) {
    auto& dit = dynamic_cast<DiT&>(model);
    auto denoise = [&dit, t, y](const at::Tensor& in) { return dit.forward(in, t, y); };
    const at::Tensor out = isSharded ? tessera::sharding::unitForward(model, x, denoise) : denoise(x);
    return (out.to(at::kFloat) - noise).square().mean();
  };
  const double tokens = static_cast<double>((image / m.patch_size) * (image / m.patch_size));
  const int64_t perToken =
      paramsNamed(*sharded, {"x_embedder", "attn.", "mlp.fc", "final_layer.linear"});
  const int64_t perImage = paramsNamed(*sharded, {"t_embedder", "adaLN_modulation"});
  w.flopsPerStep = static_cast<double>(batch) *
                   (6.0 * (tokens * static_cast<double>(perToken) + static_cast<double>(perImage)) +
                    12.0 * m.layers * tokens * tokens * m.embed_dim);
  w.itemsPerStep = static_cast<double>(batch);
  w.itemName = "images";
  w.unitPattern = "blocks.*";
  w.describe = tessera::strCat("DiT (embed ", m.embed_dim, ", ", m.layers, " layers, ", m.heads, " heads, patch ",
                               m.patch_size, ", ", channels, "x", image, "x", image, " inputs: ", tokens, " tokens, ",
                               m.classes, " classes), batch ", batch);
  return w;
}

// A Chrome trace of `steps` calls of `step` (PyTorch's Kineto profiler: every CUDA stream,
// the NCCL kernels on the communicator's own, and the host ops).
void writeTrace(const std::string& path, int steps, const Step& step) {
#ifdef TESSERA_HAS_KINETO
  namespace profiler = torch::autograd::profiler;
  // profile_memory: every allocation and free, with the allocator's total, so the trace
  // shows when the step's peak is reached and what ran then.
  const profiler::ProfilerConfig config(profiler::ProfilerState::KINETO, false, /*profile_memory=*/true, false, false,
                                        false);
  const std::set<profiler::ActivityType> activities{profiler::ActivityType::CPU, profiler::ActivityType::CUDA};
  profiler::prepareProfiler(config, activities);
  profiler::enableProfiler(config, activities);
  for (int i = 0; i < steps; ++i) step();
  sync();
  profiler::disableProfiler()->save(path);
  std::printf("trace of %d steps: %s\n", steps, path.c_str());
#else
  (void)steps;
  (void)step;
  std::printf("--trace %s: this build has no Kineto profiler (a CUDA LibTorch 2.x has it)\n", path.c_str());
#endif
}

}  // namespace

// The plain loop's AdamW step over fp32 masters: torch's fused kernel where there is one
// (CUDA, LibTorch 2.x: the kernel Tessera's optimizer calls), false elsewhere.
// `probe`: only whether it would step.
bool fusedAdamWStep(std::vector<at::Tensor>& masters, std::vector<at::Tensor>& grads, std::vector<at::Tensor>& expAvg,
                    std::vector<at::Tensor>& expAvgSq, int64_t step, double lr, double weightDecay, bool probe = false) {
#if TORCH_VERSION_MAJOR >= 2
  if (!masters.front().is_cuda()) return false;
  if (probe) return true;
  const at::Tensor count = at::full({}, static_cast<double>(step), masters.front().options());
  const std::vector<at::Tensor> steps(masters.size(), count);
  at::_fused_adamw_(masters, grads, expAvg, expAvgSq, {}, steps, lr, 0.9, 0.999, weightDecay, 1e-8,
                    /*amsgrad=*/false, /*maximize=*/false);
  return true;
#else
  (void)masters, (void)grads, (void)expAvg, (void)expAvgSq, (void)step, (void)lr, (void)weightDecay, (void)probe;
  return false;
#endif
}

int main(int argc, char** argv) {
  std::string modelName = "gpt", device = "cpu", dtype = "bf16", reduceDtype = "fp32", trace, only;
  tessera::models::ModelOptions model;
  model.embed_dim = 768;
  model.layers = 12;
  model.heads = 12;
  model.context = 1024;
  model.vocab_size = 50304;
  model.patch_size = 2;
  model.classes = 1000;
  int64_t batch = 8, image = 32, channels = 4;
  int steps = 10, warmup = 3;
  bool shortcut = false, reshardLast = false, offload = false, offloadOnly = false, noPlain = false;
  int rounds = 2;
  double peakTflops = 0;
  CLI::App app{"Training step: tessera zero3 (world 1) vs a plain LibTorch loop, bf16 compute and fp32 masters"};
  app.add_option("--model", modelName, "gpt or dit")->check(CLI::IsMember({"gpt", "dit"}));
  app.add_option("--device", device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--embed", model.embed_dim, "Model width")->check(CLI::PositiveNumber);
  app.add_option("--layers", model.layers, "Blocks")->check(CLI::PositiveNumber);
  app.add_option("--heads", model.heads, "Attention heads (divide --embed)")->check(CLI::PositiveNumber);
  app.add_option("--context", model.context, "gpt: sequence length")->check(CLI::PositiveNumber);
  app.add_option("--vocab", model.vocab_size, "gpt: vocabulary size")->check(CLI::Range(int64_t{2}, int64_t{1} << 24));
  app.add_option("--image", image, "dit: input side (pixels or latent cells)")->check(CLI::PositiveNumber);
  app.add_option("--channels", channels, "dit: input channels")->check(CLI::PositiveNumber);
  app.add_option("--patch", model.patch_size, "dit: patch side (divides --image)")->check(CLI::PositiveNumber);
  app.add_option("--classes", model.classes, "dit: class labels")->check(CLI::PositiveNumber);
  app.add_option("--batch", batch, "Samples per step")->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "Timed steps (median reported)")->check(CLI::Range(1, 10000));
  app.add_option("--warmup", warmup, "Untimed steps first")->check(CLI::Range(0, 10000));
  app.add_option("--dtype", dtype, "Compute dtype (masters are fp32)")->check(CLI::IsMember({"bf16", "fp32"}));
  app.add_option("--reduce-dtype", reduceDtype, "Dtype gradients are reduced in")->check(CLI::IsMember({"bf16", "fp32"}));
  app.add_flag("--shortcut", shortcut, "Answer the world of one locally instead of through NCCL");
  app.add_flag("--offload", offload, "Also run tessera with CPU offload (fp32 masters, gradient shards and AdamW "
               "on the host; FullyShardOptions::cpuOffload)");
  app.add_flag("--offload-only", offloadOnly,
               "With --offload: run only the offload variant (for models whose plain loop would spend the run's time "
               "initialising; compare with fsdp2_step.py --offload)");
  app.add_option("--only", only, "Run this variant alone (plain, tessera, reshard-last, offload): "
                 "scripts/gpu-session.sh alternates them in separate processes")
      ->check(CLI::IsMember({"plain", "tessera", "reshard-last", "offload"}));
  app.add_flag("--no-plain", noPlain,
               "Leave out the plain LibTorch loop (a model it cannot hold: scripts/gpu-session.sh largest)");
  app.add_option("--rounds", rounds, "Rounds of the interleaved variants (each builds its model anew)")
      ->check(CLI::Range(1, 100));
  app.add_flag("--reshard-last", reshardLast, "Also run tessera with the last unit resharded after forward "
               "(FullyShardOptions::keepLastUnit false, as FSDP2's default)");
  app.add_option("--peak-tflops", peakTflops, "Peak for MFU (default: measured by a matrix-product probe)")
      ->check(CLI::PositiveNumber);
  app.add_option("--trace", trace, "Write a Chrome trace of two tessera steps here (Kineto), and of two plain "
                 "steps beside it (name_plain.json)");
  try {
    if (const std::optional<int> done = tessera::parseCommandLine(app, argc, argv)) return *done;
  } catch (const tessera::UsageError& e) {
    std::fprintf(stderr, "bench_step_bench: %s\n", e.what());
    return 2;
  }
  // Line by line into a log file too: a run stopped by its time limit keeps what it printed.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);

  try {
    gCuda = device == "cuda";
    if (gCuda && !torch::cuda::is_available()) {
      std::fprintf(stderr, "bench_step_bench: --device cuda, but no CUDA device is usable\n");
      return 1;
    }
    const at::Device dev = gCuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
    const at::ScalarType compute = dtype == "bf16" ? at::kBFloat16 : at::kFloat;
    model.arch = modelName;
    torch::manual_seed(0);  // the inputs
    Workload w = modelName == "gpt" ? gptWorkload(model, batch, dev) : ditWorkload(model, image, channels, batch, dev);
    int64_t params = 0;
    for (const auto& p : w.build()->parameters()) params += p.numel();

    // Each variant builds its model, measures and frees everything before the next, so a
    // peak is that variant's alone (as in FSDP2's process).
    // tessera: zero3 at world size 1.
    auto runTessera = [&](const std::string& tracePath, bool keepLastUnit, bool cpuOffload) {
      const double setUpStart = nowSec();
      std::shared_ptr<torch::nn::Module> sharded = w.build();  // the strategy initialises its shards
      tessera::distributed::CommOptions commOptions;
      commOptions.singleRankShortcut = shortcut;
      auto comm = tessera::distributed::makeCommunicator(
          gCuda ? "nccl" : "gloo", tessera::distributed::Store::createInProcess(), 0, 1, commOptions);
      tessera::sharding::StrategyOptions options;
      options.strategy = tessera::sharding::StrategyKind::kZero3;
      options.paramDtype = compute;
      options.reduceDtype = reduceDtype == "bf16" ? at::kBFloat16 : at::kFloat;
      options.optimizer.weightDecay = 0.1;
      options.wrap = {w.unitPattern};
      options.initializer = tessera::models::layers::initializerOf(*sharded, 0);
      options.fullyShard.keepLastUnit = keepLastUnit;
      options.fullyShard.cpuOffload = cpuOffload;
      auto strategy = tessera::sharding::makeStrategy(*sharded, comm, options);
      const Step step{[&] {
                        strategy->zeroGrad();
                        w.loss(*sharded, true).backward();
                      },
                      [&] { strategy->step(1e-4); }};
      std::printf("  (set up in %.1f s)\n", nowSec() - setUpStart);
      const Measure m = measure(warmup, steps, step);
      if (!tracePath.empty()) writeTrace(tracePath, 2, step);
      return m;
    };
    // plain: a compute-dtype model, fp32 masters, fused AdamW (torch::optim::AdamW where
    // there is no fused kernel).
    auto runPlain = [&](const std::string& tracePath) {
      const double setUpStart = nowSec();
      std::shared_ptr<torch::nn::Module> plain = w.build();
      tessera::models::initializeModel(*plain, 0);  // the values the strategy's shards start from
      std::vector<at::Tensor> masters, grads, expAvg, expAvgSq;
      for (auto& p : plain->parameters()) {
        masters.push_back(p.detach().clone().set_requires_grad(true));
        expAvg.push_back(at::zeros_like(masters.back()));
        expAvgSq.push_back(at::zeros_like(masters.back()));
      }
      grads.resize(masters.size());
      if (compute != at::kFloat) plain->to(compute);
      torch::optim::AdamW optimizer(masters, torch::optim::AdamWOptions(1e-4).weight_decay(0.1));
      const std::vector<at::Tensor> plainParams = plain->parameters();
      int64_t updates = 0;
      const Step step{[&] {
                        for (auto& m : masters) m.mutable_grad() = at::Tensor();
                        for (const auto& p : plainParams) p.mutable_grad() = at::Tensor();
                        w.loss(*plain, false).backward();
                      },
                      [&] {
                        c10::NoGradGuard noGrad;
                        // The gradients cast to fp32, as Tessera's reduction hands them to its optimizer.
                        for (size_t i = 0; i < masters.size(); ++i) {
                          const at::Tensor& g = plainParams[i].grad();
                          grads[i] = g.defined() ? g.to(at::kFloat) : at::zeros_like(masters[i]);
                        }
                        if (!fusedAdamWStep(masters, grads, expAvg, expAvgSq, ++updates, 1e-4, 0.1)) {
                          for (size_t i = 0; i < masters.size(); ++i) masters[i].mutable_grad() = grads[i];
                          optimizer.step();
                        }
                        for (size_t i = 0; i < masters.size(); ++i) plainParams[i].copy_(masters[i]);
                      }};
      std::printf("  (set up in %.1f s; the plain loop's AdamW: %s)\n", nowSec() - setUpStart,
                  fusedAdamWStep(masters, grads, expAvg, expAvgSq, 0, 0, 0, /*probe=*/true)
                      ? "fused, at::_fused_adamw_"
                      : "torch::optim::AdamW");
      const Measure m = measure(warmup, steps, step);
      if (!tracePath.empty()) writeTrace(tracePath, 2, step);
      return m;
    };

    const bool measuredPeak = peakTflops <= 0;
    if (measuredPeak) peakTflops = probePeakTflops(dev, gCuda ? 8192 : 1024);
    std::printf("%s: %lld parameters, %s compute, fp32 masters, gradients reduced in %s, on %s; %s\n",
                w.describe.c_str(), static_cast<long long>(params), dtype.c_str(), reduceDtype.c_str(),
                gCuda ? "cuda" : "cpu",
                gCuda ? (shortcut ? "zero3's world of one answered locally" : "zero3's collectives through NCCL")
                      : "zero3 over gloo");
    std::printf("model FLOPs per step %.4g (forward + backward); peak %.1f TFLOP/s (%s)\n", w.flopsPerStep, peakTflops,
                measuredPeak ? (gCuda ? "measured: bf16 8192^3 matrix product" : "measured: fp32 1024^3 matrix product")
                             : "given by --peak-tflops");
    // The variants, interleaved: plain, tessera, [more tessera variants], then again
    // (each variant's best median kept). The traces are of round 1 (of round 0 with --rounds 1).
    struct Variant {
      std::string name;
      std::function<Measure(const std::string& tracePath)> run;
      std::string traceSuffix;  // "": the trace path itself
      std::vector<Measure> runs;
    };
    std::vector<Variant> variants;
    variants.push_back({"plain LibTorch", runPlain, "_plain", {}});
    variants.push_back({"tessera zero3", [&](const std::string& t) { return runTessera(t, true, false); }, "", {}});
    if (reshardLast) {
      variants.push_back(
          {"tessera zero3, last unit resharded", [&](const std::string& t) { return runTessera(t, false, false); }, "_reshard_last", {}});
    }
    if (offload) {
      variants.push_back(
          {"tessera zero3, CPU offload", [&](const std::string& t) { return runTessera(t, true, true); }, "_offload", {}});
    }
    if (offloadOnly && offload) variants.erase(variants.begin(), variants.end() - 1);
    if (!only.empty()) {
      const std::string name = only == "plain"          ? "plain LibTorch"
                               : only == "tessera"      ? "tessera zero3"
                               : only == "reshard-last" ? "tessera zero3, last unit resharded"
                                                        : "tessera zero3, CPU offload";
      if (only == "reshard-last" && !reshardLast) {
        variants.push_back({name, [&](const std::string& t) { return runTessera(t, false, false); }, "_reshard_last", {}});
      }
      if (only == "offload" && !offload) {
        variants.push_back({name, [&](const std::string& t) { return runTessera(t, true, true); }, "_offload", {}});
      }
      variants.erase(std::remove_if(variants.begin(), variants.end(), [&](const Variant& v) { return v.name != name; }),
                     variants.end());
    }
    const bool hasPlain = variants.front().name == "plain LibTorch" && !noPlain;
    if (noPlain && variants.front().name == "plain LibTorch") variants.erase(variants.begin());
    if (variants.empty()) {
      throw tessera::UsageError("--only " + only + " with --no-plain leaves nothing to run");
    }
    auto tracePathOf = [&](const Variant& v) {
      if (trace.empty() || v.traceSuffix.empty()) return trace;
      const size_t dot = trace.rfind('.');
      return dot == std::string::npos ? trace + v.traceSuffix : trace.substr(0, dot) + v.traceSuffix + trace.substr(dot);
    };
    for (int round = 0; round < rounds; ++round) {
      for (Variant& v : variants) {
        v.runs.push_back(v.run(round == std::min(1, rounds - 1) ? tracePathOf(v) : std::string()));
        const Measure& m = v.runs.back();
        std::printf("round %d: %s %.2f ms (peak %.2f GiB); phases synchronised: forward+backward %.2f ms, update %.2f ms\n",
                    round, v.name.c_str(), m.medianMs, m.peakGiB, m.forwardBackwardMs, m.updateMs);
      }
    }
    auto best = [](const std::vector<Measure>& runs) {
      return *std::min_element(runs.begin(), runs.end(),
                               [](const Measure& a, const Measure& b) { return a.medianMs < b.medianMs; });
    };
    std::printf("\n");
    const Measure p = best(variants.front().runs);
    for (const Variant& v : variants) {
      const Measure m = best(v.runs);
      const double tflops = w.flopsPerStep / (m.medianMs * 1e-3) / 1e12;
      std::printf("step: %s %.2f ms (%.0f %s/s, %.1f TFLOP/s, MFU %.1f%%, peak %.2f GiB = %.1f MiB)\n", v.name.c_str(),
                  m.medianMs, w.itemsPerStep / m.medianMs * 1e3, w.itemName, tflops, 100.0 * tflops / peakTflops, m.peakGiB,
                  m.peakGiB * 1024.0);
    }
    for (size_t i = 1; hasPlain && i < variants.size(); ++i) {
      const Measure m = best(variants[i].runs);
      std::printf("%s / plain = %.3fx time, %.3fx peak memory\n", variants[i].name.c_str(), m.medianMs / p.medianMs,
                  p.peakGiB > 0 ? m.peakGiB / p.peakGiB : 0.0);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_step_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
