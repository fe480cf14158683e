// fault.survive's agreements through the store (trainer/replica_groups.h), each rank a thread
// with its own ReplicaGroups on one TCP store: who goes on after a loss, a whole lost group
// admitted back in its place, a rank that comes back after the run finished, and the groups'
// size. The processes' side (communicators, state) is tests/apps/fault_survive_e2e_test.cpp's.
#include <gtest/gtest.h>

#include <future>
#include <thread>

#include "common/errors.h"
#include "distributed/store.h"
#include "trainer/replica_groups.h"
#include "trainer/train_config.h"

namespace {

using tessera::distributed::RankEnv;
using tessera::distributed::Store;
using tessera::trainer::Membership;
using tessera::trainer::ReplicaGroups;
using namespace std::chrono_literals;

RankEnv envOf(int rank, int world, int port, int restarts = 0) {
  RankEnv env;
  env.rank = rank;
  env.world_size = world;
  env.local_world_size = 2;
  env.master_addr = "127.0.0.1";
  env.master_port = port;
  env.restart_count = restarts;
  return env;
}

TEST(ReplicaGroupsTest, AGroupThatLostARankLeavesAndTheOthersRenumber) {
  const auto server = Store::createTcp("127.0.0.1", 0, /*isServer=*/true, 5s);
  std::vector<std::unique_ptr<ReplicaGroups>> ranks;
  for (int r = 0; r < 6; ++r) ranks.push_back(std::make_unique<ReplicaGroups>(envOf(r, 6, server->port()), 2, 2s, 1s, 5s));
  // Rank 3 is lost: 0, 1, 2, 4, 5 report after 10 steps; rank 2's group is not whole.
  std::vector<std::future<Membership>> answers;
  for (int r : {0, 1, 2, 4, 5}) answers.push_back(std::async(std::launch::async, [&, r] { return ranks[r]->recover(r, 6, 10); }));
  for (auto& answer : answers) {
    const Membership m = answer.get();
    EXPECT_EQ(m.members, (std::vector<int>{0, 1, 4, 5}));
    EXPECT_EQ(m.stepsDone, 10);
    EXPECT_EQ(m.newRankOf(4), 2);
    EXPECT_EQ(m.newRankOf(2), -1);
    EXPECT_EQ(m.describe(), "ranks 0-1, 4-5 of 6 go on as a world of 4 from step 10 (ranks 2-3 left)");
  }
}

TEST(ReplicaGroupsTest, LiveRanksThatCompletedDifferentStepsStopWithTheReason) {
  const auto server = Store::createTcp("127.0.0.1", 0, /*isServer=*/true, 5s);
  ReplicaGroups r0(envOf(0, 4, server->port()), 2, 2s, 1s, 5s), r1(envOf(1, 4, server->port()), 2, 2s, 1s, 5s);
  auto one = std::async(std::launch::async, [&] { return r1.recover(1, 4, 11); });
  try {
    r0.recover(0, 4, 10);
    FAIL() << "expected tessera::Error";
  } catch (const tessera::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 completed 11 steps and rank 0 10"), std::string::npos) << e.what();
  }
  EXPECT_THROW(one.get(), tessera::Error);
}

TEST(ReplicaGroupsTest, AWholeLostGroupIsAdmittedBackInItsPlace) {
  const auto server = Store::createTcp("127.0.0.1", 0, /*isServer=*/true, 5s);
  const int port = server->port();
  ReplicaGroups r0(envOf(0, 4, port), 2, 2s, 1s, 5s), r1(envOf(1, 4, port), 2, 2s, 1s, 5s);
  {
    auto one = std::async(std::launch::async, [&] { return r1.recover(1, 4, 7); });
    EXPECT_EQ(r0.recover(0, 4, 7).members, (std::vector<int>{0, 1}));
    one.get();
  }
  EXPECT_TRUE(ReplicaGroups::rejoins(envOf(2, 4, port, /*restarts=*/1), 5s));
  EXPECT_FALSE(ReplicaGroups::rejoins(envOf(2, 4, port, /*restarts=*/0), 5s));  // not restarted
  EXPECT_FALSE(ReplicaGroups::rejoins(envOf(0, 4, port, /*restarts=*/1), 5s));  // rank 0 never rejoins
  ReplicaGroups j2(envOf(2, 4, port, 1), 2, 2s, 1s, 5s, /*joining=*/true);
  ReplicaGroups j3(envOf(3, 4, port, 1), 2, 2s, 1s, 5s, /*joining=*/true);
  auto joined2 = std::async(std::launch::async, [&] { return j2.join(); });
  auto joined3 = std::async(std::launch::async, [&] { return j3.join(); });
  // Both asked before the live ranks admit them (rank 0 admits whole groups only).
  const auto client = Store::createTcp("127.0.0.1", port, false, 5s);
  for (int i = 0; i < 500 && (client->add("tessera_fault/join_attempts/2", 0) < 1 ||
                              client->add("tessera_fault/join_attempts/3", 0) < 1);
       ++i) {
    std::this_thread::sleep_for(10ms);
  }
  auto admitted1 = std::async(std::launch::async, [&] { return r1.admit(1, 9, 2); });
  const Membership m = r0.admit(0, 9, 2);
  EXPECT_EQ(m.launcherRanks, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(m.joining, (std::vector<bool>{false, false, true, true}));
  EXPECT_EQ(m.stepsDone, 9);
  EXPECT_EQ(m.skippedSteps, 2);
  EXPECT_EQ(admitted1.get().launcherRanks, m.launcherRanks);
  for (auto* joined : {&joined2, &joined3}) {
    const std::optional<Membership> j = joined->get();
    ASSERT_TRUE(j.has_value());
    EXPECT_EQ(j->launcherRanks, m.launcherRanks);
    EXPECT_EQ(j->joining, m.joining);
    EXPECT_EQ(j->epoch, m.epoch);
    EXPECT_EQ(j->stepsDone, 9);
  }
  EXPECT_EQ(m.rankOfLauncherRank(3), 3);
}

TEST(ReplicaGroupsTest, ARankWaitingToRejoinStopsWhenTheRunFinishes) {
  const auto server = Store::createTcp("127.0.0.1", 0, /*isServer=*/true, 5s);
  ReplicaGroups r0(envOf(0, 4, server->port()), 2, 2s, 1s, 5s);
  ReplicaGroups joiner(envOf(2, 4, server->port(), 1), 2, 2s, 1s, 5s, /*joining=*/true);
  auto joined = std::async(std::launch::async, [&] { return joiner.join(); });
  std::this_thread::sleep_for(100ms);
  r0.finished();
  EXPECT_FALSE(joined.get().has_value());
}

TEST(ReplicaGroupsTest, OneGroupIsRefused) {
  tessera::trainer::TrainConfig cfg;
  cfg.models.emplace_back();
  cfg.models.back().sharding.strategy = tessera::sharding::StrategyKind::kNoShard;
  EXPECT_EQ(tessera::trainer::replicaGroupSize(cfg, 4, 2), 2);
  EXPECT_THROW(tessera::trainer::replicaGroupSize(cfg, 2, 2), tessera::ConfigError);
  cfg.models.back().sharding.strategy = tessera::sharding::StrategyKind::kHybrid;
  cfg.models.back().sharding.fullyShard.shardSize = 3;
  EXPECT_EQ(tessera::trainer::replicaGroupSize(cfg, 6, 2), 3);
  EXPECT_THROW(tessera::trainer::replicaGroupSize(cfg, 4, 2), tessera::ConfigError);  // 3 does not divide 4
}

}  // namespace
