// fault.survive: replica groups that outlive a lost rank (docs/troubleshooting.md, "A lost
// replica group").
//
// A replica group is `groupSize` consecutive ranks that together hold one whole copy of the
// run's state: hybrid's shard group, or under no_shard a node's ranks (one rank would do, but
// a node is what is lost). When a collective loses a peer (PeerLostError), each live rank
// calls ReplicaGroups::recover(): it tells the others through the store, which aborts their
// communicators (a watcher thread polls for it every 100 ms, so no rank waits out a
// collective whose group is being replaced), and reports the steps it completed. Rank 0, which
// hosts the store, waits fault.quorum_wait_s for the reports and names the groups that go on:
// those whose every rank reported. The ranks of a group that lost one leave the run. The
// others renumber in order, build a new communicator on the same store and carry on from
// their own memory (trainer.cpp). Rank 0's group cannot be lost: with it goes the store.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "distributed/rank_env.h"

namespace tessera::distributed {
class Store;
class Communicator;
}  // namespace tessera::distributed

namespace tessera::trainer {

struct TrainConfig;

// Ranks per replica group of `cfg` on `world` ranks with `localRanks` per node: hybrid's
// shard_size, else the node. ConfigError naming fault.survive when that leaves one group
// (nothing would survive a loss) or does not divide the world.
int replicaGroupSize(const TrainConfig& cfg, int world, int localRanks);

// Who goes on after a loss.
struct Membership {
  int64_t epoch = 0;          // recoveries so far in this process, this one included
  std::vector<int> members;   // ranks of the world before the loss, ascending
  int64_t stepsDone = 0;      // optimizer steps every member completed
  int worldBefore = 0;
  int newRankOf(int oldRank) const;  // its index in members; -1 when it leaves
  std::string describe() const;      // "ranks 0-1 of 4 go on (ranks 2-3 left)"
};

class ReplicaGroups {
 public:
  // Connects to the run's store (env's MASTER_ADDR:MASTER_PORT, hosted by rank 0) twice:
  // once for the watcher thread, once for recover() and the new communicators.
  ReplicaGroups(const distributed::RankEnv& env, int groupSize, std::chrono::milliseconds quorumWait,
                std::chrono::milliseconds timeout);
  ~ReplicaGroups();
  ReplicaGroups(const ReplicaGroups&) = delete;
  ReplicaGroups& operator=(const ReplicaGroups&) = delete;

  // After this rank, rank `rank` of `world`, lost a peer with `stepsDone` optimizer steps
  // complete: aborts this process's communicators, agrees with the others on who goes on.
  // Throws tessera::Error when nobody can (rank 0's group lost a rank, the live ranks
  // completed different steps) or when the store does not answer (rank 0 lost).
  Membership recover(int rank, int world, int64_t stepsDone);

  // The communicator of `membership`'s ranks, new rank `rank`, on the store under the
  // recovery's own prefix (shm; the options of diagnostics.*).
  std::shared_ptr<distributed::Communicator> communicatorFor(const Membership& membership, int rank,
                                                             std::chrono::milliseconds timeout, int flightEntries);

  int groupSize() const { return groupSize_; }

 private:
  void watch();

  int groupSize_;
  std::chrono::milliseconds quorumWait_, timeout_;
  std::shared_ptr<distributed::Store> store_;         // recover() and the new communicators
  std::shared_ptr<distributed::Store> watchStore_;    // the watcher's own connection
  std::atomic<int64_t> epoch_{0};                     // recoveries done
  std::atomic<bool> stop_{false};
  std::thread watcher_;
};

}  // namespace tessera::trainer
