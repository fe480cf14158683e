// Store and rendezvous: TCPStore across threads and processes, arrival checks that name
// the missing ranks within the timeout, a store host that never comes up, Runtime.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <thread>

#include "common/clock.h"
#include "common/errors.h"
#include "distributed/rendezvous.h"
#include "distributed/runtime.h"
#include "distributed/store.h"
#include "tests/support/free_port.h"
#include "tests/support/multi_rank.h"

namespace tessera::distributed {
namespace {

using Clock = std::chrono::steady_clock;
using test::HarnessMode;
using test::HarnessOptions;
using test::RankContext;
using test::runOnRanks;

using tessera::secondsSince;

using tessera::test::freePort;

RankEnv envFor(int rank, int world, int port) {
  RankEnv env;
  env.rank = rank;
  env.local_rank = rank;
  env.world_size = world;
  env.local_world_size = world;
  env.master_addr = "127.0.0.1";
  env.master_port = port;
  env.source = "torchrun";
  return env;
}

TEST(StoreTest, InProcessBasics) {
  auto store = Store::createInProcess();
  store->set("a", "hello");
  EXPECT_EQ(store->get("a", std::chrono::seconds(1)), "hello");
  EXPECT_EQ(store->add("n", 2), 2);
  EXPECT_EQ(store->add("n", 3), 5);
  EXPECT_TRUE(store->check({"a", "n"}));
  EXPECT_FALSE(store->check({"a", "missing"}));
  auto prefixed = store->withPrefix("p");
  prefixed->set("a", "other");
  EXPECT_EQ(store->get("a", std::chrono::seconds(1)), "hello");
  EXPECT_EQ(prefixed->get("a", std::chrono::seconds(1)), "other");
  EXPECT_EQ(store->port(), -1);
}

TEST(StoreTest, WaitTimesOutNamingTheMissingKeys) {
  auto store = Store::createInProcess();
  store->set("here", "1");
  const auto start = Clock::now();
  try {
    store->wait({"here", "gone"}, std::chrono::milliseconds(300));
    ADD_FAILURE() << "wait returned";
  } catch (const TimeoutError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("Store::wait: waited 300 ms for keys [gone]"), std::string::npos) << message;
  }
  EXPECT_LT(secondsSince(start), 2.0);
}

// A long wait says now and then what it waits for (every timeout/5, at least 5 s), so a
// rank waiting on a stopped or slow one is not silent for the whole timeout.
TEST(StoreTest, ALongWaitSaysWhatItWaitsFor) {
  auto store = Store::createInProcess();
  testing::internal::CaptureStderr();
  std::thread late([&store] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5500));
    store->set("late", "1");
  });
  store->wait({"late"}, std::chrono::seconds(20));
  late.join();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("Store::wait has waited 5"), std::string::npos) << err;
  EXPECT_NE(err.find("for keys [late]"), std::string::npos) << err;
  EXPECT_NE(err.find("(timeout 20 s)"), std::string::npos) << err;
}

// The rendezvous likewise names the ranks it still waits for.
TEST(RendezvousTest, ALongWaitNamesTheMissingRanks) {
  auto store = Store::createInProcess();
  testing::internal::CaptureStderr();
  std::thread late([&store] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5500));
    waitForRanks(*store, "rdzv", 1, 2, std::chrono::seconds(20));
  });
  waitForRanks(*store, "rdzv", 0, 2, std::chrono::seconds(20));
  late.join();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("rendezvous: rank 0 has waited 5"), std::string::npos) << err;
  EXPECT_NE(err.find("for rank 1 of 2"), std::string::npos) << err;
}

TEST(StoreTest, TcpServerOnPortZeroAndClients) {
  auto server = Store::createTcp("127.0.0.1", 0, /*isServer=*/true, std::chrono::seconds(5));
  ASSERT_GT(server->port(), 0);
  auto client = Store::createTcp("127.0.0.1", server->port(), /*isServer=*/false, std::chrono::seconds(5));
  client->set("k", "v");
  EXPECT_EQ(server->get("k", std::chrono::seconds(1)), "v");
  EXPECT_EQ(client->add("c", 1) + server->add("c", 1), 3);
  EXPECT_NE(client->address().find(strCat("127.0.0.1:", server->port())), std::string::npos);
}

TEST(StoreTest, NoServerIsATimeoutNamingTheAddress) {
  const int port = freePort();
  const auto start = Clock::now();
  try {
    Store::createTcp("127.0.0.1", port, /*isServer=*/false, std::chrono::milliseconds(800));
    ADD_FAILURE() << "connected to nobody";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find(strCat("127.0.0.1:", port)), std::string::npos) << e.what();
  }
  // It keeps trying for the whole timeout (rank 0 may start late), then gives up.
  EXPECT_GE(secondsSince(start), 0.75);
  EXPECT_LT(secondsSince(start), 5.0);
}

TEST(StoreTest, ClientWaitsForAServerThatStartsLate) {
  const int port = freePort();
  std::thread host([port]() {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    auto server = Store::createTcp("127.0.0.1", port, /*isServer=*/true, std::chrono::seconds(5));
    server->wait({"client_was_here"}, std::chrono::seconds(5));
  });
  const auto start = Clock::now();
  auto client = Store::createTcp("127.0.0.1", port, /*isServer=*/false, std::chrono::seconds(2));
  const double connectSeconds = secondsSince(start);
  client->set("client_was_here", "1");
  host.join();
  EXPECT_GE(connectSeconds, 0.25);
  EXPECT_LT(connectSeconds, 0.9) << "retries should be much finer than LibTorch 1.13's 1 s";
}

TEST(RendezvousTest, AllRanksArriveOverTcpThreads) {
  const int port = freePort();
  const int world = 4;
  std::vector<std::future<std::string>> results;
  for (int r = 0; r < world; ++r) {
    results.push_back(std::async(std::launch::async, [r, port]() -> std::string {
      RendezvousOptions options;
      options.timeout = std::chrono::seconds(10);
      auto store = rendezvous(envFor(r, world, port), options);
      // The store is shared: every rank sees every other rank's key.
      store->set(strCat("hello/", r), std::to_string(r * r));
      std::string all;
      for (int k = 0; k < world; ++k) all += store->get(strCat("hello/", k), std::chrono::seconds(5)) + ",";
      // Rank 0 hosts the store: it leaves last.
      store->set(strCat("done/", r), "1");
      if (r == 0) {
        std::vector<std::string> done;
        for (int k = 0; k < world; ++k) done.push_back(strCat("done/", k));
        store->wait(done, std::chrono::seconds(5));
      }
      return all;
    }));
  }
  for (auto& result : results) EXPECT_EQ(result.get(), "0,1,4,9,");
}

TEST(RendezvousTest, MissingRankIsNamedWithinTheTimeout) {
  const int port = freePort();
  const int world = 4;
  std::vector<std::future<std::string>> results;
  for (int r = 0; r < 3; ++r) {  // rank 3 never comes
    results.push_back(std::async(std::launch::async, [r, port]() -> std::string {
      RendezvousOptions options;
      options.timeout = std::chrono::milliseconds(1500);
      try {
        rendezvous(envFor(r, world, port), options);
        return "rendezvous returned without rank 3";
      } catch (const TimeoutError& e) {
        return e.what();
      }
    }));
  }
  const auto start = Clock::now();
  for (auto& result : results) {
    const std::string message = result.get();
    EXPECT_NE(message.find("rendezvous: waited"), std::string::npos) << message;
    EXPECT_NE(message.find("for rank 3 of 4 at tcp 127.0.0.1:" + std::to_string(port)), std::string::npos) << message;
  }
  EXPECT_LT(secondsSince(start), 6.0);
}

TEST(RendezvousTest, SeveralMissingRanksAreListed) {
  auto store = Store::createInProcess();
  try {
    waitForRanks(*store, "k", 1, 4, std::chrono::milliseconds(200));
    ADD_FAILURE() << "returned";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("for ranks [0, 2, 3] of 4"), std::string::npos) << e.what();
  }
}

TEST(RendezvousTest, StoreHostNeverComing) {
  const int port = freePort();
  RendezvousOptions options;
  options.timeout = std::chrono::seconds(1);
  const auto start = Clock::now();
  try {
    rendezvous(envFor(1, 2, port), options);
    ADD_FAILURE() << "rendezvous returned without rank 0";
  } catch (const TimeoutError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("rank 0 (the store host) at 127.0.0.1:" + std::to_string(port)), std::string::npos)
        << message;
  }
  EXPECT_GE(secondsSince(start), 0.9);
  EXPECT_LT(secondsSince(start), 5.0);
}

TEST(RendezvousTest, RuntimeOverTcpInProcesses) {
  // Real processes, each with its own TCPStore client/server, as under torchrun.
  const int port = freePort();
  HarnessOptions options;
  options.mode = HarnessMode::kProcesses;
  runOnRanks(3, [port](RankContext& ctx) {
    RuntimeOptions runtimeOptions;
    runtimeOptions.rendezvousTimeout = std::chrono::seconds(10);
    runtimeOptions.commTimeout = std::chrono::seconds(10);
    auto runtime = Runtime::init(envFor(ctx.rank, ctx.world, port), runtimeOptions);
    EXPECT_EQ(runtime->comm(), runtime->cpuComm());
    EXPECT_EQ(runtime->comm()->worldSize(), 3);
    at::Tensor t = at::full({4}, static_cast<float>(ctx.rank));
    runtime->comm()->allReduce(t);
    EXPECT_TRUE(t.equal(at::full({4}, 3.0f)));
    runtime->comm()->barrier();  // rank 0 hosts the store: nobody leaves before all are done
  }, options);
}

TEST(RendezvousTest, SingleProcessRuntime) {
  auto comm = initProcessGroup(RankEnv::fromMap({}));
  EXPECT_EQ(comm->worldSize(), 1);
  EXPECT_EQ(comm->rank(), 0);
  at::Tensor t = at::ones({3});
  comm->allReduce(t, ReduceOp::kAvg);
  EXPECT_TRUE(t.equal(at::ones({3})));
  comm->barrier();
}

TEST(RendezvousTest, RuntimeRejectsUnavailableBackend) {
  RuntimeOptions options;
  options.backend = "carrier-pigeon";
  EXPECT_THROW(Runtime::init(RankEnv::fromMap({}), options), ConfigError);
  if (!ncclAvailable()) {
    options.backend = "nccl";
    EXPECT_THROW(Runtime::init(RankEnv::fromMap({}), options), ConfigError);
    options.backend = "auto";
    EXPECT_EQ(Runtime::init(RankEnv::fromMap({}), options)->comm()->backendName(), "gloo");
  }
}

}  // namespace
}  // namespace tessera::distributed
