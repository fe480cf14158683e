// The train loop (see trainer.h).
#include "trainer/trainer.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

#include "common/errors.h"
#include "common/logging.h"
#include "distributed/communicator.h"
#include "trainer/metrics.h"
#include "trainer/models.h"
#include "trainer/text_dataset.h"

namespace tessera::trainer {
namespace fs = std::filesystem;

struct Trainer::State {
  TrainConfig config;
  std::string resolvedYaml;
  std::shared_ptr<distributed::Communicator> comm;
};

namespace {

double nowSec() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const OptimOptions& o, std::vector<at::Tensor> params) {
  if (o.name == "adamw") {
    return std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(o.lr).betas({o.betas[0], o.betas[1]}).eps(o.eps).weight_decay(o.weight_decay));
  }
  if (o.name == "adam") {
    return std::make_unique<torch::optim::Adam>(
        params, torch::optim::AdamOptions(o.lr).betas({o.betas[0], o.betas[1]}).eps(o.eps).weight_decay(o.weight_decay));
  }
  if (o.name == "sgd") {
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
  }
  throw ConfigError(strCat("optim.name: unknown optimizer '", o.name, "'"));
}

// Averages every gradient over the ranks with one flat all-reduce.
void allReduceGradients(distributed::Communicator& comm, const std::vector<at::Tensor>& params) {
  if (comm.worldSize() == 1) return;
  std::vector<at::Tensor> grads;
  for (const auto& p : params) grads.push_back(p.grad().defined() ? p.grad() : at::zeros_like(p));
  at::Tensor flat = at::cat(grads.empty() ? std::vector<at::Tensor>{} : [&] {
    std::vector<at::Tensor> views;
    for (const auto& g : grads) views.push_back(g.reshape({-1}));
    return views;
  }());
  comm.allReduce(flat, distributed::ReduceOp::kAvg);
  int64_t offset = 0;
  for (const auto& p : params) {
    const int64_t n = p.numel();
    at::Tensor slice = flat.narrow(0, offset, n).view(p.sizes());
    if (p.grad().defined()) {
      p.mutable_grad().copy_(slice);
    } else {
      p.mutable_grad() = slice.clone();
    }
    offset += n;
  }
}

double globalGradNorm(const std::vector<at::Tensor>& params) {
  double sq = 0;
  for (const auto& p : params) {
    if (p.grad().defined()) sq += p.grad().pow(2).sum().item<double>();
  }
  return std::sqrt(sq);
}

}  // namespace

Trainer::Trainer(TrainConfig config, std::string resolvedYaml, std::shared_ptr<distributed::Communicator> comm)
    : state_(std::make_unique<State>()) {
  TESSERA_CHECK(comm != nullptr, "Trainer: no communicator");
  state_->config = std::move(config);
  state_->resolvedYaml = std::move(resolvedYaml);
  state_->comm = std::move(comm);
}

Trainer::~Trainer() = default;

TrainSummary Trainer::run() {
  const TrainConfig& cfg = state_->config;
  distributed::Communicator& comm = *state_->comm;
  const int rank = comm.rank();
  const int world = comm.worldSize();
  const fs::path runDir(cfg.run.dir);
  fs::create_directories(runDir / "logs");
  if (rank == 0) {
    std::ofstream(runDir / "config.resolved.yaml") << state_->resolvedYaml;
  }

  // Identical seeded initialisation on every rank, then a broadcast from rank 0 so that
  // replicas agree even if an initialiser were ever nondeterministic.
  torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
  ContextMlp model(cfg.model);
  std::vector<at::Tensor> params = model->parameters();
  {
    torch::NoGradGuard noGrad;
    for (auto& p : params) comm.broadcast(p, 0);
  }
  int64_t numParams = 0;
  for (const auto& p : params) numParams += p.numel();
  TLOG_INFO0("model " << cfg.model.arch << ": " << numParams << " parameters; world size " << world);

  TextDataset data(cfg.data.path, cfg.model.context, cfg.data.eval_fraction);
  DistributedSampler sampler(data.trainSamples(), cfg.data.global_batch, cfg.run.seed, cfg.data.shuffle);
  const int64_t perRank = cfg.data.global_batch / world;
  const int64_t accumulation = perRank / cfg.data.micro_batch;
  TLOG_INFO0("data " << data.path() << ": " << data.trainSamples() << " train samples, " << sampler.stepsPerEpoch()
                     << " steps per epoch; " << accumulation << " micro-batches of " << cfg.data.micro_batch
                     << " per rank per step");

  auto optimizer = makeOptimizer(cfg.optim, params);
  std::unique_ptr<MetricsLog> metrics;
  if (rank == 0) metrics = std::make_unique<MetricsLog>((runDir / "metrics.jsonl").string(), cfg.run.steps);

  TrainSummary summary;
  summary.runDir = runDir.string();
  double windowLoss = 0, windowStart = nowSec(), runStart = nowSec();
  int64_t windowSteps = 0;
  bool firstWindow = true;
  comm.resetStats();

  for (int64_t step = 0; step < cfg.run.steps; ++step) {
    optimizer->zero_grad();
    const std::vector<int64_t> indices = sampler.indicesFor(step, rank, world);
    at::Tensor stepLoss = at::zeros({1}, at::kDouble);
    for (int64_t micro = 0; micro < accumulation; ++micro) {
      std::vector<int64_t> slice(indices.begin() + micro * cfg.data.micro_batch,
                                 indices.begin() + (micro + 1) * cfg.data.micro_batch);
      auto [inputs, targets] = data.trainBatch(slice);
      at::Tensor loss = torch::nn::functional::cross_entropy(model->forward(inputs), targets) /
                        static_cast<double>(accumulation);
      loss.backward();
      stepLoss += loss.detach().to(at::kDouble);
    }
    allReduceGradients(comm, params);
    const double gradNorm = globalGradNorm(params);
    optimizer->step();
    comm.allReduce(stepLoss, distributed::ReduceOp::kAvg);
    windowLoss += stepLoss.item<double>();
    ++windowSteps;

    const bool last = step + 1 == cfg.run.steps;
    if ((step + 1) % cfg.run.log_every == 0 || last) {
      const double elapsed = nowSec() - windowStart;
      at::Tensor rss = at::full({1}, peakRssMiB(), at::kDouble);
      comm.allReduce(rss, distributed::ReduceOp::kMax);
      StepMetrics m;
      m.step = step + 1;
      m.loss = windowLoss / static_cast<double>(windowSteps);
      m.lr = cfg.optim.lr;
      m.gradNorm = gradNorm;
      m.samplesPerSec = static_cast<double>(cfg.data.global_batch * windowSteps) / elapsed;
      m.stepTimeMs = elapsed * 1000.0 / static_cast<double>(windowSteps);
      m.peakRssMiB = rss.item<double>();
      m.commMiB = static_cast<double>(comm.stats().totalBytes()) / (1024.0 * 1024.0);
      if (metrics) metrics->record(m);
      if (firstWindow) summary.firstLoss = m.loss;
      firstWindow = false;
      summary.finalLoss = m.loss;
      windowLoss = 0;
      windowSteps = 0;
      windowStart = nowSec();
      comm.resetStats();
    }
  }
  summary.steps = cfg.run.steps;
  summary.samplesPerSec = static_cast<double>(cfg.data.global_batch * cfg.run.steps) / (nowSec() - runStart);

  // Held-out loss, computed on every rank over its share of the eval samples.
  summary.evalLoss = std::numeric_limits<double>::quiet_NaN();
  if (data.evalSamples() > 0) {
    torch::NoGradGuard noGrad;
    const int64_t n = std::min<int64_t>(data.evalSamples(), 4096);
    const int64_t begin = n * rank / world, end = n * (rank + 1) / world;
    at::Tensor sums = at::zeros({2}, at::kDouble);  // [loss sum, count]
    if (end > begin) {
      auto [inputs, targets] = data.evalBatch(begin, end - begin);
      at::Tensor loss = torch::nn::functional::cross_entropy(
          model->forward(inputs), targets, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
      sums[0] = loss.item<double>();
      sums[1] = static_cast<double>(end - begin);
    }
    comm.allReduce(sums, distributed::ReduceOp::kSum);
    summary.evalLoss = sums[0].item<double>() / sums[1].item<double>();
  }

  if (rank == 0) {
    summary.metricsPath = (runDir / "metrics.jsonl").string();
    summary.lossCurvePath = (runDir / "loss.svg").string();
    metrics->writeLossCurve(summary.lossCurvePath);
  }
  comm.barrier();
  return summary;
}

}  // namespace tessera::trainer
