// fault.survive in the train loop (docs/troubleshooting.md, "A lost replica group"): the
// run's parts rebuilt for each change of its world — a lost group left, a lost group back, a
// restarted process rejoining — from this rank's memory or a live peer's, never a checkpoint.
// The agreements behind them are replica_groups.h's; trainer.cpp's loop calls these.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "trainer/replica_groups.h"
#include "trainer/run_setup.h"

namespace tessera::trainer {

// The replica groups of `run` (fault.survive) and the store's watcher. ConfigError when
// the run has one group or its collectives are not shm's.
std::unique_ptr<ReplicaGroups> startReplicaGroups(const RunParts& run);

// What goOnWithoutTheLostGroup throws on a live rank whose replica group left the run (a rank
// of it was lost, or taken for lost: its heartbeats late on an overloaded host).
class ReplicaGroupLeftError : public Error {
 public:
  using Error::Error;
};

// How long a live rank whose group left waits for the rest of its group to ask to rejoin
// with it (in process) before it leaves the run: a peer that is really lost never asks.
constexpr std::chrono::milliseconds kGroupAsksToRejoinWithin{5000};

// After this rank lost a peer (`why`) with `stepsDone` steps complete: the live groups agree
// on who goes on, build their communicator and take their state over into parts for the new
// world. ReplicaGroupLeftError when this rank's group lost a rank (it leaves the step);
// tessera::Error when none can go on.
// A rank lost while that world is built: they agree again, without it. `run` is this rank's
// parts in the membership `replicas` last agreed to, or in the one before it (a rejoin that
// failed while its world was built). `groupsJoining`: of the groups that leave, those a
// failed rejoin was admitting (they ask again; not counted as lost).
std::unique_ptr<RunParts> goOnWithoutTheLostGroup(ReplicaGroups& replicas, std::unique_ptr<RunParts> run,
                                                  int64_t stepsDone, const std::string& why, int groupsJoining = 0);

// At a step boundary after `done` steps, with a whole lost group waiting to rejoin: `run`
// becomes the world with it back in place; the live ranks keep their state and send the
// joining ones theirs. A rank lost during it (while its world is built, or the donor): the
// groups that hold their state go on without the lost one (goOnWithoutTheLostGroup), and
// the joiners, who do not report, ask again.
void admitRejoiningGroups(ReplicaGroups& replicas, std::unique_ptr<RunParts>& run, int64_t done);

// In a process its launcher restarted into a live run (ReplicaGroups::rejoins), or a live
// one whose group left it (ReplicaGroupLeftError; `groupAsksWithin` > 0: tessera::Error when
// the rest of its group does not ask too by then): waits to be admitted, then builds its
// parts and receives its state from a live rank; null when the run finished before it could
// rejoin. A rank lost during the rejoin: it asks again, in process. `replicas` is set to
// this process's groups.
std::unique_ptr<RunParts> rejoin(const TrainConfig& cfg, const std::string& resolvedYaml,
                                 std::unique_ptr<ReplicaGroups>& replicas,
                                 std::chrono::milliseconds groupAsksWithin = std::chrono::milliseconds(0));

// The tests of fault.survive: TESSERA_TEST_KILL="RANK:STEP:WHEN" has the process of launcher
// rank RANK (its RANK) SIGKILL itself in step STEP (as the log counts them) at WHEN: "start"
// (its peers wait for it in the step's collectives), "update" (after the step's optimizer
// update, its peers in the step's last all-gathers) or "save" (after the step's periodic
// actions: an asynchronous checkpoint write in flight); "stop": SIGSTOP at "start" (a frozen
// process, never continued); "pause": SIGSTOP at "start", continued kPause later (a node
// that stalls and comes back); "share": when it is about to send its state to a rejoining rank
// after step STEP or later (the donor lost mid-rejoin); "build": when it is about to build
// the communicators of a membership change (a loss or a rejoin) after step STEP or later;
// several, comma-separated. A process
// its launcher restarted (TORCHELASTIC_RESTART_COUNT > 0) never kills itself. Unset: never. UsageError for a
// malformed value.
class TestKill {
 public:
  static constexpr std::chrono::milliseconds kPause{5000};
  TestKill();
  void at(int64_t step, const char* when) const;

 private:
  std::vector<std::pair<int64_t, std::string>> kills_;  // this rank's
  mutable bool paused_ = false;
};

}  // namespace tessera::trainer
