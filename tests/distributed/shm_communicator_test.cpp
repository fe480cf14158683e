// The shm backend's own cases (the contracts every backend meets are in
// communicator_test.cpp): operations larger than a slot, bitwise agreement with gloo, a
// rank that skips or exits, a creation that fails on one rank, subgroups, destruction with
// an operation in flight.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "common/errors.h"
#include "distributed/communicator.h"
#include "distributed/gloo_communicator.h"
#include "distributed/shm_communicator.h"
#include "tests/support/multi_rank.h"

namespace tessera::distributed {
namespace {

using test::HarnessMode;
using test::HarnessOptions;
using test::RankContext;
using test::runOnRanks;

ShmOptions shmOptions(const RankContext& ctx, const std::string& name, int64_t slotBytes = int64_t{4} << 20) {
  ShmOptions options;
  options.comm = ctx.glooOptions(name).comm;
  options.slotBytes = slotBytes;
  return options;
}

HarnessOptions harness(HarnessMode mode) {
  HarnessOptions o;
  o.mode = mode;
  o.timeout = std::chrono::seconds(60);
  o.commTimeout = std::chrono::seconds(20);
  return o;
}

// A 64-byte slot: every operation runs in many pieces (16 floats a piece; 16 / N floats of
// each rank's chunk for a reduce-scatter), with sizes that do not divide by either. The
// results equal gloo's on the same inputs bit for bit: the sums are in rank order on
// both backends at two ranks, and data movement is exact at any size.
void piecesEqualGloo(HarnessMode mode, int world) {
  runOnRanks(world, [](RankContext& ctx) {
    auto shm = makeShmCommunicator(ctx.store, ctx.rank, ctx.world, shmOptions(ctx, "small_slot", 64));
    auto gloo = makeGlooCommunicator(ctx.store, ctx.rank, ctx.world, ctx.glooOptions("reference"));
    const int n = ctx.world;
    const int64_t c = 37;
    at::manual_seed(100 + ctx.rank);
    const at::Tensor mine = at::randn({n * c});

    at::Tensor a = at::empty({n * c}), b = at::empty({n * c});
    shm->allGatherInto(a, mine.narrow(0, 0, c));
    gloo->allGatherInto(b, mine.narrow(0, 0, c));
    EXPECT_TRUE(a.equal(b));

    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
      SCOPED_TRACE(reduceOpName(op));
      at::Tensor x = at::empty({c}), y = at::empty({c});
      shm->reduceScatter(x, mine, op);
      gloo->reduceScatter(y, mine, op);
      if (n == 2 || op == ReduceOp::kMax || op == ReduceOp::kMin) {
        EXPECT_TRUE(x.equal(y));
      } else {
        EXPECT_TRUE(at::allclose(x, y, 1e-6, 1e-6));
      }
      at::Tensor u = mine.clone(), v = mine.clone();
      shm->allReduce(u, op);
      gloo->allReduce(v, op);
      if (n == 2 || op == ReduceOp::kMax || op == ReduceOp::kMin) {
        EXPECT_TRUE(u.equal(v));
      } else {
        EXPECT_TRUE(at::allclose(u, v, 1e-6, 1e-6));
      }
    }
    // Every rank holds the same bits after a floating-point sum.
    at::Tensor sum = mine.clone();
    shm->allReduce(sum);
    at::Tensor all = at::empty({n * n * c});
    shm->allGatherInto(all, sum);
    for (int r = 1; r < n; ++r) EXPECT_TRUE(all.narrow(0, r * n * c, n * c).equal(all.narrow(0, 0, n * c)));

    at::Tensor bf = mine.to(at::kBFloat16), bfRef = mine.to(at::kBFloat16);
    shm->allReduce(bf, ReduceOp::kSum);
    gloo->allReduce(bfRef, ReduceOp::kSum);
    EXPECT_TRUE(bf.equal(bfRef));

    for (int root = 0; root < n; ++root) {
      at::Tensor t = ctx.rank == root ? mine.clone() : at::zeros({n * c});
      shm->broadcast(t, root);
      at::Tensor ref = ctx.rank == root ? mine.clone() : at::zeros({n * c});
      gloo->broadcast(ref, root);
      EXPECT_TRUE(t.equal(ref));
      at::Tensor g = ctx.rank == root ? at::empty({n * c}) : at::Tensor();
      shm->gatherToRoot(g, mine.narrow(0, 0, c), root);
      if (ctx.rank == root) {
        EXPECT_TRUE(g.equal(a));
      }
    }
  }, harness(mode));
}

TEST(ShmCommunicatorTest, PiecesEqualGlooThreads) { piecesEqualGloo(HarnessMode::kThreads, 3); }
TEST(ShmCommunicatorTest, PiecesEqualGlooProcesses) { piecesEqualGloo(HarnessMode::kProcesses, 2); }

// A rank that skips a collective: the others get TimeoutError naming it, not a hang.
TEST(ShmCommunicatorTest, SkippedCollectiveTimesOutNamingTheRank) {
  HarnessOptions o = harness(HarnessMode::kThreads);
  o.backend = "shm";
  o.commTimeout = std::chrono::seconds(1);
  runOnRanks(3, [](RankContext& ctx) {
    auto& comm = *ctx.comm();
    comm.barrier();
    if (ctx.rank == 2) return;
    at::Tensor t = at::ones({4});
    try {
      comm.allReduce(t);
      ADD_FAILURE() << "no timeout";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("rank(s) 2 "), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("allReduce"), std::string::npos) << e.what();
    }
    // The group is broken now: the next call says so at once.
    EXPECT_THROW(comm.barrier(), Error);
  }, o);
}

// A rank whose process exits: the others learn it within the liveness interval, long
// before the 20 s timeout, from an Error naming the rank.
TEST(ShmCommunicatorTest, ExitedRankIsNamed) {
  HarnessOptions o = harness(HarnessMode::kProcesses);
  o.backend = "shm";
  runOnRanks(2, [](RankContext& ctx) {
    auto& comm = *ctx.comm();
    comm.barrier();
    if (ctx.rank == 1) return;  // its process exits
    at::Tensor t = at::ones({4});
    const auto start = std::chrono::steady_clock::now();
    try {
      comm.allReduce(t);
      ADD_FAILURE() << "no error";
    } catch (const TimeoutError& e) {
      ADD_FAILURE() << "timed out instead of noticing the exit: " << e.what();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1 (process"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("exited"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  }, o);
}

// Rank 0 cannot create the segment (a name shm_open refuses): every rank throws the same
// Error naming rank 0, so a caller can fall back to gloo on all of them.
TEST(ShmCommunicatorTest, CreationFailureIsEveryRanksError) {
  runOnRanks(3, [](RankContext& ctx) {
    ShmOptions options = shmOptions(ctx, "bad_name");
    options.namePrefix = "/no/such/dir-";
    try {
      makeShmCommunicator(ctx.store, ctx.rank, ctx.world, options);
      ADD_FAILURE() << "created";
    } catch (const TimeoutError& e) {
      ADD_FAILURE() << e.what();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 0"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("/no/such/dir-"), std::string::npos) << e.what();
    }
    // The store and the ranks are fine: a gloo group is made right after.
    auto gloo = makeGlooCommunicator(ctx.store, ctx.rank, ctx.world, ctx.glooOptions("fallback"));
    gloo->barrier();
  }, harness(HarnessMode::kThreads));
}

TEST(ShmCommunicatorTest, SplitIntoSubgroups) {
  HarnessOptions o = harness(HarnessMode::kProcesses);
  o.backend = "shm";
  runOnRanks(4, [](RankContext& ctx) {
    auto& comm = *ctx.comm();
    const std::vector<int> mine = ctx.rank % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3};
    auto sub = comm.split(mine);
    EXPECT_EQ(sub->backendName(), "shm");
    EXPECT_EQ(sub->worldSize(), 2);
    at::Tensor t = at::full({3}, static_cast<float>(ctx.rank));
    sub->allReduce(t);
    EXPECT_TRUE(t.equal(at::full({3}, ctx.rank % 2 == 0 ? 2.0f : 4.0f)));
    comm.barrier();
  }, o);
}

// Destroying a communicator with an operation queued that its peer never joins: the
// handle, which outlives it, throws instead of hanging or touching freed memory.
TEST(ShmCommunicatorTest, DestroyedWithAnOperationInFlight) {
  runOnRanks(2, [](RankContext& ctx) {
    auto comm = makeShmCommunicator(ctx.store, ctx.rank, ctx.world, shmOptions(ctx, "doomed"));
    comm->barrier();
    if (ctx.rank == 1) return;
    at::Tensor t = at::ones({8});
    auto first = comm->allReduceAsync(t);
    auto second = comm->barrierAsync();
    comm.reset();
    EXPECT_THROW(first->wait(), Error);
    EXPECT_THROW(second->wait(), Error);
  }, harness(HarnessMode::kThreads));
}

}  // namespace
}  // namespace tessera::distributed
