// ShardedModelEMAManager: each schedule feature against hand-computed values, sharded
// EMA equal to a dense EMA at world sizes 1-4, checkpoint entries and export names, and
// memory. (Evaluation with the EMA swapped in needs a strategy: ema_strategy_test.cpp.)
#include <gtest/gtest.h>

#include <cmath>

#include "common/errors.h"
#include "ema/ema_manager.h"

namespace tessera::ema {
namespace {

using dtensor::ShardSpec;

// One scalar-ish parameter on one rank; live value set per step.
struct Single {
  explicit Single(EmaOptions o) : mgr(std::move(o)) {
    mgr.addParam("w", ShardSpec({2}, at::kFloat, 1, 0), live);
  }
  double ema(size_t i = 0) { return mgr.emaShard(i, "w")[0].item<double>(); }
  void stepWith(int64_t step, float value, bool applied = true) {
    live.fill_(value);
    mgr.update(step, applied);
  }
  at::Tensor live = at::zeros({2});
  ShardedModelEMAManager mgr;
};

TEST(EmaScheduleTest, ConstantDecayFromInitialParameters) {
  EmaOptions o;
  o.decays = {0.5};
  Single s(o);  // EMA starts at the live value 0
  s.stepWith(1, 4.0f);  // 0.5*0 + 0.5*4 = 2
  EXPECT_DOUBLE_EQ(s.ema(), 2.0);
  s.stepWith(2, 8.0f);  // 0.5*2 + 0.5*8 = 5
  EXPECT_DOUBLE_EQ(s.ema(), 5.0);
  s.stepWith(3, 100.0f, /*applied=*/false);  // optimizer skipped: no update
  EXPECT_DOUBLE_EQ(s.ema(), 5.0);
  EXPECT_EQ(s.mgr.updateCount(), 2);
}

TEST(EmaScheduleTest, StartStepCopiesBeforeIt) {
  EmaOptions o;
  o.decays = {0.5};
  o.startStep = 3;
  Single s(o);
  s.stepWith(1, 4.0f);
  EXPECT_DOUBLE_EQ(s.ema(), 4.0);
  s.stepWith(2, 6.0f);
  EXPECT_DOUBLE_EQ(s.ema(), 6.0);
  EXPECT_EQ(s.mgr.updateCount(), 0);
  s.stepWith(3, 10.0f);  // first real update: 0.5*6 + 0.5*10 = 8
  EXPECT_DOUBLE_EQ(s.ema(), 8.0);
}

TEST(EmaScheduleTest, WarmupFormula) {
  EmaOptions o;
  o.decays = {0.999};
  o.warmup = true;
  o.invGamma = 1.0;
  o.power = 0.75;
  Single s(o);
  // k = 0: 1 - (1 + 0)^-0.75 = 0 -> EMA = p
  s.stepWith(1, 4.0f);
  EXPECT_DOUBLE_EQ(s.ema(), 4.0);
  // k = 1: d = 1 - 2^-0.75
  const double d1 = 1.0 - std::pow(2.0, -0.75);
  EXPECT_DOUBLE_EQ(s.mgr.effectiveDecay(0, 1), d1);
  s.stepWith(2, 8.0f);
  EXPECT_NEAR(s.ema(), d1 * 4.0 + (1 - d1) * 8.0, 1e-6);
  // Large k: capped at the decay.
  EXPECT_DOUBLE_EQ(s.mgr.effectiveDecay(0, 100000000), 0.999);
}

TEST(EmaScheduleTest, UpdateEveryRaisesDecay) {
  EmaOptions o;
  o.decays = {0.9};
  o.updateEvery = 3;
  Single s(o);
  s.stepWith(1, 10.0f);
  s.stepWith(2, 10.0f);
  EXPECT_DOUBLE_EQ(s.ema(), 0.0);  // no update yet
  s.stepWith(3, 10.0f);
  const double d = std::pow(0.9, 3);
  EXPECT_NEAR(s.ema(), (1 - d) * 10.0, 1e-5);
  EXPECT_EQ(s.mgr.updateCount(), 1);
}

TEST(EmaScheduleTest, SeveralDecaysAndTheirNames) {
  EmaOptions o;
  o.prefix = "generator_ema";
  o.decays = {0.5, 0.75};
  Single s(o);
  s.stepWith(1, 8.0f);
  EXPECT_DOUBLE_EQ(s.ema(0), 4.0);
  EXPECT_DOUBLE_EQ(s.ema(1), 2.0);
  EXPECT_EQ(s.mgr.stateName(0), "generator_ema");
  EXPECT_EQ(s.mgr.stateName(1), "generator_ema_0.75");
  EXPECT_EQ(s.mgr.decayIndexOf("generator_ema_0.5"), 0u);
  EXPECT_EQ(s.mgr.decayIndexOf("generator_ema_0.75"), 1u);
  EXPECT_THROW(s.mgr.decayIndexOf("generator_ema_0.9"), Error);
}

TEST(EmaScheduleTest, BuffersCopiedOrAveraged) {
  for (const std::string mode : {"copy", "average"}) {
    EmaOptions o;
    o.decays = {0.5};
    o.buffers = parseEnum(kEmaBuffersNames, mode, "ema.buffers");
    ShardedModelEMAManager mgr(o);
    at::Tensor mean = at::zeros({3});
    at::Tensor count = at::zeros({}, at::kLong);
    mgr.addBuffer("bn.running_mean", ShardSpec({3}, at::kFloat, 1, 0, dtensor::Placement::kReplicate), mean);
    mgr.addBuffer("bn.num_batches_tracked", ShardSpec({}, at::kLong, 1, 0, dtensor::Placement::kReplicate), count);
    mean.fill_(4.0);
    count.fill_(7);
    mgr.update(1);
    EXPECT_DOUBLE_EQ(mgr.emaBuffer(0, "bn.running_mean")[0].item<double>(), mode == "copy" ? 4.0 : 2.0) << mode;
    EXPECT_EQ(mgr.emaBuffer(0, "bn.num_batches_tracked").item<int64_t>(), 7) << mode;
  }
}

TEST(EmaShardedTest, ShardsEqualDenseEmaAtEveryWorldSize) {
  const std::vector<int64_t> shape = {7, 3};
  const int kSteps = 30;
  at::manual_seed(3);
  std::vector<at::Tensor> values;
  for (int t = 0; t <= kSteps; ++t) values.push_back(at::randn(shape));
  // Dense reference in double.
  at::Tensor dense = values[0].to(at::kDouble);
  for (int t = 1; t <= kSteps; ++t) dense = 0.9 * dense + 0.1 * values[t].to(at::kDouble);

  for (int world : {1, 2, 3, 4}) {
    std::vector<at::Tensor> rows;
    int64_t totalBytes = 0;
    for (int r = 0; r < world; ++r) {
      EmaOptions o;
      o.decays = {0.9};
      ShardedModelEMAManager mgr(o);
      ShardSpec spec(shape, at::kFloat, world, r);
      at::Tensor live = spec.shardOf(values[0]);
      mgr.addParam("w", spec, live);
      for (int t = 1; t <= kSteps; ++t) {
        live.copy_(spec.shardOf(values[t]));
        mgr.update(t);
      }
      rows.push_back(spec.realRows(mgr.emaShard(0, "w")));
      EXPECT_EQ(mgr.bytes(), spec.paddedNumel() * 4);
      totalBytes += mgr.bytes();
    }
    at::Tensor gathered = at::cat(rows).view(shape);
    EXPECT_TRUE(at::allclose(gathered.to(at::kDouble), dense, 1e-6, 1e-7)) << "world " << world;
    const int64_t chunk = (shape[0] + world - 1) / world;
    EXPECT_EQ(totalBytes, chunk * world * shape[1] * 4);  // total/N per rank, within padding
  }
}

// Checkpoint entries: every decay's shards under its state name, with the parameter's
// spec, and the export aliases of the decay names.
TEST(EmaEntriesTest, EntriesAndAliasesNameEveryDecay) {
  EmaOptions o;
  o.prefix = "generator_ema";
  o.decays = {0.9, 0.99};
  ShardedModelEMAManager mgr(o);
  ShardSpec spec({5, 2}, at::kFloat, 2, 1);
  mgr.addParam("w", spec, spec.shardOf(at::zeros({5, 2})));
  const auto entries = mgr.stateEntries("ema/");
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0].name, "ema/generator_ema/w");
  EXPECT_EQ(entries[1].name, "ema/generator_ema_0.99/w");
  EXPECT_EQ(entries[1].spec, spec);
  EXPECT_EQ(entries[1].local.data_ptr(), mgr.emaShard(1, "w").data_ptr()) << "entries load in place";
  const auto aliases = mgr.exportAliases("ema/");
  EXPECT_EQ(aliases.at("generator_ema_0.9"), "ema/generator_ema/");
  EXPECT_EQ(aliases.at("generator_ema_0.99"), "ema/generator_ema_0.99/");
  EXPECT_EQ(mgr.decayName(0), "generator_ema_0.9");
}

TEST(EmaOptionsTest, BadOptionsAreConfigErrors) {
  EmaOptions o;
  o.decays = {1.5};
  EXPECT_THROW(ShardedModelEMAManager{o}, ConfigError);
  o = {};
  o.decays = {};
  EXPECT_THROW(ShardedModelEMAManager{o}, ConfigError);
  EXPECT_THROW(parseEnum(kEmaBuffersNames, "mean", "ema.buffers"), ConfigError);
  o = {};
  o.updateEvery = 0;
  EXPECT_THROW(ShardedModelEMAManager{o}, ConfigError);
}

}  // namespace
}  // namespace tessera::ema
