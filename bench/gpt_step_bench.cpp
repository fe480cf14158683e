// GPT training-step benchmark (issue 9): one optimizer step of the built-in GPT-2-style
// decoder (trainer/models.h, nanoGPT names) with bf16 compute and fp32 master weights,
//   tessera: zero3 at world size 1 (FullyShardStrategy, the blocks as units, the sharded
//            AdamW over fp32 masters, gradients reduced in fp32);
//   plain:   the same model in a LibTorch loop without sharding: a bf16 copy of the
//            model runs forward/backward, its gradients are cast into fp32 masters,
//            torch::optim::AdamW steps them and the bf16 copy is refreshed;
// interleaved in the same run, each the median of --steps timed steps after --warmup,
// with peak device memory per step on CUDA. bench/fsdp2_gpt_step.py runs the equivalent
// PyTorch model under FSDP2's fully_shard with the same sizes, batch and dtypes.
// Usage: bench_gpt_step_bench [--device cpu|cuda] [--embed 1024] [--layers 24] [--heads 16]
//          [--context 1024] [--vocab 50304] [--batch 8] [--steps 10] [--warmup 3] [--dtype bf16|fp32]
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>
#ifdef TESSERA_TORCH_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "distributed/communicator.h"
#include "distributed/store.h"
#include "sharding/fully_shard.h"
#include "sharding/strategy.h"
#include "trainer/models.h"

namespace {

using tessera::trainer::Gpt;

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
};

// Median step time of `step` and the largest per-step peak of device memory.
template <typename Step>
Measure measure(int warmup, int steps, Step step) {
  for (int i = 0; i < warmup; ++i) step();
  sync();
  std::vector<double> times;
  int64_t peak = 0;
  for (int i = 0; i < steps; ++i) {
    resetPeak();
    const double start = nowSec();
    step();
    sync();
    times.push_back((nowSec() - start) * 1e3);
    peak = std::max(peak, peakBytes());
  }
  std::sort(times.begin(), times.end());
  return {times[times.size() / 2], static_cast<double>(peak) / (1 << 30)};
}

at::Tensor crossEntropy(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat), targets.reshape({-1}));
}

}  // namespace

int main(int argc, char** argv) {
  std::string device = "cpu", dtype = "bf16";
  tessera::trainer::ModelOptions model;
  model.arch = "gpt";
  model.embed_dim = 1024;
  model.layers = 24;
  model.heads = 16;
  model.context = 1024;
  model.vocab_size = 50304;
  int64_t batch = 8;
  int steps = 10, warmup = 3;
  CLI::App app{"GPT step: zero3 (world 1) vs a plain LibTorch loop, bf16 compute and fp32 masters"};
  app.add_option("--device", device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--embed", model.embed_dim, "Model width")->check(CLI::PositiveNumber);
  app.add_option("--layers", model.layers, "Decoder blocks")->check(CLI::PositiveNumber);
  app.add_option("--heads", model.heads, "Attention heads (divide --embed)")->check(CLI::PositiveNumber);
  app.add_option("--context", model.context, "Sequence length")->check(CLI::PositiveNumber);
  app.add_option("--vocab", model.vocab_size, "Vocabulary size")->check(CLI::Range(int64_t{2}, int64_t{1} << 24));
  app.add_option("--batch", batch, "Sequences per step")->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "Timed steps (median reported)")->check(CLI::Range(1, 10000));
  app.add_option("--warmup", warmup, "Untimed steps first")->check(CLI::Range(0, 10000));
  app.add_option("--dtype", dtype, "Compute dtype (masters are fp32)")->check(CLI::IsMember({"bf16", "fp32"}));
  CLI11_PARSE(app, argc, argv);

  try {
    gCuda = device == "cuda";
    if (gCuda && !torch::cuda::is_available()) {
      std::fprintf(stderr, "bench_gpt_step_bench: --device cuda, but no CUDA device is usable\n");
      return 1;
    }
    const at::Device dev = gCuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
    const at::ScalarType compute = dtype == "bf16" ? at::kBFloat16 : at::kFloat;
    const auto tokens = at::randint(model.vocab_size, {batch, model.context}, at::TensorOptions().dtype(at::kLong).device(dev));
    const auto targets = at::randint(model.vocab_size, {batch, model.context}, tokens.options());

    // tessera: zero3 at world size 1.
    auto sharded = std::make_shared<Gpt>(model, dev);  // deferred: the strategy initialises its shards
    int64_t params = 0;
    for (const auto& p : sharded->parameters()) params += p.numel();
    auto comm = tessera::distributed::makeCommunicator(gCuda ? "nccl" : "gloo",
                                                       tessera::distributed::Store::createInProcess(), 0, 1);
    tessera::sharding::StrategyOptions options;
    options.strategy = tessera::sharding::StrategyKind::kZero3;
    options.paramDtype = compute;
    options.reduceDtype = at::kFloat;
    options.optimizer.weightDecay = 0.1;
    options.wrap = {"h.*"};
    options.initializer = tessera::trainer::layers::initializerOf(*sharded, 0);
    auto strategy = tessera::sharding::makeStrategy(*sharded, comm, options);
    auto tesseraStep = [&] {
      strategy->zeroGrad();
      const at::Tensor loss = tessera::sharding::unitForward(
          *sharded, tokens, [&](const at::Tensor& in) { return crossEntropy(sharded->forward(in), targets); });
      loss.backward();
      strategy->step(1e-4);
    };

    // plain: a compute-dtype model, fp32 masters, torch::optim::AdamW.
    auto plain = std::make_shared<Gpt>(model, dev);
    tessera::trainer::initializeModel(*plain, 0);  // the values the strategy's shards start from
    std::vector<at::Tensor> masters;
    for (auto& p : plain->parameters()) masters.push_back(p.detach().clone().set_requires_grad(true));
    if (compute != at::kFloat) plain->to(compute);
    torch::optim::AdamW optimizer(masters, torch::optim::AdamWOptions(1e-4).weight_decay(0.1));
    const std::vector<at::Tensor> plainParams = plain->parameters();
    auto plainStep = [&] {
      optimizer.zero_grad();
      for (const auto& p : plainParams) p.mutable_grad() = at::Tensor();
      crossEntropy(plain->forward(tokens), targets).backward();
      for (size_t i = 0; i < masters.size(); ++i) masters[i].mutable_grad() = plainParams[i].grad().to(at::kFloat);
      optimizer.step();
      torch::NoGradGuard noGrad;
      for (size_t i = 0; i < masters.size(); ++i) plainParams[i].copy_(masters[i]);
    };

    std::printf("GPT %lld parameters (embed %lld, %lld layers, %lld heads, context %lld, vocab %lld), batch %lld, %s "
                "compute, fp32 masters, on %s\n",
                static_cast<long long>(params), static_cast<long long>(model.embed_dim),
                static_cast<long long>(model.layers), static_cast<long long>(model.heads),
                static_cast<long long>(model.context), static_cast<long long>(model.vocab_size),
                static_cast<long long>(batch), dtype.c_str(), gCuda ? "cuda" : "cpu");
    // Interleaved: plain, tessera, plain, tessera (each pair's median kept).
    std::vector<Measure> plainRuns, tesseraRuns;
    for (int round = 0; round < 2; ++round) {
      plainRuns.push_back(measure(warmup, steps, plainStep));
      tesseraRuns.push_back(measure(warmup, steps, tesseraStep));
      std::printf("round %d: plain %.2f ms (peak %.2f GiB), tessera zero3 %.2f ms (peak %.2f GiB)\n", round,
                  plainRuns.back().medianMs, plainRuns.back().peakGiB, tesseraRuns.back().medianMs,
                  tesseraRuns.back().peakGiB);
    }
    auto best = [](const std::vector<Measure>& runs) {
      return *std::min_element(runs.begin(), runs.end(),
                               [](const Measure& a, const Measure& b) { return a.medianMs < b.medianMs; });
    };
    const Measure p = best(plainRuns), t = best(tesseraRuns);
    const double tokensPerStep = static_cast<double>(batch * model.context);
    std::printf("\nstep: plain LibTorch %.2f ms (%.0f tokens/s, peak %.2f GiB); tessera zero3 %.2f ms (%.0f tokens/s, "
                "peak %.2f GiB); tessera / plain = %.3fx time\n",
                p.medianMs, tokensPerStep / p.medianMs * 1e3, p.peakGiB, t.medianMs, tokensPerStep / t.medianMs * 1e3,
                t.peakGiB, t.medianMs / p.medianMs);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpt_step_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
