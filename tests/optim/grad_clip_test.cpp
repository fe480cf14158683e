// Global-norm clipping over sharded and replicated gradients equals
// torch::nn::utils::clip_grad_norm_ on the full gradients, for world sizes 1-4 and
// uneven shapes; one all-reduce when something is sharded, none when all is replicated.
#include <gtest/gtest.h>
#include <torch/torch.h>  // clip_grad.h alone is not self-contained in 1.13

#include <cmath>

#include "distributed/communicator.h"
#include "optim/grad_clip.h"
#include "tests/sharding/test_models.h"
#include "tests/support/multi_rank.h"

namespace tessera::optim {
namespace {

using test::RankContext;
using test::runOnRanks;

const std::vector<std::vector<int64_t>> kClipShapes = {{7, 5}, {3}, {1, 3}, {}, {10}};

std::vector<at::Tensor> fullGrads() {
  std::vector<at::Tensor> out;
  int k = 0;
  for (const auto& s : kClipShapes) {
    at::Tensor t = at::empty(s);
    t.copy_((at::arange(t.numel(), at::kFloat) - 3.0f).mul(0.37f * (++k)).sin().view(s));
    out.push_back(t);
  }
  return out;
}

// A record holding only what clipping reads: the spec and the gradient shard.
dtensor::ShardedParam gradient(dtensor::ShardSpec spec, at::Tensor grad) {
  dtensor::ShardedParam p;
  p.spec = std::move(spec);
  p.grad = std::move(grad);
  return p;
}

// torch's clip on full tensors: returns the norm, clips `grads` in place.
double torchClip(std::vector<at::Tensor>& grads, double maxNorm) {
  std::vector<at::Tensor> params;
  for (auto& g : grads) {
    at::Tensor p = at::zeros_like(g).set_requires_grad(true);
    p.mutable_grad() = g;
    params.push_back(p);
  }
  return torch::nn::utils::clip_grad_norm_(params, maxNorm);
}

// fullGrads() as this rank's records: odd-indexed tensors replicated, the others sharded,
// so that one norm has both kinds.
std::vector<dtensor::ShardedParam> mixedGradients(const RankContext& ctx) {
  std::vector<dtensor::ShardedParam> params;
  const auto full = fullGrads();
  for (size_t i = 0; i < full.size(); ++i) {
    dtensor::ShardSpec spec(kClipShapes[i], at::kFloat, ctx.world, ctx.rank,
                            i % 2 == 1 ? dtensor::Placement::kReplicate : dtensor::Placement::kShard0);
    params.push_back(gradient(spec, spec.shardOf(full[i])));
  }
  return params;
}

TEST(GradClipTest, ShardedAndReplicatedMatchTorch) {
  sharding::testing::useOneThread();
  for (double maxNorm : {0.0, 0.5, 1e6}) {
    std::vector<at::Tensor> expected = fullGrads();
    const double expectedNorm = torchClip(expected, maxNorm > 0 ? maxNorm : 1e30);
    for (int world : {1, 2, 3, 4}) {
      runOnRanks(world, [&](RankContext& ctx) {
        std::vector<dtensor::ShardedParam> params = mixedGradients(ctx);
        const auto full = fullGrads();
        ctx.comm()->resetStats();
        const GradNorm n = clipGradNorm(params, maxNorm, *ctx.comm());
        EXPECT_NEAR(n.norm, expectedNorm, 1e-6 * expectedNorm);
        EXPECT_EQ(ctx.comm()->stats()[distributed::CommOp::kAllReduce].calls, ctx.world > 1 ? 1 : 0);
        EXPECT_EQ(n.clipCoef < 1.0, maxNorm > 0 && maxNorm < expectedNorm);
        for (size_t i = 0; i < full.size(); ++i) {
          EXPECT_TRUE(at::allclose(params[i].grad, params[i].spec.shardOf(expected[i]), 1e-6, 1e-7))
              << "world " << ctx.world << " tensor " << i << " maxNorm " << maxNorm;
        }
      });
    }
  }
}

TEST(GradClipTest, AllReplicatedNeedsNoCommunication) {
  sharding::testing::useOneThread();
  runOnRanks(2, [](RankContext& ctx) {
    const auto full = fullGrads();
    std::vector<dtensor::ShardedParam> params;
    for (size_t i = 0; i < full.size(); ++i) {
      params.push_back(gradient(dtensor::ShardSpec(kClipShapes[i], at::kFloat, 2, ctx.rank, dtensor::Placement::kReplicate), full[i].clone()));
    }
    ctx.comm()->resetStats();
    const double norm = globalGradNorm(params, *ctx.comm());
    EXPECT_EQ(ctx.comm()->stats().totalCalls(), 0);
    std::vector<at::Tensor> expected = fullGrads();
    EXPECT_NEAR(norm, torchClip(expected, 1e30), 1e-6 * norm);
  });
}

TEST(GradClipTest, NonFiniteNormIsReportedNotApplied) {
  sharding::testing::useOneThread();
  runOnRanks(3, [](RankContext& ctx) {
    const auto full = fullGrads();
    std::vector<dtensor::ShardedParam> params;
    for (size_t i = 0; i < full.size(); ++i) {
      dtensor::ShardSpec spec(kClipShapes[i], at::kFloat, 3, ctx.rank);
      params.push_back(gradient(spec, spec.shardOf(full[i])));
    }
    if (ctx.rank == 2) params[0].grad.view({-1})[0] = NAN;  // only rank 2 sees it
    std::vector<at::Tensor> before;
    for (const auto& p : params) before.push_back(p.grad.clone());
    const GradNorm n = clipGradNorm(params, 0.1, *ctx.comm());
    EXPECT_FALSE(n.finite()) << "every rank learns of rank 2's NaN";
    EXPECT_EQ(n.clipCoef, 1.0);
    for (size_t i = 1; i < params.size(); ++i) EXPECT_TRUE(params[i].grad.equal(before[i]));
  });
  EXPECT_EQ(clipCoefficient(2.0, 0.0), 1.0);
  EXPECT_EQ(clipCoefficient(2.0, 4.0), 1.0);
  EXPECT_DOUBLE_EQ(clipCoefficient(2.0, 1.0), 1.0 / (2.0 + 1e-6));
  EXPECT_EQ(clipCoefficient(INFINITY, 1.0), 1.0);
}

TEST(GradClipTest, PaddingRowsDoNotCount) {
  dtensor::ShardSpec spec({1, 3}, at::kFloat, 4, 2);  // rank 2 owns no row: its buffer is all padding
  EXPECT_EQ(localSquaredNorm(at::ones({1, 3}), spec), 0.0);
  dtensor::ShardSpec owner({5}, at::kFloat, 2, 1);  // rows [3, 5) of a 3-row chunk: one padding row
  EXPECT_EQ(localSquaredNorm(at::full({3}, 2.0f), owner), 8.0);
}


// ---- run.deterministic's exact norm ----------------------------------------------------------

// Values over most of fp32's range (subnormals, huge ones, both signs) and a few exact zeros.
std::vector<float> wideValues(int n, uint64_t seed) {
  sharding::testing::seedCpu(seed);
  const at::Tensor mantissa = at::rand({n}) * 2 - 1;
  const at::Tensor exponent = at::randint(-140, 60, {n}).to(at::kFloat);
  at::Tensor v = mantissa * at::pow(2.0f, exponent);
  v.narrow(0, 0, 3).zero_();
  return std::vector<float>(v.data_ptr<float>(), v.data_ptr<float>() + n);
}

TEST(ExactSquareSumTest, TheSumIsExactWhateverTheOrderOrSplit) {
  // 2^60 + 2^20 ones: exact as a double, but a float or double running sum from the large
  // square onwards loses every one (2^60 + 1 rounds back to 2^60).
  std::vector<float> values(1u << 20, 1.0f);
  values.insert(values.begin(), std::ldexp(1.0f, 30));
  ExactSquareSum exact;
  exact.add(values.data(), static_cast<int64_t>(values.size()));
  EXPECT_EQ(exact.value(), std::ldexp(1.0, 60) + std::ldexp(1.0, 20));

  const std::vector<float> wide = wideValues(5000, 7);
  long double reference = 0;
  for (const float v : wide) reference += static_cast<long double>(v) * v;
  ExactSquareSum whole;
  whole.add(wide.data(), static_cast<int64_t>(wide.size()));
  EXPECT_NEAR(whole.value(), static_cast<double>(reference), 1e-15 * static_cast<double>(reference));
  for (const int parts : {2, 3, 7}) {
    // Parts added in reverse order, each through the digits an all-reduce would carry.
    ExactSquareSum total;
    for (int p = parts - 1; p >= 0; --p) {
      const size_t lo = wide.size() * static_cast<size_t>(p) / static_cast<size_t>(parts);
      const size_t hi = wide.size() * static_cast<size_t>(p + 1) / static_cast<size_t>(parts);
      ExactSquareSum part;
      part.add(wide.data() + lo, static_cast<int64_t>(hi - lo));
      total.addDigits(part.digits());
    }
    EXPECT_EQ(total.value(), whole.value()) << parts << " parts";
  }
  // The digits of several parts summed as doubles (what the all-reduce does) stay exact.
  ExactSquareSum a, b;
  a.add(wide.data(), 2500);
  b.add(wide.data() + 2500, 2500);
  ExactSquareSum summed;
  summed.addDigits(a.digits() + b.digits());
  EXPECT_EQ(summed.value(), whole.value());
}

TEST(ExactSquareSumTest, NonFiniteValuesMakeTheSumInfinite) {
  ExactSquareSum s;
  const float values[] = {1.0f, NAN, 2.0f};
  s.add(values, 3);
  EXPECT_TRUE(std::isinf(s.value()));
  ExactSquareSum carried;
  carried.addDigits(s.digits());
  EXPECT_TRUE(std::isinf(carried.value())) << "the count of non-finite values crosses ranks with the digits";
  EXPECT_EQ(ExactSquareSum().value(), 0.0);
}

TEST(GradClipTest, ExactNormHasTheSameBitsOnEveryWorldSize) {
  sharding::testing::useOneThread();
  std::vector<at::Tensor> expected = fullGrads();
  const double torchNorm = torchClip(expected, 1e30);
  std::vector<double> norms(5, -1);
  for (int world : {1, 2, 3, 4}) {
    runOnRanks(world, [&](RankContext& ctx) {
      const std::vector<dtensor::ShardedParam> params = mixedGradients(ctx);
      at::Tensor alongside = at::full({1}, 1.5, at::kDouble);
      const double norm = globalGradNorm(params, *ctx.comm(), alongside, /*exact=*/true);
      EXPECT_EQ(alongside.item<double>(), 1.5 * ctx.world) << "values sent along are summed too";
      if (ctx.rank == 0) norms[static_cast<size_t>(world)] = norm;
    });
    EXPECT_EQ(norms[static_cast<size_t>(world)], norms[1]) << "world " << world;
  }
  EXPECT_NEAR(norms[1], torchNorm, 1e-6 * torchNorm);
}

}  // namespace
}  // namespace tessera::optim
