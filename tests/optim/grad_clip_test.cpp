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

TEST(GradClipTest, ShardedAndReplicatedMatchTorch) {
  sharding::testing::useOneThread();
  for (double maxNorm : {0.0, 0.5, 1e6}) {
    std::vector<at::Tensor> expected = fullGrads();
    const double expectedNorm = torchClip(expected, maxNorm > 0 ? maxNorm : 1e30);
    for (int world : {1, 2, 3, 4}) {
      runOnRanks(world, [&](RankContext& ctx) {
        // Odd-indexed tensors replicated, the others sharded: both kinds in one norm.
        std::vector<dtensor::ShardedParam> params;
        const auto full = fullGrads();
        for (size_t i = 0; i < full.size(); ++i) {
          dtensor::ShardSpec spec(kClipShapes[i], at::kFloat, ctx.world, ctx.rank,
                         i % 2 == 1 ? dtensor::Placement::kReplicate : dtensor::Placement::kShard0);
          params.push_back(gradient(spec, spec.shardOf(full[i])));
        }
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

}  // namespace
}  // namespace tessera::optim
