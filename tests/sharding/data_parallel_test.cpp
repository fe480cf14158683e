// no_shard / zero1 / zero2 against single-process torch::optim: every strategy, world
// sizes 1-4 (ranks as threads), AdamW and SGD, weight decay, clipping, several buckets,
// gradient accumulation; 20 steps on the same global batch must give the same
// parameters, gathered masters and gathered optimizer states (1e-5 relative), and the
// same gradient norms. Plus: bitwise-identical reruns, identical ranks, non-finite
// gradients skipping the step, bf16 compute with fp32 masters, buffer sync, the
// initial broadcast, and option errors.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>

#include "common/errors.h"
#include "sharding/data_parallel.h"
#include "sharding/fully_shard.h"
#include "sharding/strategy.h"
#include "tests/sharding/test_models.h"
#include "tests/support/multi_rank.h"

namespace tessera::sharding {
namespace {

using test::RankContext;
using test::runOnRanks;
using namespace tessera::sharding::testing;

constexpr int kSteps = 20;
constexpr int64_t kGlobalBatch = 24;  // divisible by 1-4 ranks and by 2 micro-batches
constexpr double kTolerance = 1e-5;
constexpr int64_t kMiB = 1024 * 1024;

// An optimizer and the learning rate it steps with.
struct LrOptimizer {
  optim::OptimizerOptions options;
  double lr = 0;
};

struct TrainConfig {
  const char* name;
  LrOptimizer optimizer;
  double clip = 0.0;
  int64_t bucketBytes = 25 * kMiB;
  int microBatches = 1;  // backward passes accumulated per step
};

LrOptimizer adamw(double lr, double wd) {
  optim::OptimizerOptions o;
  o.kind = optim::OptimizerKind::kAdamW;
  o.weightDecay = wd;
  return {o, lr};
}

LrOptimizer sgd(double lr, double wd, double momentum, bool nesterov) {
  optim::OptimizerOptions o;
  o.kind = optim::OptimizerKind::kSgd;
  o.weightDecay = wd;
  o.momentum = momentum;
  o.nesterov = nesterov;
  return {o, lr};
}

// Clip thresholds sit below most of the steps' gradient norms, so clipping is active
// (the reference asserts it).
const std::vector<TrainConfig> kConfigs = {
    {"adamw_wd", adamw(1e-2, 0.1)},
    {"adamw_clip_buckets", adamw(2e-2, 0.0), /*clip=*/0.3, /*bucketBytes=*/64},
    {"sgd_wd_clip", sgd(0.05, 0.01, 0.9, false), /*clip=*/0.3},
    {"sgd_nesterov_accum_buckets", sgd(0.05, 0.0, 0.8, true), 0.0, /*bucketBytes=*/100, /*microBatches=*/2},
};

const Batches& data() {
  static const Batches batches = makeBatches(kSteps, kGlobalBatch, 5, 1, 7);
  return batches;
}

const std::map<std::string, at::Tensor>& initialParams() {
  static const std::map<std::string, at::Tensor> init = [] {
    seedCpu(3);
    TinyMlp model;
    return paramValues(*model);
  }();
  return init;
}

std::vector<std::string> stateKeys(const optim::OptimizerOptions& o) {
  if (o.kind == optim::OptimizerKind::kSgd) return o.momentum > 0 ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
  return {"exp_avg", "exp_avg_sq"};
}

// What one run leaves behind, per rank (full tensors by parameter name).
struct RankOutput {
  std::map<std::string, at::Tensor> params, masters;
  std::map<std::string, std::map<std::string, at::Tensor>> states;
  std::vector<double> norms;
};

struct Reference {
  std::map<std::string, at::Tensor> params;
  std::map<std::string, std::map<std::string, at::Tensor>> states;
  std::vector<double> norms;
};

// Single process, full global batch (mean loss), torch::optim, clip_grad_norm_.
const Reference& reference(size_t config) {
  static std::map<size_t, Reference> cache;
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(config);
  if (it != cache.end()) return it->second;
  const TrainConfig& c = kConfigs[config];
  TinyMlp model;
  loadParamValues(*model, initialParams());
  auto opt = referenceOptimizer(c.optimizer.options, c.optimizer.lr, *model);
  Reference ref;
  int clipped = 0;
  for (int t = 0; t < kSteps; ++t) {
    opt->zero_grad();
    torch::mse_loss(model->forward(data().x[t]), data().y[t]).backward();
    double sq = 0;
    for (const auto& p : model->parameters()) sq += p.grad().to(at::kDouble).square().sum().item<double>();
    ref.norms.push_back(std::sqrt(sq));
    if (c.clip > 0) {
      torch::nn::utils::clip_grad_norm_(model->parameters(), c.clip);
      clipped += ref.norms.back() > c.clip ? 1 : 0;
    }
    opt->step();
  }
  if (c.clip > 0) {
    EXPECT_GT(clipped, kSteps / 2) << c.name << ": clipping should be active in most steps";
  }
  ref.params = paramValues(*model);
  for (const auto& item : model->named_parameters()) {
    for (const auto& key : stateKeys(c.optimizer.options)) {
      ref.states[item.key()][key] = referenceState(*opt, item.value(), key).clone();
    }
  }
  return cache.emplace(config, std::move(ref)).first->second;
}

// `strategy`: a strategy's name, or "zero2_groups2": zero2 sharding its state inside
// groups of 2 ranks (StrategyOptions::stateGroupSize, fault.survive's layout).
StrategyOptions strategyOptions(const std::string& strategy, const TrainConfig& c) {
  StrategyOptions o;
  const size_t groups = strategy.find("_groups");
  o.strategy = sharding::parseStrategyKind(strategy.substr(0, groups));
  if (groups != std::string::npos) o.stateGroupSize = std::stoi(strategy.substr(groups + 7));
  o.optimizer = c.optimizer.options;
  o.gradClip = c.clip;
  o.bucketBytes = c.bucketBytes;
  return o;
}

// Trains on every rank of `world` and returns each rank's final state. Rank 0 starts
// from initialParams(); the others from their own random init (the strategy's initial
// broadcast must make them equal).
std::vector<RankOutput> train(const std::string& strategy, size_t config, int world) {
  const TrainConfig& c = kConfigs[config];
  // Built here, on one thread: the rank threads below draw from the global generator.
  (void)data();
  (void)initialParams();
  std::vector<RankOutput> outputs(static_cast<size_t>(world));
  runOnRanks(world, [&](RankContext& ctx) {
    TinyMlp model;
    if (ctx.rank == 0) loadParamValues(*model, initialParams());
    auto engine = makeStrategy(*model, ctx.comm(), strategyOptions(strategy, c));
    RankOutput& out = outputs[static_cast<size_t>(ctx.rank)];
    for (int t = 0; t < kSteps; ++t) {
      engine->zeroGrad();
      const at::Tensor x = rankSlice(data().x[t], ctx.rank, world);
      const at::Tensor y = rankSlice(data().y[t], ctx.rank, world);
      const int64_t micro = x.size(0) / c.microBatches;
      for (int m = 0; m < c.microBatches; ++m) {
        auto loss = torch::mse_loss(model->forward(x.narrow(0, m * micro, micro)), y.narrow(0, m * micro, micro));
        (loss / c.microBatches).backward();
      }
      const StepResult r = engine->step(c.optimizer.lr);
      EXPECT_FALSE(r.skipped);
      out.norms.push_back(r.gradNorm);
      // zero2 frees the full gradients; no_shard and zero1 keep them.
      for (const dtensor::ShardedParam& p : engine->params()) {
        EXPECT_EQ(p.moduleParam.grad().defined(), strategy.rfind("zero2", 0) != 0) << p.name;
      }
    }
    for (const dtensor::ShardedParam& p : engine->params()) {
      const dtensor::ShardSpec& spec = p.spec;
      EXPECT_EQ(spec.placement(), strategy == "no_shard" ? dtensor::Placement::kReplicate : dtensor::Placement::kShard0);
      EXPECT_EQ(spec.worldSize(), engine->stateComm().worldSize()) << p.name;
      EXPECT_EQ(engine->optimizer().stepCount(p), kSteps);
      out.params[p.name] = p.moduleParam.detach().clone();
      out.masters[p.name] = gatherFull(spec, p.master, engine->stateComm());
      for (const auto& key : stateKeys(c.optimizer.options)) {
        out.states[p.name][key] = gatherFull(spec, engine->optimizer().state(p, key), engine->stateComm());
      }
    }
  });
  return outputs;
}

using ParityParam = std::tuple<std::string, int, size_t>;  // strategy, world, config

class StrategyParityTest : public ::testing::TestWithParam<ParityParam> {};

TEST_P(StrategyParityTest, MatchesSingleProcessTorchOptim) {
  useOneThread();
  const auto& [strategy, world, config] = GetParam();
  const Reference& ref = reference(config);
  const auto outputs = train(strategy, config, world);
  double worst = 0;
  for (int r = 0; r < world; ++r) {
    const RankOutput& out = outputs[static_cast<size_t>(r)];
    ASSERT_EQ(out.params.size(), ref.params.size());
    for (const auto& [name, want] : ref.params) {
      // Every rank holds bitwise the same parameters.
      EXPECT_TRUE(out.params.at(name).equal(outputs[0].params.at(name))) << "rank " << r << " " << name;
      const double e = relativeError(out.params.at(name), want);
      worst = std::max(worst, e);
      EXPECT_LE(e, kTolerance) << "rank " << r << " param " << name;
      EXPECT_LE(relativeError(out.masters.at(name), want), kTolerance) << "rank " << r << " master " << name;
      for (const auto& [key, state] : ref.states.at(name)) {
        const double se = relativeError(out.states.at(name).at(key), state);
        worst = std::max(worst, se);
        EXPECT_LE(se, kTolerance) << "rank " << r << " " << key << " of " << name;
      }
    }
    for (int t = 0; t < kSteps; ++t) {
      EXPECT_NEAR(out.norms[static_cast<size_t>(t)], ref.norms[static_cast<size_t>(t)],
                  kTolerance * ref.norms[static_cast<size_t>(t)])
          << "rank " << r << " step " << t;
    }
  }
  RecordProperty("worst_relative_error", std::to_string(worst));
}

std::vector<ParityParam> dataParallelCases() {
  std::vector<ParityParam> cases;
  for (const char* s : {"no_shard", "zero1", "zero2"}) {
    for (int world : {1, 2, 3, 4}) {
      for (size_t c = 0; c < kConfigs.size(); ++c) cases.emplace_back(s, world, c);
    }
  }
  // State sharded inside groups: 2 groups of 2, 3 groups of 1 (every rank holds everything).
  for (const char* s : {"zero1_groups2", "zero2_groups2", "zero2_groups1"}) {
    const int world = std::string(s).back() == '2' ? 4 : 3;
    for (size_t c = 0; c < kConfigs.size(); ++c) cases.emplace_back(s, world, c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllStrategies, StrategyParityTest, ::testing::ValuesIn(dataParallelCases()),
                         [](const ::testing::TestParamInfo<ParityParam>& info) {
                           return std::get<0>(info.param) + "_world" + std::to_string(std::get<1>(info.param)) + "_" +
                                  kConfigs[std::get<2>(info.param)].name;
                         });

TEST(StrategyDeterminismTest, RerunsAreBitwiseIdentical) {
  useOneThread();
  for (const char* strategy : {"no_shard", "zero1", "zero2"}) {
    const auto first = train(strategy, 1, 3);
    const auto second = train(strategy, 1, 3);
    for (int r = 0; r < 3; ++r) {
      for (const auto& [name, p] : first[r].params) {
        EXPECT_TRUE(p.equal(second[r].params.at(name))) << strategy << " rank " << r << " " << name;
        EXPECT_TRUE(first[r].masters.at(name).equal(second[r].masters.at(name))) << strategy << " " << name;
        for (const auto& [key, s] : first[r].states.at(name)) {
          EXPECT_TRUE(s.equal(second[r].states.at(name).at(key))) << strategy << " " << key << " " << name;
        }
      }
      EXPECT_EQ(first[r].norms, second[r].norms) << strategy;
    }
  }
}

// The same run with ranks as forked processes over TCP (what tessera-run does), checked
// inside each rank against the reference and against rank 0 (broadcast).
TEST(StrategyProcessTest, ForkedRanksMatchReference) {
  useOneThread();
  const size_t config = 1;
  // The reference is computed inside each rank: LibTorch 2.x (CUDA builds) refuses
  // autograd in a child forked after the parent ran autograd.
  (void)data();
  (void)initialParams();
  for (const char* strategy : {"no_shard", "zero2"}) {
    test::HarnessOptions options;
    options.mode = test::HarnessMode::kProcesses;
    runOnRanks(3, [&](RankContext& ctx) {
      const Reference& ref = reference(config);
      TinyMlp model;
      if (ctx.rank == 0) loadParamValues(*model, initialParams());
      auto engine = makeStrategy(*model, ctx.comm(), strategyOptions(strategy, kConfigs[config]));
      for (int t = 0; t < kSteps; ++t) {
        engine->zeroGrad();
        torch::mse_loss(model->forward(rankSlice(data().x[t], ctx.rank, 3)), rankSlice(data().y[t], ctx.rank, 3))
            .backward();
        const StepResult r = engine->step(kConfigs[config].optimizer.lr);
        EXPECT_NEAR(r.gradNorm, ref.norms[static_cast<size_t>(t)], kTolerance * ref.norms[static_cast<size_t>(t)]);
      }
      for (const auto& [name, want] : ref.params) {
        const dtensor::ShardedParam& p = engine->param(name);
        const at::Tensor mine = p.moduleParam.detach().clone();
        EXPECT_LE(relativeError(mine, want), kTolerance) << name;
        at::Tensor rank0 = mine.clone();
        ctx.comm()->broadcast(rank0, 0);
        EXPECT_TRUE(rank0.equal(mine)) << "rank " << ctx.rank << " differs from rank 0: " << name;
        const at::Tensor sq = gatherFull(p.spec, engine->optimizer().state(p, "exp_avg_sq"), *ctx.comm());
        EXPECT_LE(relativeError(sq, ref.states.at(name).at("exp_avg_sq")), kTolerance) << name;
      }
    }, options);
  }
}

// Without zeroGrad() between steps gradients accumulate across steps, as in torch
// (zero2 adds into the gradient shards it kept, since its full gradients are freed).
TEST(StrategyAccumulationTest, GradientsAccumulateAcrossStepsWithoutZeroGrad) {
  useOneThread();
  (void)data();
  (void)initialParams();
  const LrOptimizer o = sgd(0.05, 0.0, 0.9, false);
  TinyMlp refModel;
  loadParamValues(*refModel, initialParams());
  auto refOpt = referenceOptimizer(o.options, o.lr, *refModel);
  for (int t = 0; t < 3; ++t) {
    torch::mse_loss(refModel->forward(data().x[t]), data().y[t]).backward();  // no zero_grad
    refOpt->step();
  }
  const auto want = paramValues(*refModel);
  for (const char* strategy : {"no_shard", "zero1", "zero2"}) {
    runOnRanks(2, [&](RankContext& ctx) {
      TinyMlp model;
      if (ctx.rank == 0) loadParamValues(*model, initialParams());
      StrategyOptions so;
      so.strategy = sharding::parseStrategyKind(strategy);
      so.optimizer = o.options;
      auto engine = makeStrategy(*model, ctx.comm(), so);
      for (int t = 0; t < 3; ++t) {
        torch::mse_loss(model->forward(rankSlice(data().x[t], ctx.rank, 2)), rankSlice(data().y[t], ctx.rank, 2))
            .backward();
        engine->step(o.lr);
      }
      for (const auto& [name, p] : paramValues(*model)) {
        EXPECT_LE(relativeError(p, want.at(name)), kTolerance) << strategy << " " << name;
      }
    });
  }
}

// A NaN or inf gradient on one rank: every rank skips, nothing changes, training goes on.
TEST(StrategyNonFiniteTest, StepIsSkippedAndReported) {
  useOneThread();
  (void)data();
  for (const char* strategy : {"no_shard", "zero1", "zero2"}) {
    for (double bad : std::vector<double>{std::nan(""), INFINITY}) {
      runOnRanks(2, [&](RankContext& ctx) {
        TinyMlp model;
        StrategyOptions o = strategyOptions(strategy, kConfigs[0]);
        o.gradClip = 1.0;
        auto engine = makeStrategy(*model, ctx.comm(), o);
        auto stepOnce = [&](bool poison) {
          engine->zeroGrad();
          at::Tensor x = rankSlice(data().x[0], ctx.rank, 2).clone();
          // Rank 1's data makes its gradients non-finite (backward reduces them as it goes).
          if (poison && ctx.rank == 1) x[0][3] = bad;
          torch::mse_loss(model->forward(x), rankSlice(data().y[0], ctx.rank, 2)).backward();
          return engine->step(0.01);
        };
        ASSERT_FALSE(stepOnce(false).skipped);
        const auto before = paramValues(*model);
        std::map<std::string, at::Tensor> masters, states;
        for (const dtensor::ShardedParam& p : engine->params()) {
          masters[p.name] = p.master.clone();
          states[p.name] = engine->optimizer().state(p, "exp_avg").clone();
        }
        const StepResult skipped = stepOnce(true);
        EXPECT_TRUE(skipped.skipped);
        EXPECT_FALSE(std::isfinite(skipped.gradNorm));
        EXPECT_EQ(engine->stepsSkipped(), 1);
        EXPECT_EQ(engine->stepsApplied(), 1);
        for (const auto& [name, p] : paramValues(*model)) {
          EXPECT_TRUE(p.equal(before.at(name))) << name;
          EXPECT_FALSE(model->named_parameters()[name].grad().defined()) << "gradients dropped: " << name;
        }
        for (const dtensor::ShardedParam& p : engine->params()) {
          EXPECT_TRUE(p.master.equal(masters[p.name])) << p.name;
          EXPECT_TRUE(engine->optimizer().state(p, "exp_avg").equal(states[p.name])) << p.name;
          EXPECT_EQ(engine->optimizer().stepCount(p), 1) << p.name;
        }
        const StepResult next = stepOnce(false);
        EXPECT_FALSE(next.skipped);
        EXPECT_TRUE(std::isfinite(next.gradNorm));
        EXPECT_FALSE(paramValues(*model).at("fc1.weight").equal(before.at("fc1.weight")));
      });
    }
  }
}

// step(lr, sumAlongside): the caller's values come back summed over all ranks, in the
// gradient norm's all-reduce where there is one (zero1/zero2/zero3: no collective more
// than a step without them), in one of their own otherwise (no_shard; hybrid, whose norm
// is over its shard group only).
TEST(StrategyStepTest, SumsTheCallersValuesAlongsideTheGradientNorm) {
  useOneThread();
  (void)data();
  for (const char* strategy : {"no_shard", "zero1", "zero2", "zero3", "hybrid"}) {
    const int world = std::string(strategy) == "hybrid" ? 4 : 3;
    runOnRanks(world, [&](RankContext& ctx) {
      TinyMlp model;
      StrategyOptions o = strategyOptions(strategy, kConfigs[0]);
      o.fullyShard.shardSize = std::string(strategy) == "hybrid" ? 2 : 0;
      auto engine = makeStrategy(*model, ctx.comm(), o);
      auto backward = [&] {
        engine->zeroGrad();
        const at::Tensor x = rankSlice(data().x[0], ctx.rank, world), y = rankSlice(data().y[0], ctx.rank, world);
        torch::mse_loss(sharding::unitForward(*model, x, [&](const at::Tensor& in) { return model->forward(in); }), y)
            .backward();
      };
      backward();
      ctx.comm()->resetStats();
      ASSERT_FALSE(engine->step(0.01).skipped);
      const int64_t callsWithout = ctx.comm()->stats().totalCalls();
      backward();
      ctx.comm()->resetStats();
      sharding::StepSums values;
      values.add("rank", static_cast<double>(ctx.rank));
      values.add("one", 1.0);
      values.add("quarter rank", 0.25 * ctx.rank);
      ASSERT_FALSE(engine->step(0.01, &values).skipped);
      const double ranks = world * (world - 1) / 2.0;
      EXPECT_EQ(values["rank"], ranks) << strategy;
      EXPECT_EQ(values["one"], world) << strategy;
      EXPECT_EQ(values["quarter rank"], 0.25 * ranks) << strategy;
      const bool ownCollective = std::string(strategy) == "no_shard" || std::string(strategy) == "hybrid";
      EXPECT_EQ(ctx.comm()->stats().totalCalls(), callsWithout + (ownCollective ? 1 : 0)) << strategy;
    });
  }
}

// no_shard and zero2 reduce during backward (DDP's overlap): when backward returns, every
// bucket's collective has run and zero2 holds no full gradient; with
// setRequiresGradientSync(false) (no_sync) backward communicates nothing and step()
// reduces the accumulated sum once. Both ways give the same parameters.
TEST(StrategyOverlapTest, BackwardReducesBucketsAndNoSyncDefersThem) {
  useOneThread();
  (void)data();
  (void)initialParams();
  for (const char* strategy : {"no_shard", "zero2"}) {
    const distributed::CommOp op =
        std::string(strategy) == "no_shard" ? distributed::CommOp::kAllReduce : distributed::CommOp::kReduceScatter;
    runOnRanks(2, [&](RankContext& ctx) {
      std::map<bool, std::map<std::string, at::Tensor>> result;
      for (bool noSync : {false, true}) {
        TinyMlp model;
        loadParamValues(*model, initialParams());
        StrategyOptions o = strategyOptions(strategy, kConfigs[0]);
        o.bucketBytes = 64;  // several buckets
        auto engine = makeStrategy(*model, ctx.comm(), o);
        const int64_t buckets = static_cast<int64_t>(dynamic_cast<DataParallelStrategy&>(*engine).bucketCount());
        ASSERT_GT(buckets, 1);
        engine->zeroGrad();
        ctx.comm()->resetStats();
        for (int mb = 0; mb < 2; ++mb) {
          engine->setRequiresGradientSync(!noSync || mb == 1);
          const at::Tensor x = rankSlice(rankSlice(data().x[0], ctx.rank, 2), mb, 2);
          const at::Tensor y = rankSlice(rankSlice(data().y[0], ctx.rank, 2), mb, 2);
          (torch::mse_loss(model->forward(x), y) / 2).backward();
          EXPECT_EQ(ctx.comm()->stats()[op].calls, noSync ? (mb == 0 ? 0 : buckets) : (mb + 1) * buckets)
              << strategy << " no_sync " << noSync << " after micro-batch " << mb;
          if (std::string(strategy) == "zero2" && !(noSync && mb == 0)) {
            for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined()) << "zero2 frees full gradients";
          }
        }
        ASSERT_FALSE(engine->step(kConfigs[0].optimizer.lr).skipped);
        EXPECT_EQ(ctx.comm()->stats()[op].calls, noSync ? buckets : 2 * buckets) << "step() had nothing left to reduce";
        result[noSync] = paramValues(*model);
      }
      for (const auto& [name, p] : result[false]) {
        EXPECT_LE(relativeError(result[true].at(name), p), 1e-6) << strategy << " " << name;
      }
    });
  }
}

// bf16 compute copies, fp32 masters, fp32 reduction: trains a linear regression and the
// module's parameters stay the bf16 rounding of the masters, identical on every rank.
TEST(StrategyMixedPrecisionTest, Bf16ComputeWithFp32MastersConverges) {
  useOneThread();
  seedCpu(11);
  const at::Tensor wTrue = torch::randn({8, 1});
  const at::Tensor x = torch::randn({64, 8});
  const at::Tensor y = x.matmul(wTrue);
  for (const char* strategy : {"no_shard", "zero1", "zero2"}) {
    runOnRanks(2, [&](RankContext& ctx) {
      torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::Linear(16, 1));
      StrategyOptions o;
      o.strategy = sharding::parseStrategyKind(strategy);
      o.paramDtype = at::kBFloat16;
      o.optimizer = adamw(3e-2, 0.0).options;
      auto engine = makeStrategy(*model, ctx.comm(), o);
      const at::Tensor xs = rankSlice(x, ctx.rank, 2).to(at::kBFloat16);
      const at::Tensor ys = rankSlice(y, ctx.rank, 2);
      double first = 0, last = 0;
      for (int t = 0; t < 150; ++t) {
        engine->zeroGrad();
        auto loss = torch::mse_loss(model->forward(xs).to(at::kFloat), ys);
        loss.backward();
        if (t == 0) first = loss.item<double>();
        last = loss.item<double>();
        ASSERT_FALSE(engine->step(3e-2).skipped);
      }
      EXPECT_LT(last, first * 0.05) << strategy << ": loss " << first << " -> " << last;
      for (const dtensor::ShardedParam& record : engine->params()) {
        const std::string& name = record.name;
        const at::Tensor& p = record.moduleParam;
        EXPECT_EQ(p.scalar_type(), at::kBFloat16) << name;
        EXPECT_EQ(record.master.scalar_type(), at::kFloat) << name;
        const at::Tensor full = gatherFull(record.spec, record.master, *ctx.comm());
        EXPECT_TRUE(p.detach().equal(full.to(at::kBFloat16))) << name;
        at::Tensor other = p.detach().clone();
        ctx.comm()->broadcast(other, 0);
        EXPECT_TRUE(other.equal(p.detach())) << "ranks differ: " << name;
      }
    });
  }
}

// Ranks built from different seeds start from rank 0's parameters and buffers.
TEST(StrategyInitTest, RankZeroStateIsBroadcast) {
  useOneThread();
  runOnRanks(3, [](RankContext& ctx) {
    torch::nn::Sequential model(torch::nn::Linear(4, 6), torch::nn::BatchNorm1d(6), torch::nn::Linear(6, 2));
    {
      torch::NoGradGuard noGrad;
      for (auto& p : model->parameters()) p.fill_(static_cast<float>(ctx.rank + 1));
      for (auto& b : model->buffers()) b.fill_(ctx.rank + 1);
    }
    StrategyOptions o;
    o.strategy = sharding::StrategyKind::kZero2;
    auto engine = makeStrategy(*model, ctx.comm(), o);
    for (const auto& p : model->parameters()) EXPECT_TRUE(p.detach().eq(1.0f).all().item<bool>());
    for (const auto& b : model->buffers()) EXPECT_TRUE(b.eq(1).all().item<bool>());
    for (const dtensor::ShardedParam& p : engine->params()) {
      EXPECT_TRUE(p.spec.realRows(p.master.reshape({-1})).eq(1.0f).all().item<bool>());
    }
  });
}

// BatchNorm running statistics: after each step every rank holds rank 0's (broadcast)
// or the ranks' average (average), not its own.
TEST(StrategyBufferTest, BuffersBroadcastOrAveraged) {
  useOneThread();
  for (const char* mode : {"broadcast", "average", "none"}) {
    runOnRanks(2, [&](RankContext& ctx) {
      torch::nn::Sequential model(torch::nn::Linear(4, 6), torch::nn::BatchNorm1d(6), torch::nn::Linear(6, 1));
      StrategyOptions o;
      o.strategy = sharding::StrategyKind::kZero1;
      o.bufferSync = parseEnum(kBufferSyncNames, mode, "buffer sync");
      auto engine = makeStrategy(*model, ctx.comm(), o);
      auto bn = model[1]->as<torch::nn::BatchNorm1d>();
      for (int t = 0; t < 3; ++t) {
        engine->zeroGrad();
        const at::Tensor x = rankSlice(torch::arange(48, at::kFloat).view({12, 4}) * (t + 1) / 10.0, ctx.rank, 2);
        model->forward(x).sum().backward();
        const at::Tensor mine = bn->running_mean.clone();
        at::Tensor rank0 = mine.clone(), average = mine.clone();
        ctx.comm()->broadcast(rank0, 0);
        ctx.comm()->allReduce(average, distributed::ReduceOp::kAvg);
        EXPECT_FALSE(rank0.equal(average)) << "ranks saw different data, so their statistics differ";
        engine->step(0.01);
        const std::string m = mode;
        const at::Tensor& want = m == "broadcast" ? rank0 : m == "average" ? average : mine;
        EXPECT_TRUE(at::allclose(bn->running_mean, want, 1e-6, 1e-7)) << mode << " step " << t;
        at::Tensor tracked = bn->num_batches_tracked.clone();
        ctx.comm()->broadcast(tracked, 0);
        EXPECT_TRUE(tracked.equal(bn->num_batches_tracked));
      }
    });
  }
}

TEST(StrategyOptionsTest, BadOptionsAreConfigErrors) {
  useOneThread();
  runOnRanks(1, [](RankContext& ctx) {
    TinyMlp model;
    auto make = [&](auto edit) {
      StrategyOptions o;
      edit(o);
      return makeStrategy(*model, ctx.comm(), o);
    };
    EXPECT_THROW(parseStrategyKind("zero4"), ConfigError);
    {
      // zero3 / hybrid: a wrap pattern that names no submodule, a shard size that does not
      // divide the world.
      TinyMlp other;
      StrategyOptions o;
      o.strategy = sharding::StrategyKind::kZero3;
      o.wrap = {"blocks.*"};
      EXPECT_THROW(makeStrategy(*other, ctx.comm(), o), ConfigError);
      TinyMlp third;
      o.strategy = sharding::StrategyKind::kHybrid;
      o.wrap = {};
      o.fullyShard.shardSize = 3;
      EXPECT_THROW(makeStrategy(*third, ctx.comm(), o), ConfigError);
    }
    EXPECT_THROW(make([](StrategyOptions& o) { o.paramDtype = at::kDouble; }), ConfigError);
    EXPECT_THROW(make([](StrategyOptions& o) { o.reduceDtype = at::kInt; }), ConfigError);
    EXPECT_THROW(make([](StrategyOptions& o) { o.bucketBytes = 0; }), ConfigError);
    EXPECT_THROW(make([](StrategyOptions& o) { o.gradClip = -1; }), ConfigError);
    EXPECT_THROW(parseEnum(kBufferSyncNames, "sometimes", "buffer sync"), ConfigError);
    EXPECT_THROW(make([](StrategyOptions& o) { o.optimizer.lrScale["*"] = 0.0; }), ConfigError);
    auto engine = make([](StrategyOptions&) {});
    EXPECT_THROW(engine->param("no.such.param"), Error);
    EXPECT_EQ(engine->kind(), StrategyKind::kNoShard);
    EXPECT_EQ(parseStrategyKind("zero2"), StrategyKind::kZero2);
    EXPECT_STREQ(strategyKindName(StrategyKind::kZero1), "zero1");
  });
}

}  // namespace
}  // namespace tessera::sharding
