// fault.survive: replica groups that outlive a lost rank (docs/troubleshooting.md, "A lost
// replica group").
//
// A replica group is `groupSize` consecutive ranks that together hold one whole copy of the
// run's state: hybrid's shard group, or under no_shard a node's ranks (one rank would do, but
// a node is what is lost). When a collective loses a peer (PeerLostError), each live rank
// calls ReplicaGroups::recover(): it tells the others through the store, which aborts their
// communicators (a watcher thread polls for it every 100 ms, so no rank waits out a
// collective whose group is being replaced), and reports the steps it completed. The
// watchers also beat in the store and rank 0's starts the change when a live rank's beats
// stop: under gloo no rank can see another's process (a stopped one), and while a change's
// communicators are built no backend watches its peers (their builds wait in the store and
// end with the abort, CommOptions::abortGeneration). Rank 0, which
// hosts the store, waits fault.quorum_wait_s for the reports and names the groups that go on:
// those whose every rank reported. The ranks of a group that lost one leave the run. The
// others renumber in order, build a new communicator on the same store and carry on from
// their own memory (trainer.cpp). Rank 0's group cannot be lost: with it goes the store.
//
// Rejoin: a lost group's launcher restarts its ranks (--max-restarts); they find the run
// alive in the store (rejoins()) and wait there (join()). Rank 0's watcher sees a whole
// group waiting; at the next step boundary every rank learns it (rejoinWaiting(), one small
// all-reduce) and all agree on the world with the group back in its place (admit()); each
// joining rank receives its state from the rank of the same place in a live group. A rank
// lost during that (the donor) fails the rejoin for all: the groups that hold their state go
// on without the lost group (recover(); the joiners do not report, so they are not members)
// and the joiners join() again, in process, for a later boundary. A rank lost while any
// change's communicators are built fails that build for all: the live ranks agree again.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
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

// Who goes on after a loss, or who trains after lost ranks rejoined.
struct Membership {
  int64_t epoch = 0;          // membership changes so far in this run, this one included
  std::vector<int> members;   // ranks of the world before the change, ascending (joiners: see below)
  int64_t stepsDone = 0;      // optimizer steps every member completed
  int64_t skippedSteps = 0;   // of those, skipped for a non-finite gradient norm (joiners' counter)
  int worldBefore = 0;
  // A rejoin: the launcher RANK of every rank of the new world, in rank order, and which of
  // them join (they receive their state from the rank of the same place in another group).
  std::vector<int> launcherRanks;
  std::vector<bool> joining;
  int newRankOf(int oldRank) const;  // its index in members; -1 when it leaves
  int rankOfLauncherRank(int launcherRank) const;  // a rejoin's new rank of a launcher RANK; -1: none
  std::string describe() const;      // "ranks 0-1 of 4 go on as a world of 2 from step 30 (ranks 2-3 left)"
};

class ReplicaGroups {
 public:
  // Connects to the run's store (env's MASTER_ADDR:MASTER_PORT, hosted by rank 0) twice:
  // once for the watcher thread, once for the agreements and the new communicators. A
  // process that trains from the start knows the world's launcher ranks (0 .. world-1);
  // one that rejoins learns them in join().
  // `backend`: the run's CPU collectives, "shm" or "gloo" (the communicators of each new
  // world are made alike); a joining process reads it from the store. `lostAfter`: how long
  // a rank may be stopped or silent before it is lost (fault.lost_after_s).
  ReplicaGroups(const distributed::RankEnv& env, int groupSize, std::chrono::milliseconds quorumWait,
                std::chrono::milliseconds lostAfter, std::chrono::milliseconds timeout, bool joining = false,
                const std::string& backend = "shm");
  ~ReplicaGroups();
  ReplicaGroups(const ReplicaGroups&) = delete;
  ReplicaGroups& operator=(const ReplicaGroups&) = delete;

  // Whether this process was restarted into a run whose replica groups live on: a rank
  // other than 0 restarted by its launcher, and the store of the run answers that it does.
  static bool rejoins(const distributed::RankEnv& env, std::chrono::milliseconds timeout);

  // After this rank, rank `rank` of `world`, lost a peer with `stepsDone` optimizer steps
  // complete: aborts this process's communicators, agrees with the others on who goes on.
  // Throws tessera::Error when nobody can (rank 0's group lost a rank, the live ranks
  // completed different steps) or when the store does not answer (rank 0 lost).
  Membership recover(int rank, int world, int64_t stepsDone);

  // At a step boundary, on every rank of the world (`host`, collective: one small
  // all-reduce): whether the whole of a lost group waits to rejoin.
  bool rejoinWaiting(distributed::Communicator& host);
  // Then, on every rank: the world with the waiting groups in their places, after
  // `stepsDone` steps (`skippedSteps` skipped).
  Membership admit(int rank, int64_t stepsDone, int64_t skippedSteps);
  // On a restarted process (rejoins()), or a live one whose group left the run: waits until
  // the live ranks admit it (up to the timeout), and returns the world it trains in;
  // std::nullopt when the run finished first. `groupAsksWithin` > 0: tessera::Error when
  // the other ranks of its group have not asked too by then (one of them is really lost).
  std::optional<Membership> join(std::chrono::milliseconds groupAsksWithin = std::chrono::milliseconds(0));
  // Rank 0, when its run has trained its last step: a rank waiting to rejoin stops waiting.
  void finished();

  // The communicator of `membership`'s world for its rank `rank`, on the store under the
  // change's own prefix (the run's backend; the options of diagnostics.*).
  std::shared_ptr<distributed::Communicator> communicatorFor(const Membership& membership, int rank,
                                                             std::chrono::milliseconds timeout, int flightEntries);
  // After admit()/join(): the communicator of the ranks that hold the same place in their
  // groups as `rank` (one per group), and in it the rank that sends the state (the last
  // that does not join: rank 0's group only when no other is live, so that a donor lost
  // mid-rejoin leaves the store's group to go on and send at the next try).
  std::pair<std::shared_ptr<distributed::Communicator>, int> counterpartsOf(const Membership& membership, int rank,
                                                                            std::chrono::milliseconds timeout);

  int groupSize() const { return groupSize_; }
  int launcherRank() const { return launcherRank_; }  // this process's RANK from its launcher
  // This process's rank and the world's size in the membership it last agreed to (the
  // start's, or the last recover()'s, admit()'s or join()'s).
  int rankNow() const;
  int worldNow() const;

 private:
  void watch();
  void startWatching();
  void setEpoch(int64_t epoch);  // under epochMutex_
  // A group `name` of a membership change's communicators (its store prefix), of the run's
  // backend; shm's stopped ranks are lost after lostAfter_ (any backend's by
  // the heartbeats, watch()). Its build and operations end with PeerLostError when the watcher
  // aborts for the next change (epochGeneration_).
  std::shared_ptr<distributed::Communicator> groupCommunicator(int64_t epoch, const std::string& name, int rank,
                                                               int world, std::chrono::milliseconds timeout,
                                                               int flightEntries);
  // Rank 0's watcher: the live launcher ranks whose heartbeat (each watcher's count in the
  // store) has not moved for silenceLosesARankAfter(); a rank yet to beat once is not watched.
  std::chrono::milliseconds silenceLosesARankAfter() const;
  std::vector<int> silentRanks(distributed::Store& store);
  // Rank 0: the launcher ranks of the whole lost groups that wait to rejoin, and each one's
  // attempt (join()s so far), read through `store` (a connection is used by one thread).
  std::map<int, int64_t> waitingGroups(distributed::Store& store);
  // Whether every launcher rank of this process's group asks to join now.
  bool wholeGroupAsks();

  int groupSize_;
  int launcherRank_;
  int worldAtStart_;
  std::chrono::milliseconds quorumWait_, lostAfter_, timeout_;
  std::shared_ptr<distributed::Store> store_;         // the agreements and the new communicators
  std::shared_ptr<distributed::Store> watchStore_;    // the watcher's own connection
  std::mutex epochMutex_;                             // epoch_'s changes against the watcher's aborts
  std::atomic<int64_t> epoch_{0};                     // membership changes done
  uint64_t epochGeneration_ = 0;                      // commAbortGeneration() when epoch_ was set
  mutable std::mutex mutex_;                          // launcherRanks_ (the watcher reads it)
  std::vector<int> launcherRanks_;                    // launcher RANK of each rank of the world now
  std::atomic<bool> groupWaiting_{false};             // rank 0's watcher: a whole lost group asked to rejoin
  std::atomic<bool> stop_{false};
  std::thread watcher_;
  std::string backend_;                               // "shm" or "gloo"
  std::string glooHostname_;                          // gloo: the address its connections bind to
  // Rank 0's watcher: each launcher rank's last heartbeat count and when it moved,
  // in time and in the watcher's own rounds (a watcher or store that was itself held up
  // loses no one: silence counts only in rounds it completed).
  struct Heartbeat {
    int64_t count = 0;
    int64_t round = 0;
    std::chrono::steady_clock::time_point time;
  };
  std::map<int, Heartbeat> heartbeats_;
  int64_t heartbeatRounds_ = 0;
};

}  // namespace tessera::trainer
