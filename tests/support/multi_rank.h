// Multi-rank test harness: runs one test body on N ranks, as threads of this process over
// an in-process store, or as forked processes over a TCPStore on a free port, and turns a
// failure on any rank into one test failure naming that rank.
//
//   runOnRanks(4, [](RankContext& ctx) {
//     auto t = at::full({3}, float(ctx.rank));
//     ctx.comm()->allReduce(t);
//     EXPECT_TRUE(t.equal(at::full({3}, 6.f)));
//   }, {HarnessMode::kProcesses});
//
// Failures: an exception escaping the body, or a GoogleTest assertion failing inside it
// (in process mode the child's gtest results would be lost, so they are captured and sent
// to the parent). runOnRanks throws RankFailure with the first failing rank's message
// (first in time: the root cause; later ranks usually fail because of it).
//
// Never hangs: every collective of ctx.comm() has HarnessOptions::commTimeout, and the
// whole run has HarnessOptions::timeout. On that timeout, process mode kills the
// children (SIGKILL) and reports the ranks still running; thread mode sets
// ctx.cancelled(), reports the ranks still running, waits a grace period
// (commTimeout) for them to end and detaches the ones that do not: a thread cannot be
// killed, so a body must not block without a timeout.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/errors.h"
#include "distributed/communicator.h"
#include "distributed/gloo_communicator.h"
#include "distributed/store.h"

namespace tessera::test {

enum class HarnessMode { kThreads, kProcesses };
const char* harnessModeName(HarnessMode mode);

struct HarnessOptions {
  HarnessMode mode = HarnessMode::kThreads;
  // The whole run, all ranks.
  std::chrono::milliseconds timeout = std::chrono::seconds(60);
  // Every collective of ctx.comm() and its creation.
  std::chrono::milliseconds commTimeout = std::chrono::seconds(20);
  // ctx.comm()'s backend: "gloo" (loopback) or "shm".
  std::string backend = "gloo";
};

class RankContext {
 public:
  RankContext(int rank, int world, HarnessMode mode, std::shared_ptr<distributed::Store> store,
              std::chrono::milliseconds commTimeout, std::shared_ptr<const std::atomic<bool>> cancelled,
              std::string backend = "gloo");

  const int rank;
  const int world;
  const HarnessMode mode;
  // Shared by all ranks of this run (in-process or TCP client); fresh for every run.
  const std::shared_ptr<distributed::Store> store;

  // The world communicator (HarnessOptions::backend; gloo over loopback by default;
  // commTimeout), created on the first call: every rank must call it.
  const std::shared_ptr<distributed::Communicator>& comm();
  // Options for more gloo communicators over `store` (give each its own name).
  distributed::GlooOptions glooOptions(const std::string& name) const;
  std::chrono::milliseconds commTimeout() const { return commTimeout_; }
  // Thread mode: true once the harness has given up on the run; looping bodies stop.
  bool cancelled() const;

 private:
  std::chrono::milliseconds commTimeout_;
  std::shared_ptr<const std::atomic<bool>> cancelled_;
  std::string backend_;
  std::shared_ptr<distributed::Communicator> comm_;
};

struct RankOutcome {
  int rank = 0;
  bool ok = false;
  bool timedOut = false;  // still running at the harness timeout
  std::string message;    // why it failed ("" when ok)
  int failureOrder = -1;  // 0 = the first rank seen failing, 1 = next, ...
};

struct MultiRankResult {
  std::vector<RankOutcome> ranks;
  double seconds = 0;

  bool ok() const;
  // The first failing rank in time (nullptr when all passed).
  const RankOutcome* firstFailure() const;
  // "rank 2 of 4 (threads) failed: ..." plus one line per other failing rank.
  std::string summary(HarnessMode mode) const;
};

// Thrown by runOnRanks when any rank failed.
class RankFailure : public Error {
 public:
  RankFailure(int rank, const std::string& message) : Error(message), rank_(rank) {}
  int rank() const { return rank_; }

 private:
  int rank_;
};

// Runs `body` on ranks 0..world-1 and reports how each ended; never throws for a rank's
// failure (the harness's own tests use it).
MultiRankResult runRanks(int world, const std::function<void(RankContext&)>& body, const HarnessOptions& options = {});

// runRanks, then throws RankFailure naming the first failing rank (GoogleTest reports it).
void runOnRanks(int world, const std::function<void(RankContext&)>& body, const HarnessOptions& options = {});

}  // namespace tessera::test
