// Coalesced broadcasts and averages (tensor_sync.h): tensors of several dtypes and shapes
// in buckets smaller than one tensor, the values of the root or the mean on every rank.
#include <gtest/gtest.h>

#include "distributed/communicator.h"
#include "sharding/tensor_sync.h"
#include "tests/sharding/test_models.h"
#include "tests/support/multi_rank.h"

namespace tessera::sharding {
namespace {

using test::RankContext;
using test::runOnRanks;

TEST(TensorSyncTest, CoalescedBroadcastAndAverage) {
  testing::useOneThread();
  runOnRanks(3, [](RankContext& ctx) {
    const float v = static_cast<float>(ctx.rank + 1);
    std::vector<at::Tensor> ts = {at::full({3}, v), at::full({2, 2}, static_cast<int64_t>(ctx.rank)),
                                  at::full({}, v, at::kDouble), at::full({5}, v)};
    broadcastCoalesced(ts, *ctx.comm(), 2, /*bucketBytes=*/16);
    EXPECT_TRUE(ts[0].eq(3.0f).all().item<bool>());
    EXPECT_TRUE(ts[1].eq(2).all().item<bool>());
    EXPECT_EQ(ts[2].item<double>(), 3.0);
    EXPECT_TRUE(ts[3].eq(3.0f).all().item<bool>());
    std::vector<at::Tensor> avg = {at::full({4}, v), at::full({7}, 2 * v)};
    allReduceCoalesced(avg, *ctx.comm(), distributed::ReduceOp::kAvg, 1 << 20);
    EXPECT_TRUE(avg[0].eq(2.0f).all().item<bool>());
    EXPECT_TRUE(avg[1].eq(4.0f).all().item<bool>());
  });
}

}  // namespace
}  // namespace tessera::sharding
