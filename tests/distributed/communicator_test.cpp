// Collectives on the gloo and shm backends for world sizes 1-4, as threads and as processes:
// sizes that do not divide by the world size, empty shards, every ReduceOp, in-place
// forms, async handles, dtypes, the byte counters, and timeouts instead of hangs.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <tuple>

#include "common/errors.h"
#include "distributed/communicator.h"
#include "distributed/gloo_communicator.h"
#include "distributed/shm_communicator.h"
#include "distributed/store.h"
#include "tests/support/multi_rank.h"

namespace tessera::distributed {
namespace {

using test::HarnessMode;
using test::HarnessOptions;
using test::RankContext;
using test::runOnRanks;

// Global lengths around the world sizes: empty, smaller than N (ranks with no real rows),
// not divisible, divisible.
const std::vector<int64_t> kLengths = {0, 1, 5, 7, 12};

int64_t chunkOf(int64_t length, int world) { return (length + world - 1) / world; }

// Rank r's padded chunk of `global` (rows [r*c, min((r+1)*c, L)), zero padding to c).
at::Tensor paddedChunk(const at::Tensor& global, int rank, int world) {
  const int64_t length = global.size(0);
  const int64_t c = chunkOf(length, world);
  std::vector<int64_t> shape = global.sizes().vec();
  shape[0] = c;
  at::Tensor chunk = at::zeros(shape, global.options());
  const int64_t begin = std::min(length, rank * c);
  const int64_t end = std::min(length, (rank + 1) * c);
  if (end > begin) chunk.narrow(0, 0, end - begin).copy_(global.narrow(0, begin, end - begin));
  return chunk;
}

// The same "global" tensor on every rank: distinct, exactly representable values.
at::Tensor globalTensor(int64_t length, int64_t cols = 3) {
  return (at::arange(length * cols, at::kFloat) * 0.5f + 1.0f).view({length, cols});
}

// (world size, ranks as threads or processes, backend of ctx.comm())
class CollectivesTest : public ::testing::TestWithParam<std::tuple<int, HarnessMode, std::string>> {
 protected:
  int world() const { return std::get<0>(GetParam()); }
  HarnessOptions options() const {
    HarnessOptions o;
    o.mode = std::get<1>(GetParam());
    o.backend = std::get<2>(GetParam());
    o.timeout = std::chrono::seconds(60);
    o.commTimeout = std::chrono::seconds(20);
    return o;
  }
};

TEST_P(CollectivesTest, AllGatherIntoWithPaddingAndEmptyShards) {
  runOnRanks(world(), [](RankContext& ctx) {
    auto& comm = *ctx.comm();
    for (int64_t length : kLengths) {
      SCOPED_TRACE(strCat("length ", length));
      const at::Tensor global = globalTensor(length);
      const int64_t c = chunkOf(length, ctx.world);
      const at::Tensor local = paddedChunk(global, ctx.rank, ctx.world);
      at::Tensor flat = at::full({ctx.world * c, 3}, -1.0f);
      comm.allGatherInto(flat, local);
      EXPECT_TRUE(flat.narrow(0, 0, length).equal(global));
      EXPECT_TRUE(flat.narrow(0, length, ctx.world * c - length).eq(0).all().item<bool>()) << "padding is zeros";

      // In place: local_in is this rank's chunk of flat_out.
      at::Tensor inPlace = at::zeros({ctx.world * c, 3});
      at::Tensor mine = inPlace.narrow(0, ctx.rank * c, c);
      mine.copy_(local);
      comm.allGatherInto(inPlace, mine);
      EXPECT_TRUE(inPlace.equal(flat));
    }
  }, options());
}

TEST_P(CollectivesTest, ReduceScatterEveryOp) {
  runOnRanks(world(), [](RankContext& ctx) {
    auto& comm = *ctx.comm();
    const int n = ctx.world;
    for (int64_t length : kLengths) {
      SCOPED_TRACE(strCat("length ", length));
      const int64_t c = chunkOf(length, n);
      const at::Tensor base = at::arange(n * c, at::kFloat) + 1.0f;  // flat, padded length N*c
      const at::Tensor want = base.narrow(0, ctx.rank * c, c);

      at::Tensor out = at::full({c}, -7.0f);
      comm.reduceScatter(out, base * static_cast<float>(ctx.rank + 1), ReduceOp::kSum);
      EXPECT_TRUE(out.equal(want * static_cast<float>(n * (n + 1) / 2))) << out;

      comm.reduceScatter(out, base * static_cast<float>(ctx.rank + 1), ReduceOp::kAvg);
      EXPECT_TRUE(at::allclose(out, want * ((n + 1) / 2.0f))) << out;

      comm.reduceScatter(out, base + static_cast<float>(ctx.rank), ReduceOp::kMax);
      EXPECT_TRUE(out.equal(want + static_cast<float>(n - 1)));

      comm.reduceScatter(out, base + static_cast<float>(ctx.rank), ReduceOp::kMin);
      EXPECT_TRUE(out.equal(want));

      // In place: local_out is this rank's chunk of flat_in; the input is otherwise intact.
      at::Tensor flat = base * static_cast<float>(ctx.rank + 1);
      const at::Tensor before = flat.clone();
      at::Tensor myChunk = flat.narrow(0, ctx.rank * c, c);
      comm.reduceScatter(myChunk, flat, ReduceOp::kSum);
      EXPECT_TRUE(myChunk.equal(want * static_cast<float>(n * (n + 1) / 2)));
      for (int r = 0; r < n; ++r) {
        if (r != ctx.rank) {
          EXPECT_TRUE(flat.narrow(0, r * c, c).equal(before.narrow(0, r * c, c)));
        }
      }
    }
  }, options());
}

TEST_P(CollectivesTest, AllReduceEveryOpAndDtype) {
  runOnRanks(world(), [](RankContext& ctx) {
    auto& comm = *ctx.comm();
    const int n = ctx.world;
    const float r1 = static_cast<float>(ctx.rank + 1);
    at::Tensor t = at::full({7}, r1);
    comm.allReduce(t, ReduceOp::kSum);
    EXPECT_TRUE(t.equal(at::full({7}, n * (n + 1) / 2.0f)));
    t = at::full({2, 3}, r1);
    comm.allReduce(t, ReduceOp::kAvg);
    EXPECT_TRUE(at::allclose(t, at::full({2, 3}, (n + 1) / 2.0f)));
    t = at::full({5}, r1);
    comm.allReduce(t, ReduceOp::kMax);
    EXPECT_TRUE(t.equal(at::full({5}, static_cast<float>(n))));
    t = at::full({5}, r1);
    comm.allReduce(t, ReduceOp::kMin);
    EXPECT_TRUE(t.equal(at::full({5}, 1.0f)));

    at::Tensor scalar = at::scalar_tensor(r1, at::kDouble);
    comm.allReduce(scalar);
    EXPECT_EQ(scalar.item<double>(), n * (n + 1) / 2.0);
    at::Tensor longs = at::full({4}, int64_t{ctx.rank} + 1, at::kLong);
    comm.allReduce(longs);
    EXPECT_TRUE(longs.equal(at::full({4}, int64_t{n} * (n + 1) / 2, at::kLong)));
    // bfloat16: gloo cannot reduce it; it runs in float32 and is copied back.
    at::Tensor bf = at::full({6}, r1, at::kBFloat16);
    comm.allReduce(bf, ReduceOp::kAvg);
    EXPECT_TRUE(bf.to(at::kFloat).equal(at::full({6}, (n + 1) / 2.0f)));
    at::Tensor flags = at::zeros({3}, at::kBool);
    flags[ctx.rank % 3] = true;
    comm.allReduce(flags, ReduceOp::kMax);  // logical or
    for (int i = 0; i < 3; ++i) EXPECT_EQ(flags[i].item<bool>(), i < n) << i;
    at::Tensor empty = at::zeros({0});
    comm.allReduce(empty);
    // Integers have no average; complex numbers no maximum.
    EXPECT_THROW(comm.allReduce(longs, ReduceOp::kAvg), UsageError);
    at::Tensor complex = at::zeros({2}, at::kComplexFloat);
    EXPECT_THROW(comm.allReduce(complex, ReduceOp::kMax), UsageError);
  }, options());
}

// The split all-reduce (point-to-point reduce-scatter + all-gather) against Gloo's own, on
// two communicators forced to one or the other: every op, floating dtypes, lengths that do
// not divide by the world size (padded) and that do; every rank ends bitwise equal.
// gloo's own options: instantiated for the gloo backend only.
class GlooCollectivesTest : public CollectivesTest {};

TEST_P(GlooCollectivesTest, SplitAllReduceMatchesGlooAllReduce) {
  runOnRanks(world(), [](RankContext& ctx) {
    GlooOptions splitOptions = ctx.glooOptions("split");
    splitOptions.splitAllReduceFromBytes = 0;
    splitOptions.splitAllReduceBelowBytes = std::numeric_limits<int64_t>::max();
    GlooOptions glooOnly = ctx.glooOptions("gloo_only");
    glooOnly.splitAllReduceBelowBytes = 0;
    auto split = makeGlooCommunicator(ctx.store, ctx.rank, ctx.world, splitOptions);
    auto gloo = makeGlooCommunicator(ctx.store, ctx.rank, ctx.world, glooOnly);
    for (at::ScalarType type : {at::kFloat, at::kDouble, at::kBFloat16}) {
      for (int64_t length : {1, 7, 12, 70001}) {
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
          const std::string what = strCat(at::toString(type), " x ", length, " ", reduceOpName(op));
          at::manual_seed(static_cast<uint64_t>(1000 + ctx.rank));
          const at::Tensor input = at::randn({length}).to(type);
          at::Tensor bySplit = input.clone(), byGloo = input.clone();
          auto handle = split->allReduceAsync(bySplit, op);
          handle->wait();
          EXPECT_TRUE(handle->isCompleted());
          gloo->allReduce(byGloo, op);
          const bool exact = op == ReduceOp::kMax || op == ReduceOp::kMin;
          const double tolerance = type == at::kBFloat16 ? 1e-2 : 1e-5;
          EXPECT_TRUE(exact ? bySplit.equal(byGloo)
                            : at::allclose(bySplit.to(at::kDouble), byGloo.to(at::kDouble), tolerance, tolerance))
              << what << " rank " << ctx.rank;
          // Bitwise the same on every rank: the largest and smallest over ranks are it.
          at::Tensor high = bySplit.to(at::kDouble), low = high.clone();
          gloo->allReduce(high, ReduceOp::kMax);
          gloo->allReduce(low, ReduceOp::kMin);
          EXPECT_TRUE(high.equal(bySplit.to(at::kDouble)) && low.equal(high)) << what << " rank " << ctx.rank;
        }
      }
    }
  }, options());
}

TEST_P(CollectivesTest, BroadcastFromEveryRoot) {
  runOnRanks(world(), [](RankContext& ctx) {
    auto& comm = *ctx.comm();
    for (int root = 0; root < ctx.world; ++root) {
      const at::Tensor want = at::arange(10, at::kFloat).view({2, 5}) + 100.0f * root;
      at::Tensor t = ctx.rank == root ? want.clone() : at::zeros({2, 5});
      comm.broadcast(t, root);
      EXPECT_TRUE(t.equal(want)) << "root " << root;
    }
    // Any dtype: bytes are moved as they are.
    at::Tensor flags = at::full({4}, ctx.rank == 0, at::kBool);
    comm.broadcast(flags, 0);
    EXPECT_TRUE(flags.all().item<bool>());
  }, options());
}

TEST_P(CollectivesTest, GatherToRoot) {
  runOnRanks(world(), [](RankContext& ctx) {
    auto& comm = *ctx.comm();
    for (int root : {0, ctx.world - 1}) {
      for (int64_t length : kLengths) {
        const at::Tensor global = globalTensor(length, 2);
        const int64_t c = chunkOf(length, ctx.world);
        const at::Tensor local = paddedChunk(global, ctx.rank, ctx.world);
        at::Tensor out = ctx.rank == root ? at::full({ctx.world * c, 2}, -1.0f) : at::Tensor();
        comm.gatherToRoot(out, local, root);
        if (ctx.rank == root) {
          EXPECT_TRUE(out.narrow(0, 0, length).equal(global)) << "root " << root << " length " << length;
        }
      }
    }
    comm.barrier();
  }, options());
}

TEST_P(CollectivesTest, ByteCountersAreRingVolumes) {
  runOnRanks(world(), [](RankContext& ctx) {
    auto& comm = *ctx.comm();
    const int n = ctx.world;
    const int64_t full = 10;  // elements of the full tensor: chunk 3 for N=4 (padded to 12)
    const int64_t c = chunkOf(full, n);
    comm.resetStats();
    EXPECT_EQ(comm.stats().totalBytes(), 0);

    at::Tensor flat = at::zeros({n * c});
    comm.allGatherInto(flat, at::ones({c}));
    comm.reduceScatter(at::empty({c}), at::ones({n * c}));
    at::Tensor t = at::ones({full});
    comm.allReduce(t);
    comm.broadcast(t, 0);
    at::Tensor gathered = ctx.rank == 0 ? at::empty({n * c}) : at::Tensor();
    comm.gatherToRoot(gathered, at::ones({c}), 0);
    comm.barrier();

    const CommStats s = comm.stats();
    const int64_t flatBytes = n * c * 4;
    // (N-1)/N of the (padded) full tensor per rank, for all-gather and reduce-scatter.
    EXPECT_EQ(s[CommOp::kAllGather].bytes, (n - 1) * flatBytes / n);
    EXPECT_EQ(s[CommOp::kReduceScatter].bytes, (n - 1) * flatBytes / n);
    EXPECT_EQ(s[CommOp::kAllReduce].bytes, 2 * (n - 1) * full * 4 / n);
    EXPECT_EQ(s[CommOp::kBroadcast].bytes, ctx.rank == 0 && n > 1 ? full * 4 : 0);
    EXPECT_EQ(s[CommOp::kGather].bytes, ctx.rank == 0 ? 0 : c * 4);
    EXPECT_EQ(s[CommOp::kBarrier].bytes, 0);
    for (int op = 0; op < kNumCommOps; ++op) EXPECT_EQ(s.ops[static_cast<size_t>(op)].calls, 1) << op;
    EXPECT_EQ(s.totalCalls(), kNumCommOps);
    comm.resetStats();
    EXPECT_EQ(comm.stats().totalBytes(), 0);
    EXPECT_EQ(comm.stats().totalCalls(), 0);
  }, options());
}

TEST_P(CollectivesTest, AsyncHandlesOverlap) {
  runOnRanks(world(), [](RankContext& ctx) {
    auto& comm = *ctx.comm();
    const int n = ctx.world;
    const int64_t c = 5;
    // An all-gather (prefetch) and a reduce-scatter (gradients) in flight together,
    // waited in the opposite order.
    at::Tensor gathered = at::zeros({n * c});
    const at::Tensor local = at::full({c}, static_cast<float>(ctx.rank));
    at::Tensor grads = at::arange(n * c, at::kFloat);
    at::Tensor shard = at::zeros({c});
    auto ag = comm.allGatherIntoAsync(gathered, local);
    auto rs = comm.reduceScatterAsync(shard, grads, ReduceOp::kAvg);
    at::Tensor loss = at::arange(c, at::kFloat);  // not grads: in-flight buffers are off limits
    auto ar = comm.allReduceAsync(loss, ReduceOp::kSum);
    rs->wait();
    ag->wait();
    EXPECT_TRUE(ag->isCompleted());
    EXPECT_TRUE(rs->isCompleted());
    ag->wait();  // idempotent
    EXPECT_TRUE(gathered.equal(at::arange(n, at::kFloat).repeat_interleave(c)));
    EXPECT_TRUE(at::allclose(shard, at::arange(ctx.rank * c, (ctx.rank + 1) * c, at::kFloat)));
    ar->wait();
    EXPECT_TRUE(loss.equal(at::arange(c, at::kFloat) * static_cast<float>(n)));
    comm.barrierAsync()->wait();
  }, options());
}

TEST_P(CollectivesTest, AnyDtypeMovesAsBytes) {
  runOnRanks(world(), [](RankContext& ctx) {
    auto& comm = *ctx.comm();
    const int n = ctx.world;
    for (auto type : {at::kBool, at::kBFloat16, at::kHalf, at::kLong, at::kByte, at::kDouble}) {
      SCOPED_TRACE(c10::toString(type));
      const at::Tensor local = (at::arange(3, at::kLong) + ctx.rank).remainder(2).to(type);
      at::Tensor flat = at::zeros({n * 3}, type);
      comm.allGatherInto(flat, local);
      for (int r = 0; r < n; ++r) {
        EXPECT_TRUE(flat.narrow(0, r * 3, 3).equal((at::arange(3, at::kLong) + r).remainder(2).to(type)));
      }
    }
    // bfloat16 reduce-scatter: the local reduction runs in LibTorch (any dtype).
    at::Tensor out = at::zeros({2}, at::kBFloat16);
    comm.reduceScatter(out, at::ones({n * 2}, at::kBFloat16), ReduceOp::kSum);
    EXPECT_TRUE(out.to(at::kFloat).equal(at::full({2}, static_cast<float>(n))));
  }, options());
}

std::string paramName(const ::testing::TestParamInfo<std::tuple<int, HarnessMode, std::string>>& info) {
  return strCat("World", std::get<0>(info.param),
                std::get<1>(info.param) == HarnessMode::kThreads ? "Threads" : "Processes");
}

INSTANTIATE_TEST_SUITE_P(Gloo, CollectivesTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(HarnessMode::kThreads, HarnessMode::kProcesses),
                                            ::testing::Values(std::string("gloo"))),
                         paramName);
INSTANTIATE_TEST_SUITE_P(Gloo, GlooCollectivesTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(HarnessMode::kThreads, HarnessMode::kProcesses),
                                            ::testing::Values(std::string("gloo"))),
                         paramName);
// The same contracts on the shared-memory backend (its own cases: shm_communicator_test.cpp).
INSTANTIATE_TEST_SUITE_P(Shm, CollectivesTest,
                         ::testing::Combine(::testing::Values(2, 3, 4),
                                            ::testing::Values(HarnessMode::kThreads, HarnessMode::kProcesses),
                                            ::testing::Values(std::string("shm"))),
                         paramName);

// ---- argument checks, timeouts, sub-communicators ---------------------------------

TEST(CommunicatorTest, RejectsBadArgumentsBeforeSending) {
  runOnRanks(2, [](RankContext& ctx) {
    auto& comm = *ctx.comm();
    EXPECT_THROW(comm.allGatherInto(at::zeros({5}), at::zeros({3})), UsageError);  // not 2 x 3
    EXPECT_THROW(comm.allGatherInto(at::zeros({6}, at::kDouble), at::zeros({3})), UsageError);
    EXPECT_THROW(comm.reduceScatter(at::zeros({3}), at::zeros({7})), UsageError);
    EXPECT_THROW(comm.allReduce(at::zeros({4, 4}).t()), UsageError);  // not contiguous
    EXPECT_THROW(comm.allReduce(at::Tensor()), UsageError);
    EXPECT_THROW(comm.broadcast(at::zeros({2}), 2), UsageError);
    EXPECT_THROW(comm.gatherToRoot(at::Tensor(), at::zeros({2}), -1), UsageError);
    if (ctx.rank == 0) {
      EXPECT_THROW(comm.gatherToRoot(at::zeros({3}), at::zeros({2}), 0), UsageError);
    }
    try {
      comm.allGatherInto(at::zeros({5}), at::zeros({3}));
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("Communicator::allGatherInto"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("pad the chunks"), std::string::npos) << e.what();
    }
    // Nothing was sent: the group still works.
    at::Tensor t = at::ones({2});
    comm.allReduce(t);
    EXPECT_TRUE(t.equal(at::full({2}, 2.0f)));
    EXPECT_EQ(comm.backendName(), "gloo");
    EXPECT_EQ(comm.rank(), ctx.rank);
    EXPECT_EQ(comm.worldSize(), 2);
  });
}

// One rank skips a collective: the others get TimeoutError naming the operation, their
// rank and the size, within the timeout; the group is then marked unusable.
void skippedCollectiveTimesOut(HarnessMode mode, int world) {
  HarnessOptions options;
  options.mode = mode;
  options.commTimeout = std::chrono::seconds(1);
  options.timeout = std::chrono::seconds(30);
  runOnRanks(world, [](RankContext& ctx) {
    auto& comm = *ctx.comm();
    const int skipper = ctx.world - 1;
    if (ctx.rank == skipper) {
      // Stay alive (a closed connection would fail the others at once, not time out).
      ctx.store->wait({"others_done"}, std::chrono::seconds(20));
      return;
    }
    at::Tensor t = at::ones({64});
    const auto start = std::chrono::steady_clock::now();
    try {
      comm.allReduce(t);
      ADD_FAILURE() << "allReduce returned although rank " << skipper << " never joined";
    } catch (const TimeoutError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("GlooCommunicator::allReduce"), std::string::npos) << message;
      EXPECT_NE(message.find(strCat("rank ", ctx.rank, " of ", ctx.world)), std::string::npos) << message;
      EXPECT_NE(message.find("256 B"), std::string::npos) << message;
      EXPECT_NE(message.find("timed out after 1 s"), std::string::npos) << message;
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(seconds, 5.0);
    try {
      comm.barrier();
      ADD_FAILURE() << "a broken communicator accepted another collective";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("unusable"), std::string::npos) << e.what();
    }
    if (ctx.store->add("timed_out", 1) == ctx.world - 1) ctx.store->set("others_done", "1");
  }, options);
}

TEST(CommunicatorTest, SkippedCollectiveTimesOutThreads) { skippedCollectiveTimesOut(HarnessMode::kThreads, 2); }
TEST(CommunicatorTest, SkippedCollectiveTimesOutProcesses) { skippedCollectiveTimesOut(HarnessMode::kProcesses, 3); }

// Ranks as processes whose collectives time out after 20 s: a wait that ends well before
// was ended by something else.
HarnessOptions processesWithALongTimeout() {
  HarnessOptions options;
  options.mode = HarnessMode::kProcesses;
  options.commTimeout = std::chrono::seconds(20);
  options.timeout = std::chrono::seconds(60);
  return options;
}

// fault.survive over gloo: a rank whose peer never joins, then abortCommunicators() in its
// process (another thread, as ReplicaGroups' watcher does), leaves the collective at once
// with PeerLostError, not at the 20 s timeout; a communicator made after the abort works.
// Ranks as processes: the abort is process-wide.
TEST(CommunicatorTest, AbortEndsAGlooWaitWithPeerLost) {
  runOnRanks(2, [](RankContext& ctx) {
    auto& comm = *ctx.comm();
    EXPECT_EQ(comm.backendName(), "gloo");
    if (ctx.rank == 0) {
      std::thread aborter([] {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        distributed::abortCommunicators();
      });
      at::Tensor t = at::ones({64});
      const auto start = std::chrono::steady_clock::now();
      try {
        comm.allReduce(t);
        ADD_FAILURE() << "allReduce returned although rank 1 never joined";
      } catch (const PeerLostError& e) {
        EXPECT_NE(std::string(e.what()).find("aborted by this process"), std::string::npos) << e.what();
      }
      aborter.join();
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_LT(seconds, 5.0) << "the abort, not the group's 20 s";
      ctx.store->set("aborted", "1");
    } else {
      ctx.store->wait({"aborted"}, std::chrono::seconds(30));
    }
    // Both ranks: a new group, made after the abort, is not affected by it.
    distributed::GlooOptions gloo;
    gloo.hostname = "127.0.0.1";
    gloo.comm.name = "after_abort";
    auto fresh = makeGlooCommunicator(ctx.store, ctx.rank, ctx.world, gloo);
    at::Tensor t = at::ones({4});
    fresh->allReduce(t);
    EXPECT_TRUE(at::equal(t, at::full({4}, 2.0)));
  }, processesWithALongTimeout());
}

// fault.survive: a group whose build waits for a peer that never comes (lost before it
// built its side; no backend watches peers yet) is ended by abortCommunicators() from
// another thread (ReplicaGroups' watcher) with PeerLostError, not at its 20 s timeout; and
// a group of an earlier generation (CommOptions::abortGeneration: the one its caller saw)
// fails at once when the abort came before its build began.
void anAbortEndsTheBuildOfAGroup(const std::string& backend) {
  runOnRanks(2, [backend](RankContext& ctx) {
    if (ctx.rank == 1) {
      ctx.store->wait({"done"}, std::chrono::seconds(30));  // alive, but never builds
      return;
    }
    const auto build = [&](const std::string& name, std::optional<uint64_t> generation) {
      distributed::CommOptions comm;
      comm.name = name;
      comm.timeout = std::chrono::seconds(20);
      comm.abortGeneration = generation;
      if (backend == "gloo") {
        distributed::GlooOptions gloo;
        gloo.hostname = "127.0.0.1";
        gloo.comm = comm;
        return makeGlooCommunicator(ctx.store, 0, 2, gloo);
      }
      distributed::ShmOptions shm;
      shm.comm = comm;
      return distributed::makeShmCommunicator(ctx.store, 0, 2, shm);
    };
    std::thread aborter([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      distributed::abortCommunicators();
    });
    auto start = std::chrono::steady_clock::now();
    try {
      build("never_complete", std::nullopt);
      ADD_FAILURE() << "a " << backend << " group was built although rank 1 never came";
    } catch (const PeerLostError& e) {
      EXPECT_NE(std::string(e.what()).find("aborted by this process"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("never_complete"), std::string::npos) << e.what();
    }
    aborter.join();
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0)
        << "the abort, not the group's 20 s";
    const uint64_t seen = distributed::commAbortGeneration();
    distributed::abortCommunicators();  // before the build below begins
    start = std::chrono::steady_clock::now();
    EXPECT_THROW(build("too_late", seen), PeerLostError);
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
    ctx.store->set("done", "1");
  }, processesWithALongTimeout());
}

TEST(CommunicatorTest, AnAbortEndsTheBuildOfAShmGroup) { anAbortEndsTheBuildOfAGroup("shm"); }
TEST(CommunicatorTest, AnAbortEndsTheBuildOfAGlooGroup) { anAbortEndsTheBuildOfAGroup("gloo"); }

// A gloo peer that goes away mid-run (its group destroyed, as when its process exits): the
// other's wait ends with PeerLostError (its connection closed), long before the timeout.
TEST(CommunicatorTest, AGlooPeerThatGoesAwayIsLost) {
  runOnRanks(2, [](RankContext& ctx) {
    auto& comm = *ctx.comm();
    at::Tensor t = at::ones({64});
    comm.allReduce(t);  // connected
    if (ctx.rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      return;  // its communicator and connections go with its context
    }
    const auto start = std::chrono::steady_clock::now();
    EXPECT_THROW(comm.allReduce(t), PeerLostError);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(seconds, 5.0) << "the closed connection, not the group's 20 s";
  }, processesWithALongTimeout());
}

// A TimeoutScope gives the collectives its thread issues its own timeout (the trainer's
// checkpoint collectives), shorter or longer than the communicator's.
TEST(CommunicatorTest, TimeoutScopeOverridesTheGroupsTimeout) {
  HarnessOptions options;
  options.commTimeout = std::chrono::seconds(20);
  options.timeout = std::chrono::seconds(40);
  runOnRanks(2, [](RankContext& ctx) {
    auto& comm = *ctx.comm();
    if (ctx.rank == 1) {
      ctx.store->wait({"rank0_done"}, std::chrono::seconds(30));
      return;
    }
    at::Tensor t = at::ones({8});
    const auto start = std::chrono::steady_clock::now();
    {
      const distributed::TimeoutScope scope(std::chrono::milliseconds(500));
      EXPECT_THROW(comm.allReduce(t), TimeoutError);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(seconds, 5.0) << "the scope's 0.5 s, not the group's 20 s";
    ctx.store->set("rank0_done", "1");
  }, options);
  EXPECT_THROW(distributed::TimeoutScope(std::chrono::milliseconds(0)), UsageError);
}

// CommOptions::checkCollectives: agreeing calls run as usual; a disagreement (size, op,
// root) is an Error on every rank naming who issued what, and the group is then unusable.
TEST(CommunicatorTest, CheckedCollectivesNameTheDisagreement) {
  runOnRanks(3, [](RankContext& ctx) {
    GlooOptions options = ctx.glooOptions("checked");
    options.comm.checkCollectives = true;
    auto comm = makeGlooCommunicator(ctx.store, ctx.rank, ctx.world, options);
    at::Tensor t = at::ones({5});
    comm->allReduce(t);
    EXPECT_TRUE(at::equal(t, at::full({5}, 3.0f)));
    at::Tensor b = at::full({2}, static_cast<float>(ctx.rank));
    comm->broadcast(b, 1);
    EXPECT_TRUE(at::equal(b, at::full({2}, 1.0f)));
    try {
      comm->broadcast(b, ctx.rank == 2 ? 0 : 1);  // rank 2 names another root
      ADD_FAILURE() << "a disagreeing broadcast ran";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("ranks disagree on operation #2 of gloo group 'checked' rank " +
                                           std::to_string(ctx.rank) +
                                           " of 3: ranks 0, 1 broadcast Float x2 root 1; rank 2 broadcast Float x2 root 0"),
                std::string::npos)
          << e.what();
    }
    EXPECT_THROW(comm->barrier(), Error);  // unusable afterwards
  });
}

// A subgroup knows its members as world ranks (the flight recorder labels its entries so).
TEST(CommunicatorTest, SplitRecordsItsMembersAsWorldRanks) {
  runOnRanks(4, [](RankContext& ctx) {
    auto world = ctx.comm();
    EXPECT_EQ(world->members(), (std::vector<int>{0, 1, 2, 3}));
    if (ctx.rank == 0) return;
    auto sub = world->split({3, 1, 2});  // world ranks 3, 1, 2
    if (ctx.rank == 2) return;
    auto inner = sub->split({1, 0});     // sub ranks 1, 0 = world ranks 1, 3
    EXPECT_EQ(inner->members(), (std::vector<int>{1, 3}));
    EXPECT_EQ(inner->members()[static_cast<size_t>(inner->rank())], ctx.rank);
  });
}

TEST(CommunicatorTest, MissingRankTimesOutAtCreation) {
  HarnessOptions options;
  options.commTimeout = std::chrono::seconds(1);
  runOnRanks(3, [](RankContext& ctx) {
    if (ctx.rank == 1) return;  // never creates the communicator
    try {
      ctx.comm();
      ADD_FAILURE() << "created a group without rank 1";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1 of 3"), std::string::npos) << e.what();
    }
  }, options);
}

TEST(CommunicatorTest, SplitIntoSubgroups) {
  runOnRanks(4, [](RankContext& ctx) {
    auto world = ctx.comm();
    // Only the members of a subset call split(); ranks 1 and 3 form a second group.
    const std::vector<int> members = ctx.rank % 2 == 0 ? std::vector<int>{2, 0} : std::vector<int>{1, 3};
    auto sub = world->split(members);
    EXPECT_EQ(sub->worldSize(), 2);
    EXPECT_EQ(members[static_cast<size_t>(sub->rank())], ctx.rank) << "group rank i is members[i]";
    at::Tensor t = at::full({3}, static_cast<float>(ctx.rank));
    sub->allReduce(t);
    const float want = ctx.rank % 2 == 0 ? 2.0f : 4.0f;
    EXPECT_TRUE(t.equal(at::full({3}, want)));
    at::Tensor flat = at::zeros({2});
    sub->allGatherInto(flat, at::full({1}, static_cast<float>(ctx.rank)));
    EXPECT_EQ(flat[0].item<float>(), static_cast<float>(members[0]));
    EXPECT_EQ(flat[1].item<float>(), static_cast<float>(members[1]));
    // The same subset again is a new, independent group (the store keys do not collide).
    auto again = world->split(members);
    at::Tensor u = at::ones({1});
    again->allReduce(u);
    EXPECT_EQ(u.item<float>(), 2.0f);
    // A group of one needs nobody else.
    auto alone = world->split({ctx.rank});
    EXPECT_EQ(alone->worldSize(), 1);
    at::Tensor v = at::full({2}, 5.0f);
    alone->allReduce(v, ReduceOp::kAvg);
    EXPECT_TRUE(v.equal(at::full({2}, 5.0f)));
    // Stats are per communicator.
    EXPECT_EQ(sub->stats()[CommOp::kAllReduce].calls, 1);
    EXPECT_EQ(world->stats()[CommOp::kAllReduce].calls, 0);

    EXPECT_THROW(world->split({}), UsageError);
    EXPECT_THROW(world->split({ctx.rank, ctx.rank}), UsageError);
    EXPECT_THROW(world->split({ctx.rank, 4}), UsageError);
    EXPECT_THROW(world->split({(ctx.rank + 1) % 4}), UsageError);  // caller not a member
    world->barrier();
  });
}

// An nccl group's CPU traffic (checkpoints, agreement) goes over its host twin; here a
// second gloo group stands in for the twin (no GPU needed): host() answers it, every split
// has the split of the twin as its own, and allReduceHostTensor works on either.
TEST(CommunicatorTest, HostTwinFollowsSplits) {
  runOnRanks(4, [](RankContext& ctx) {
    auto world = ctx.comm();
    EXPECT_EQ(world->host().get(), world.get()) << "a gloo group is its own host";
    EXPECT_TRUE(world->tensorDevice().is_cpu());
    auto twin = makeGlooCommunicator(ctx.store, ctx.rank, ctx.world, ctx.glooOptions("twin"));
    world->setHost(twin);
    EXPECT_EQ(world->host().get(), twin.get());

    const std::vector<int> members = ctx.rank < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
    auto sub = world->split(members);
    auto subHost = sub->host();
    ASSERT_NE(subHost.get(), sub.get());
    EXPECT_EQ(subHost->worldSize(), 2);
    EXPECT_EQ(subHost->rank(), sub->rank());
    EXPECT_NE(subHost->describe().find("twin/split[" + std::to_string(members[0]) + "," +
                                       std::to_string(members[1]) + "]"),
              std::string::npos)
        << subHost->describe();
    at::Tensor t = at::full({2}, static_cast<double>(ctx.rank), at::kDouble);
    allReduceHostTensor(*sub, t, ReduceOp::kSum);
    EXPECT_TRUE(t.equal(at::full({2}, static_cast<double>(members[0] + members[1]), at::kDouble)));
    EXPECT_EQ(sub->stats()[CommOp::kAllReduce].calls, 1);
    subHost->allReduce(t, ReduceOp::kMax);
    EXPECT_EQ(subHost->stats()[CommOp::kAllReduce].calls, 1);
    auto alone = world->split({ctx.rank});
    EXPECT_EQ(alone->host()->worldSize(), 1);

    // A twin must be of the same rank and size.
    auto other = world->split(members);
    EXPECT_THROW(other->setHost(twin), UsageError);
    EXPECT_THROW(world->setHost(nullptr), UsageError);
    world->barrier();
  });
}

TEST(CommunicatorTest, FactoryErrors) {
  auto store = Store::createInProcess();
  EXPECT_THROW(makeCommunicator("mpi", store, 0, 1), ConfigError);
  if (!ncclAvailable()) {
    try {
      makeCommunicator("nccl", store, 0, 1);
      ADD_FAILURE() << "nccl without CUDA";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("TESSERA_WITH_CUDA"), std::string::npos) << e.what();
    }
  }
  auto comm = makeCommunicator("gloo", store, 0, 1);
  EXPECT_EQ(comm->backendName(), "gloo");
  EXPECT_EQ(comm->worldSize(), 1);
  at::Tensor flat = at::zeros({3});
  comm->allGatherInto(flat, at::ones({3}));
  EXPECT_TRUE(flat.equal(at::ones({3})));
  EXPECT_EQ(comm->stats().totalBytes(), 0) << "a world of one sends nothing";
}

// One rank with CommOptions::singleRankShortcut off (the step bench measures a GPU run's
// collectives this way): every collective goes through gloo, the large ones through the
// point-to-point paths (reduce-scatter, all-gather, the split all-reduce), which have no
// peer to talk to (a receive from itself segfaulted).
TEST(CommunicatorTest, OneRankWithoutTheShortcutGoesThroughGloo) {
  GlooOptions options;
  options.comm.singleRankShortcut = false;
  options.splitAllReduceFromBytes = 1 << 20;  // the point-to-point all-reduce for the large size
  options.splitAllReduceBelowBytes = int64_t{1} << 30;
  auto comm = makeGlooCommunicator(Store::createInProcess(), 0, 1, options);
  for (int64_t n : {int64_t{5}, int64_t{3} << 20}) {  // below and above the point-to-point size
    SCOPED_TRACE(strCat(n, " elements"));
    const at::Tensor values = at::arange(n, at::kFloat).remainder(1000.0f);
    at::Tensor out = at::full({n}, -1.0f);
    comm->reduceScatter(out, values, ReduceOp::kSum);
    EXPECT_TRUE(out.equal(values));
    comm->reduceScatter(out, values, ReduceOp::kAvg);
    EXPECT_TRUE(out.equal(values));
    at::Tensor gathered = at::full({n}, -1.0f);
    comm->allGatherInto(gathered, values);
    EXPECT_TRUE(gathered.equal(values));
    at::Tensor reduced = values.clone();
    comm->allReduce(reduced, ReduceOp::kSum);
    EXPECT_TRUE(reduced.equal(values));
    const at::Tensor half = values.to(at::kBFloat16);
    at::Tensor halfOut = at::zeros({n}, at::kBFloat16);
    comm->reduceScatter(halfOut, half, ReduceOp::kSum);
    EXPECT_TRUE(halfOut.equal(half));
  }
  EXPECT_EQ(comm->stats().totalCalls(), 10);
}

}  // namespace
}  // namespace tessera::distributed
