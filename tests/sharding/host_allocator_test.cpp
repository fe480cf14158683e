// The caching host allocator (sharding/host_allocator.h): a freed large block is handed
// to the next request it fits (at most 1/8 larger) without a new mapping; a request no
// cached block fits maps anew, after cached blocks are unmapped down to the most ever in
// use at once plus one largest block; so a pattern of sizes that changes over a step
// keeps its blocks; small blocks stay with malloc. Measured by its own counters, as
// differences (other tests in this process hold memory of their own).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "sharding/host_allocator.h"

namespace tessera::sharding {
namespace {

constexpr int64_t kOneMiB = int64_t{1} << 20;

at::Tensor bytes(int64_t n) { return at::empty({n}, at::kByte); }

TEST(HostAllocatorTest, ReusesFreedBlocksAndKeepsOneBlockAboveThePeak) {
  useCachingHostAllocator();
  const HostCacheStats start = hostCacheStats();

  // A freed block is cached, then handed out again: same memory, no new mapping.
  void* first = nullptr;
  {
    at::Tensor a = bytes(3 * kOneMiB);
    first = a.data_ptr();
    EXPECT_EQ(hostCacheStats().inUseBytes - start.inUseBytes, 3 * kOneMiB);
  }
  const HostCacheStats freed = hostCacheStats();
  EXPECT_EQ(freed.cachedBytes - start.cachedBytes, 3 * kOneMiB);
  EXPECT_EQ(freed.inUseBytes, start.inUseBytes);
  {
    at::Tensor again = bytes(3 * kOneMiB - 5000);  // smaller, within 1/8: the same block
    EXPECT_EQ(again.data_ptr(), first);
    EXPECT_EQ(hostCacheStats().mappedBytes, freed.mappedBytes);
    EXPECT_EQ(hostCacheStats().cachedBytes, start.cachedBytes);
  }

  // A request the cached block does not fit (it is over 1/8 larger than 1 MiB) maps a
  // new block of its own.
  const HostCacheStats before = hostCacheStats();
  ASSERT_EQ(before.cachedBytes - start.cachedBytes, 3 * kOneMiB);
  {
    at::Tensor small = bytes(kOneMiB);
    const HostCacheStats now = hostCacheStats();
    EXPECT_EQ(now.mappings - before.mappings, 1);
    EXPECT_EQ(now.inUseBytes - before.inUseBytes, kOneMiB);
  }

  // Blocks below 1 MiB are malloc's: the allocator's counters do not move.
  const HostCacheStats mallocs = hostCacheStats();
  {
    at::Tensor tiny = bytes(kOneMiB / 2);
    EXPECT_EQ(hostCacheStats().inUseBytes, mallocs.inUseBytes);
    EXPECT_EQ(hostCacheStats().mappedBytes, mallocs.mappedBytes);
  }

  // A step that holds one 8 MiB block, then two 4 MiB ones (zero3: a unit gathered, then
  // its gradient chunks), again and again: the blocks of both phases stay mapped (the
  // peak in use plus one largest block holds them), so only the first round maps. Without
  // the slack every round unmapped one phase's blocks to map the other's.
  const auto round = [] {
    { at::Tensor unit = bytes(8 * kOneMiB); }
    at::Tensor a = bytes(4 * kOneMiB), b = bytes(4 * kOneMiB);
  };
  round();
  const HostCacheStats afterFirst = hostCacheStats();
  for (int i = 0; i < 10; ++i) round();
  EXPECT_EQ(hostCacheStats().mappings, afterFirst.mappings) << "a round mapped memory again";
  EXPECT_EQ(hostCacheStats().mappedBytes, afterFirst.mappedBytes);

  // The data survives reuse like any allocation's: what is written is read back.
  at::Tensor x = at::arange(2 * kOneMiB / 4, at::kInt);
  at::Tensor y = x.clone();
  EXPECT_TRUE(x.equal(y));
}

}  // namespace
}  // namespace tessera::sharding
