// Bytes held and bytes sent by no_shard / zero1 / zero2, measured, against the ZeRO
// formulas for fp32 AdamW (Psi parameters, N ranks):
//   resident (with gradients, between step() and zeroGrad()):
//     no_shard 16 Psi, zero1 8 Psi + 8 Psi/N, zero2 4 Psi + 12 Psi/N   (+ padding)
//   sent per rank per step: 2 Psi (N-1)/N x 4 bytes for all three (within 2%).
// Resident bytes come from ShardingStrategy::residentBytes() (storage nbytes of the live
// tensors), sent bytes from the communicator's counters. The measured figures are printed.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "distributed/communicator.h"
#include "sharding/data_parallel.h"
#include "sharding/strategy.h"
#include "tests/sharding/test_models.h"
#include "tests/support/multi_rank.h"

namespace tessera::sharding {
namespace {

using test::RankContext;
using test::runOnRanks;
using namespace tessera::sharding::testing;

struct Measurement {
  ResidentBytes resident;
  int64_t stateBytes = 0;
  distributed::CommStats comm;
  int64_t psi = 0;
  int64_t shardNumel = 0;  // sum over parameters of chunkRows x rowNumel (this rank's padded slice)
  int64_t rowNumelSum = 0; // sum over parameters of rowNumel (bounds the per-rank padding)
  size_t buckets = 0;
};

// Two steps of the wide MLP on every rank; measures the second (optimizer states exist).
std::vector<Measurement> measure(const std::string& strategy, int world, int64_t bucketBytes = 25 * 1024 * 1024,
                                 at::ScalarType paramDtype = at::kFloat) {
  seedCpu(5);
  const Batches batches = makeBatches(2, 8, 16, 7, 5);
  std::vector<Measurement> out(static_cast<size_t>(world));
  runOnRanks(world, [&](RankContext& ctx) {
    WideMlp model;
    StrategyOptions o;
    o.strategy = sharding::parseStrategyKind(strategy);
    o.bucketBytes = bucketBytes;
    o.optimizer.kind = optim::OptimizerKind::kAdamW;
    o.paramDtype = paramDtype;
    auto engine = makeStrategy(*model, ctx.comm(), o);
    Measurement& m = out[static_cast<size_t>(ctx.rank)];
    for (int t = 0; t < 2; ++t) {
      engine->zeroGrad();
      if (t == 1) ctx.comm()->resetStats();
      const at::Tensor x = rankSlice(batches.x[t], ctx.rank, world).to(paramDtype);
      torch::mse_loss(model->forward(x).to(at::kFloat), rankSlice(batches.y[t], ctx.rank, world)).backward();
      ASSERT_FALSE(engine->step(1e-3).skipped);
    }
    m.comm = ctx.comm()->stats();
    m.resident = engine->residentBytes();
    m.stateBytes = engine->optimizer().stateBytes();
    m.psi = parameterCount(*model);
    for (const dtensor::ShardedParam& p : engine->params()) {
      const dtensor::ShardSpec& s = p.spec;
      m.shardNumel += s.chunkRows() * s.rowNumel();
      m.rowNumelSum += s.rowNumel();
    }
    m.buckets = dynamic_cast<DataParallelStrategy&>(*engine).bucketCount();
  });
  return out;
}

double formulaBytes(const std::string& strategy, double psi, int n) {
  if (strategy == "no_shard") return 16 * psi;
  if (strategy == "zero1") return 8 * psi + 8 * psi / n;
  return 4 * psi + 12 * psi / n;
}

const char* formulaText(const std::string& strategy) {
  if (strategy == "no_shard") return "16 Psi";
  if (strategy == "zero1") return "8 Psi + 8 Psi/N";
  return "4 Psi + 12 Psi/N";
}

using Case = std::tuple<std::string, int>;
class StrategyMemoryTest : public ::testing::TestWithParam<Case> {};

TEST_P(StrategyMemoryTest, ResidentBytesFollowZeroFormulas) {
  useOneThread();
  const auto& [strategy, n] = GetParam();
  const auto ms = measure(strategy, n);
  int64_t stateTotal = 0;
  for (int r = 0; r < n; ++r) {
    const Measurement& m = ms[static_cast<size_t>(r)];
    const int64_t psi = m.psi, shard = m.shardNumel, full = m.shardNumel * n;
    // Exactly what each role should hold, padding included.
    const bool sharded = strategy != "no_shard";
    EXPECT_EQ(m.resident.params, 4 * (sharded ? full : psi)) << "rank " << r;
    EXPECT_EQ(m.resident.grads, 4 * (strategy == "zero2" ? shard : psi)) << "rank " << r;
    EXPECT_EQ(m.resident.optimizer, 8 * (sharded ? shard : psi)) << "rank " << r;
    EXPECT_EQ(m.resident.buffers, 0);
    // The ZeRO formula, within the padding (at most N-1 rows per parameter, in all 16 bytes).
    const double formula = formulaBytes(strategy, static_cast<double>(psi), n);
    EXPECT_LE(std::abs(m.resident.total() - formula), 16.0 * (full - psi) + 1e-9) << "rank " << r;
    // Optimizer states per rank: total/N within one padding row per parameter.
    EXPECT_EQ(m.stateBytes, m.resident.optimizer);
    EXPECT_LE(std::abs(m.stateBytes - 8.0 * psi / (sharded ? n : 1)), 8.0 * m.rowNumelSum) << "rank " << r;
    EXPECT_EQ(m.stateBytes, ms[0].stateBytes) << "equal per rank";
    stateTotal += m.stateBytes;
  }
  const Measurement& m = ms[0];
  const double formula = formulaBytes(strategy, static_cast<double>(m.psi), n);
  std::printf("[memory] %-8s N=%d Psi=%lld: params %lld grads %lld optimizer %lld total %lld B; formula %s = %.0f B "
              "(%+.2f%%); optimizer states per rank %lld B = %.4f of all ranks' %lld B\n",
              strategy.c_str(), n, static_cast<long long>(m.psi), static_cast<long long>(m.resident.params),
              static_cast<long long>(m.resident.grads), static_cast<long long>(m.resident.optimizer),
              static_cast<long long>(m.resident.total()), formulaText(strategy), formula,
              100.0 * (m.resident.total() - formula) / formula, static_cast<long long>(m.stateBytes),
              static_cast<double>(m.stateBytes) / static_cast<double>(stateTotal), static_cast<long long>(stateTotal));
}

INSTANTIATE_TEST_SUITE_P(Strategies, StrategyMemoryTest,
                         ::testing::Combine(::testing::Values("no_shard", "zero1", "zero2"),
                                            ::testing::Values(1, 2, 4)),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::get<0>(info.param) + "_world" + std::to_string(std::get<1>(info.param));
                         });

// bf16 compute, fp32 masters, fp32 reduction (ZeRO's mixed precision, K = 12: masters
// and both Adam moments): parameters and gradients 2 bytes each, masters held apart
// from the parameters and counted with the optimizer. zero2's gradient shards are in
// the reduce dtype (fp32).
TEST(StrategyMemoryTest, Bf16ComputeWithFp32Masters) {
  useOneThread();
  const int n = 2;
  for (const std::string strategy : {"no_shard", "zero1", "zero2"}) {
    const auto ms = measure(strategy, n, 25 * 1024 * 1024, at::kBFloat16);
    const Measurement& m = ms[1];
    const bool sharded = strategy != "no_shard";
    const int64_t opt = sharded ? m.shardNumel : m.psi;
    EXPECT_EQ(m.resident.params, 2 * m.psi) << strategy;
    EXPECT_EQ(m.resident.grads, strategy == "zero2" ? 4 * m.shardNumel : 2 * m.psi) << strategy;
    EXPECT_EQ(m.resident.optimizer, 12 * opt) << strategy;
    std::printf("[memory] %-8s N=%d bf16 compute + fp32 masters: params %lld grads %lld optimizer %lld total %lld B "
                "(Psi=%lld)\n",
                strategy.c_str(), n, static_cast<long long>(m.resident.params),
                static_cast<long long>(m.resident.grads), static_cast<long long>(m.resident.optimizer),
                static_cast<long long>(m.resident.total()), static_cast<long long>(m.psi));
  }
}

class StrategyCommTest : public ::testing::TestWithParam<Case> {};

TEST_P(StrategyCommTest, BytesSentPerStepAreTwoPsi) {
  useOneThread();
  const auto& [strategy, n] = GetParam();
  using distributed::CommOp;
  // One bucket (default size), then ~16 KiB buckets: same bytes, one call per bucket.
  for (int64_t bucketBytes : {int64_t{25} * 1024 * 1024, int64_t{16} * 1024}) {
    const auto ms = measure(strategy, n, bucketBytes);
    for (int r = 0; r < n; ++r) {
      const Measurement& m = ms[static_cast<size_t>(r)];
      const double target = 2.0 * m.psi * (n - 1) / n * 4;
      const int64_t sent = m.comm.totalBytes();
      EXPECT_LE(std::abs(sent - target), 0.02 * target) << "rank " << r << ": " << m.comm.toString();
      const auto calls = static_cast<int64_t>(m.buckets);
      if (strategy == "no_shard") {
        EXPECT_EQ(m.comm[CommOp::kAllReduce].calls, calls);  // no norm collective: replicated
        EXPECT_EQ(m.comm[CommOp::kReduceScatter].calls + m.comm[CommOp::kAllGather].calls, 0);
      } else {
        // Exactly the ring model: (N-1) x padded shard, both ways, plus the norm's double.
        EXPECT_EQ(m.comm[CommOp::kReduceScatter].bytes, (n - 1) * 4 * m.shardNumel);
        EXPECT_EQ(m.comm[CommOp::kAllGather].bytes, (n - 1) * 4 * m.shardNumel);
        EXPECT_EQ(m.comm[CommOp::kReduceScatter].calls, calls);
        EXPECT_EQ(m.comm[CommOp::kAllGather].calls, calls);
        EXPECT_EQ(m.comm[CommOp::kAllReduce].calls, 1);
        EXPECT_EQ(m.comm[CommOp::kAllReduce].bytes, 2 * (n - 1) * 8 / n);
      }
      EXPECT_EQ(m.comm[CommOp::kBroadcast].calls, 0) << "no buffers to sync";
    }
    const Measurement& m = ms[0];
    const double target = 2.0 * m.psi * (n - 1) / n * 4;
    std::printf("[comm] %-8s N=%d Psi=%lld buckets=%zu: sent %lld B/step/rank, 2 Psi (N-1)/N x 4 = %.0f B (%+.2f%%); "
                "%s\n",
                strategy.c_str(), n, static_cast<long long>(m.psi), m.buckets,
                static_cast<long long>(m.comm.totalBytes()), target, 100.0 * (m.comm.totalBytes() - target) / target,
                m.comm.toString().c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, StrategyCommTest,
                         ::testing::Combine(::testing::Values("no_shard", "zero1", "zero2"), ::testing::Values(2, 4)),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::get<0>(info.param) + "_world" + std::to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace tessera::sharding
