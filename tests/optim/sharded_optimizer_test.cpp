// Sharded optimizers equal torch::optim on the full tensors: every rank of a simulated
// world steps on its ShardSpec slice, and the slices put together must match
// torch::optim's AdamW / Adam / SGD (momentum, Nesterov) after 20 steps, for world
// sizes 1-4 and shapes that do not divide evenly (including fewer rows than ranks).
#include <gtest/gtest.h>

#include <map>
#include <utility>

#include "common/errors.h"
#include "optim/sharded_optimizer.h"
#include "tests/sharding/test_models.h"

namespace tessera::optim {
namespace {

const std::vector<std::vector<int64_t>> kShapes = {{7, 5}, {3}, {2, 3, 2}, {1}, {}, {10}};

std::vector<at::Tensor> makeParams(uint64_t seed) {
  at::manual_seed(seed);
  std::vector<at::Tensor> out;
  for (const auto& s : kShapes) out.push_back(at::randn(s));
  return out;
}

std::vector<std::vector<at::Tensor>> makeGrads(int steps, uint64_t seed) {
  at::manual_seed(seed);
  std::vector<std::vector<at::Tensor>> out(steps);
  for (int t = 0; t < steps; ++t) {
    for (const auto& s : kShapes) out[t].push_back(at::randn(s));
  }
  return out;
}

// torch::optim AdamW over the parameter groups `o` makes of parameters p0, p1, ...: one
// group per (weight decay, learning-rate scale) the parameters have under `o`.
std::unique_ptr<torch::optim::Optimizer> referenceGroups(const OptimizerOptions& o, double lr,
                                                         const std::vector<at::Tensor>& params) {
  std::map<std::pair<bool, double>, std::vector<at::Tensor>> groups;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string name = "p" + std::to_string(i);
    groups[{decays(o, name, params[i].sizes().vec()), lrScaleOf(o, name)}].push_back(params[i]);
  }
  std::vector<torch::optim::OptimizerParamGroup> out;
  for (const auto& [key, members] : groups) {
    auto options = torch::optim::AdamWOptions(lr * key.second).betas({o.beta1, o.beta2}).eps(o.eps);
    options.weight_decay(key.first ? o.weightDecay : 0.0);
    out.emplace_back(members, std::make_unique<torch::optim::AdamWOptions>(options));
  }
  return std::make_unique<torch::optim::AdamW>(std::move(out));
}

void expectParity(const OptimizerOptions& o, double lr) {
  const int kSteps = 20;
  const auto grads = makeGrads(kSteps, 11);
  // Reference: torch::optim on full tensors.
  auto full = makeParams(5);
  std::vector<at::Tensor> decay, noDecay;
  for (auto& p : full) {
    p.set_requires_grad(true);
    (defaultDecays(p.sizes().vec()) ? decay : noDecay).push_back(p);
  }
  const bool groups = !o.noDecay.empty() || !o.lrScale.empty();
  auto ref = groups ? referenceGroups(o, lr, full) : sharding::testing::referenceOptimizer(o, lr, decay, noDecay);
  for (int t = 0; t < kSteps; ++t) {
    for (size_t i = 0; i < full.size(); ++i) full[i].mutable_grad() = grads[t][i].clone();
    ref->step();
  }

  for (int world : {1, 2, 3, 4}) {
    // Per rank: the records of every parameter's shard, and an optimizer over them.
    std::vector<std::vector<dtensor::ShardedParam>> params(static_cast<size_t>(world));
    std::vector<ShardedOptimizer> optimizers;
    const auto init = makeParams(5);
    for (int r = 0; r < world; ++r) {
      optimizers.emplace_back(o);
      params[r].reserve(init.size());  // the optimizer keeps pointers to the records
      for (size_t i = 0; i < init.size(); ++i) {
        dtensor::ShardedParam& p = params[r].emplace_back();
        p.name = "p" + std::to_string(i);
        p.spec = dtensor::ShardSpec(init[i].sizes().vec(), at::kFloat, world, r);
        p.master = p.spec.shardOf(init[i]);
        optimizers[r].addParam(p, decays(o, p.name, init[i].sizes().vec()), lrScaleOf(o, p.name));
      }
    }
    for (int t = 0; t < kSteps; ++t) {
      for (int r = 0; r < world; ++r) {
        for (size_t i = 0; i < init.size(); ++i) params[r][i].grad = params[r][i].spec.shardOf(grads[t][i]);
        optimizers[r].step(lr);
      }
    }
    for (size_t i = 0; i < init.size(); ++i) {
      std::vector<at::Tensor> rows;
      for (int r = 0; r < world; ++r) {
        const dtensor::ShardedParam& p = params[r][i];
        EXPECT_EQ(optimizers[r].stepCount(p), kSteps);
        rows.push_back(p.spec.realRows(p.master).reshape({-1}));
        // Padding rows stay zero.
        at::Tensor padded = p.master.reshape({p.spec.chunkRows(), p.spec.rowNumel()});
        EXPECT_EQ(padded.narrow(0, p.spec.localRows(), p.spec.chunkRows() - p.spec.localRows()).abs().sum().item<float>(), 0.0f);
      }
      at::Tensor gathered = at::cat(rows).view(init[i].sizes());
      EXPECT_TRUE(at::allclose(gathered, full[i].detach(), 1e-5, 1e-6))
          << enumName(kOptimizerKindNames, o.kind) << " world " << world << " param " << i << " max diff "
          << (gathered - full[i].detach()).abs().max().item<float>();
    }
  }
}

TEST(ShardedOptimizerTest, AdamWMatchesTorchOptim) {
  OptimizerOptions o;
  o.kind = optim::OptimizerKind::kAdamW;
  o.weightDecay = 0.1;
  expectParity(o, 1e-2);
}

TEST(ShardedOptimizerTest, AdamMatchesTorchOptim) {
  OptimizerOptions o;
  o.kind = optim::OptimizerKind::kAdam;
  o.weightDecay = 0.05;
  o.beta2 = 0.99;
  expectParity(o, 1e-2);
}

TEST(ShardedOptimizerTest, SgdMomentumMatchesTorchOptim) {
  OptimizerOptions o;
  o.kind = optim::OptimizerKind::kSgd;
  o.momentum = 0.9;
  o.weightDecay = 0.01;
  expectParity(o, 0.05);
}

TEST(ShardedOptimizerTest, SgdNesterovMatchesTorchOptim) {
  OptimizerOptions o;
  o.kind = optim::OptimizerKind::kSgd;
  o.momentum = 0.8;
  o.nesterov = true;
  o.weightDecay = 0.0;
  expectParity(o, 0.05);
}

// optim.no_decay and optim.lr_scale: a 2-D parameter taken out of weight decay, others
// with their own learning rates, equal torch's AdamW over the same parameter groups.
TEST(ShardedOptimizerTest, ParameterGroupsMatchTorchOptimGroups) {
  OptimizerOptions o;
  o.kind = optim::OptimizerKind::kAdamW;
  o.weightDecay = 0.2;
  o.noDecay = {"p0"};                          // [7, 5]: would decay by default
  o.lrScale = {{"p2", 3.0}, {"p[15]", 0.5}};   // [2, 3, 2] faster; [3] and [10] slower
  EXPECT_FALSE(decays(o, "p0", {7, 5}));
  EXPECT_TRUE(decays(o, "p2", {2, 3, 2}));
  EXPECT_FALSE(decays(o, "p1", {3}));          // 1-D: never
  EXPECT_DOUBLE_EQ(lrScaleOf(o, "p5"), 0.5);
  EXPECT_DOUBLE_EQ(lrScaleOf(o, "p3"), 1.0);
  expectParity(o, 1e-2);
}

// Overlapping lr_scale patterns: the most specific (longest) one wins, whatever the map's
// order; a pattern that names no parameter is reported (and warned at the first step).
TEST(ShardedOptimizerTest, MostSpecificLrScalePatternWinsAndUnmatchedOnesAreNamed) {
  OptimizerOptions o;
  o.lrScale = {{"blocks.*", 0.5}, {"blocks.0.*", 2.0}, {"head.*", 3.0}};
  EXPECT_DOUBLE_EQ(lrScaleOf(o, "blocks.0.fc.weight"), 2.0);
  EXPECT_DOUBLE_EQ(lrScaleOf(o, "blocks.1.fc.weight"), 0.5);
  EXPECT_DOUBLE_EQ(lrScaleOf(o, "input.weight"), 1.0);
  o.noDecay = {"*.bias", "embed.*"};
  EXPECT_EQ(unmatchedPatterns(o, {"blocks.0.fc.weight", "blocks.0.fc.bias"}),
            (std::vector<std::string>{"embed.*", "head.*"}));
}

TEST(ShardedOptimizerTest, StatesShareTheParamSpecAndSplitMemory) {
  OptimizerOptions o;
  const int world = 4;
  int64_t total = 0;
  for (int r = 0; r < world; ++r) {
    ShardedOptimizer opt(o);
    dtensor::ShardedParam p;
    p.name = "w";
    p.spec = dtensor::ShardSpec({10, 3}, at::kFloat, world, r);
    p.master = p.spec.shardOf(at::ones({10, 3}));
    opt.addParam(p);
    p.grad = p.spec.shardOf(at::ones({10, 3}));
    opt.step(0.1);
    EXPECT_EQ(opt.state(p, "exp_avg").sizes(), p.master.sizes());
    EXPECT_EQ(opt.stateBytes(), 2 * p.spec.paddedNumel() * 4);
    total += opt.stateBytes();
  }
  EXPECT_EQ(total, 2 * 12 * 3 * 4);  // 2 states x 10 rows padded to 12 x 3 x fp32
}

// The optimizer's checkpoint entries hold everything an update depends on: an optimizer
// whose entries are loaded from another's (moments and per-parameter step counts; one
// parameter never stepped) continues exactly as the original does.
TEST(ShardedOptimizerTest, StateEntriesRestoreEverythingAStepNeeds) {
  for (const std::string name : {"adamw", "sgd"}) {
    OptimizerOptions o;
    o.kind = parseEnum(kOptimizerKindNames, name, "optimizer");
    o.momentum = name == "sgd" ? 0.9 : 0.0;
    o.dampening = name == "sgd" ? 0.3 : 0.0;  // torch's first momentum step skips dampening
    const auto grads = makeGrads(6, 21);
    auto run = [&](std::vector<dtensor::ShardedParam>& params, ShardedOptimizer& opt, int from, int to) {
      for (int t = from; t < to; ++t) {
        for (size_t i = 0; i < params.size(); ++i) {
          // Parameter 1 gets no gradient before step 3: its state starts later.
          params[i].grad = i == 1 && t < 3 ? at::Tensor() : params[i].spec.shardOf(grads[t][i]);
        }
        opt.step(1e-2);
      }
    };
    auto build = [&](std::vector<dtensor::ShardedParam>& params, ShardedOptimizer& opt) {
      const auto init = makeParams(5);
      params.reserve(init.size());
      for (size_t i = 0; i < init.size(); ++i) {
        dtensor::ShardedParam& p = params.emplace_back();
        p.name = "p" + std::to_string(i);
        p.spec = dtensor::ShardSpec(init[i].sizes().vec(), at::kFloat, 2, 1);
        p.master = p.spec.shardOf(init[i]);
        opt.addParam(p, defaultDecays(init[i].sizes().vec()));
      }
    };
    std::vector<dtensor::ShardedParam> a, b;
    ShardedOptimizer optA(o), optB(o);
    build(a, optA);
    build(b, optB);
    run(a, optA, 0, 2);  // parameter 1 not stepped yet: its entries are zeros and step 0
    std::vector<dtensor::StateEntry> saved = optA.stateEntries("optim/");
    std::vector<dtensor::StateEntry> loaded = optB.stateEntries("optim/");
    ASSERT_EQ(saved.size(), loaded.size());
    for (size_t k = 0; k < saved.size(); ++k) {
      EXPECT_EQ(saved[k].name, loaded[k].name);
      EXPECT_EQ(saved[k].spec, loaded[k].spec) << saved[k].name;
      loaded[k].local.copy_(saved[k].local);  // what a checkpoint load does, in place
    }
    EXPECT_EQ(saved.back().name, "optim/step/p5");
    EXPECT_EQ(saved.back().spec.placement(), dtensor::Placement::kReplicate);
    EXPECT_EQ(optB.stepCount(b[0]), 2);
    EXPECT_EQ(optB.stepCount(b[1]), 0);
    for (size_t i = 0; i < a.size(); ++i) b[i].master.copy_(a[i].master);
    run(a, optA, 2, 6);
    run(b, optB, 2, 6);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].master.equal(b[i].master)) << name << " " << a[i].name;
    EXPECT_EQ(optB.stepCount(b[1]), 3);
    // Listing the entries (which creates zero states) changes nothing either.
    std::vector<dtensor::ShardedParam> c;
    ShardedOptimizer optC(o);
    build(c, optC);
    run(c, optC, 0, 6);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].master.equal(c[i].master)) << name << " " << a[i].name;
  }
}

TEST(ShardedOptimizerTest, BadOptionsAreConfigErrors) {
  EXPECT_THROW(parseEnum(kOptimizerKindNames, "lamb", "optim.name"), ConfigError);  // a name no optimizer has
  OptimizerOptions o;
  o.lrScale["wte.*"] = -1.0;
  EXPECT_THROW(ShardedOptimizer{o}, ConfigError);
  o = {};
  o.beta1 = 1.0;
  EXPECT_THROW(ShardedOptimizer{o}, ConfigError);
  o = {};
  o.kind = optim::OptimizerKind::kSgd;
  o.nesterov = true;
  EXPECT_THROW(ShardedOptimizer{o}, ConfigError);
}

TEST(ShardSpecTest, RowRangesCoverEveryRowOnce) {
  for (int64_t rows : {0, 1, 2, 3, 5, 7, 10}) {
    for (int world : {1, 2, 3, 4}) {
      int64_t next = 0;
      for (int r = 0; r < world; ++r) {
        dtensor::ShardSpec spec({rows, 2}, at::kFloat, world, r);
        auto [b, e] = spec.localRowRange();
        EXPECT_EQ(b, std::min(next, rows));
        EXPECT_LE(e - b, spec.chunkRows());
        EXPECT_EQ(spec.localShape()[0], spec.chunkRows());
        next = e;
      }
      EXPECT_EQ(next, rows) << rows << " rows over " << world;
    }
  }
  dtensor::ShardSpec scalar({}, at::kFloat, 3, 2);
  EXPECT_EQ(scalar.globalRows(), 1);
  EXPECT_EQ(scalar.localRows(), 0);
  EXPECT_EQ(scalar.localShape(), (std::vector<int64_t>{1}));
  EXPECT_THROW(dtensor::ShardSpec({2}, at::kFloat, 2, 2), Error);
}

TEST(ShardSpecTest, ShardOfPadsWithZerosAndChecksShape) {
  at::Tensor full = at::arange(10, at::kFloat).view({5, 2});
  dtensor::ShardSpec last({5, 2}, at::kFloat, 3, 2);  // chunk 2 rows: rank 2 owns row 4 only
  at::Tensor local = last.shardOf(full);
  EXPECT_EQ(local.sizes(), (c10::IntArrayRef{2, 2}));
  EXPECT_TRUE(at::equal(local[0], full[4]));
  EXPECT_EQ(local[1].abs().sum().item<float>(), 0.0f);
  EXPECT_TRUE(at::equal(last.realRows(local), full.narrow(0, 4, 1)));
  EXPECT_THROW(last.shardOf(at::zeros({4, 2})), Error);
}

}  // namespace
}  // namespace tessera::optim
