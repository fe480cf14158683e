// fault.survive in the train loop: the parts rebuilt for each change of the world (see
// replica_recovery.h).
#include "trainer/replica_recovery.h"

#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <sstream>

#include "common/clock.h"
#include "common/errors.h"
#include "common/logging.h"
#include "diagnostics/flight_recorder.h"
#include "distributed/communicator.h"
#include "distributed/rank_env.h"

namespace tessera::trainer {

// fault.survive: the replica groups of `run` and the store's watcher (replica_groups.h).
std::unique_ptr<ReplicaGroups> startReplicaGroups(const RunParts& run) {
  const TrainConfig& cfg = run.cfg;
  const distributed::RankEnv env = distributed::RankEnv::fromEnvironment();
  const int world = run.comm->worldSize();
  const int groupSize = replicaGroupSize(cfg, world, env.local_world_size);
  const std::string backend = run.comm->backendName();
  if (backend != "shm" && backend != "gloo") {
    throw ConfigError(strCat("fault.survive needs the CPU collectives (run.backend cpu, shm or gloo): this run's go "
                             "over ", backend, ", whose waits cannot be abandoned when a replica group is lost"));
  }
  TLOG_INFO0("fault.survive: " << world / groupSize << " replica groups of " << groupSize
                               << " ranks; a lost rank's group leaves and the others go on");
  return std::make_unique<ReplicaGroups>(env, groupSize, cfg.fault.quorum_wait, cfg.fault.lost_after,
                                         cfg.diagnostics.runtime.rendezvousTimeout, /*joining=*/false, backend);
}

// fault.survive, after this rank lost a peer (`why`) with `stepsDone` steps complete: the
// live groups agree on who goes on, build their communicator and take their state over
// into parts for the new world; this rank leaves (tessera::Error) when its group lost a rank.
std::unique_ptr<RunParts> goOnWithoutTheLostGroup(ReplicaGroups& replicas, std::unique_ptr<RunParts> run,
                                                  int64_t stepsDone, const std::string& why, int groupsJoining) {
  const double start = steadySeconds();
  TLOG_WARN("fault.survive: lost a peer after step " << stepsDone << " (" << firstLine(why)
            << "); agreeing with the other ranks on who goes on");
  std::string lost = why;
  // Each pass is one membership change; a rank lost while its world is built fails the
  // build for every rank (the watcher's abort), and the live ones agree again.
  while (true) {
    const int rank = replicas.rankNow();
    const Membership membership = replicas.recover(rank, replicas.worldNow(), stepsDone);
    const int newRank = membership.newRankOf(rank);
    if (newRank < 0) {
      throw ReplicaGroupLeftError(strCat("fault.survive: rank ", rank,
                                         "'s replica group lost a rank, so it leaves the run: ", membership.describe()));
    }
    // The flight record of the change: the collective that lost the peer, and who went on;
    // its count is what tessera-run reports when the run ends.
    diagnostics::flight::addToCounter(diagnostics::flight::kGroupsLostCounter,
                                      (membership.worldBefore - static_cast<int>(membership.members.size())) /
                                              replicas.groupSize() -
                                          groupsJoining);
    diagnostics::flight::dump(strCat("fault.survive: lost a peer (", firstLine(lost), "); ", membership.describe()));
    const distributed::RuntimeOptions& options = run->cfg.diagnostics.runtime;
    try {
      TestKill().at(membership.stepsDone, "build");
      std::shared_ptr<distributed::Communicator> comm =
          replicas.communicatorFor(membership, newRank, options.commTimeout, options.flightEntries);
      // `run` stays the parts this rank trained with: their state is adopted, not moved.
      std::unique_ptr<RunParts> next = setUpRunFrom(*run, membership.stepsDone, std::move(comm));
      TLOG_INFO0("fault.survive: " << membership.describe() << "; training again " << steadySeconds() - start
                                   << " s after this rank lost its peer, with no checkpoint read");
      return next;
    } catch (const PeerLostError& e) {
      TLOG_WARN("fault.survive: lost another peer while the world of " << membership.members.size()
                << " ranks was built (" << firstLine(e.what()) << "); agreeing again");
      lost = e.what();
      stepsDone = membership.stepsDone;
      groupsJoining = 0;
    }
  }
}

namespace {

// The end of a rejoin, on every rank of its world: each has its state. A rank lost before
// this (the donor, mid-transfer) fails it for all, who then go on without the lost group
// (the joiners wait to be admitted again).
void agreeTheRejoinIsDone(RunParts& run) {
  const at::Tensor done = at::ones({1}, at::kDouble);
  run.hostComm->allReduce(done, distributed::ReduceOp::kMin);
}

}  // namespace

// fault.survive, at a step boundary after `done` steps with a whole lost group waiting to
// rejoin: the world with it back in place; the live ranks keep their state and send the
// joining ones theirs.
void admitRejoiningGroups(ReplicaGroups& replicas, std::unique_ptr<RunParts>& run, int64_t done) {
  const double start = steadySeconds();
  const Membership membership = replicas.admit(run->comm->rank(), done, run->counters.skippedSteps);
  const int rank = membership.rankOfLauncherRank(replicas.launcherRank());
  const distributed::RuntimeOptions& options = run->cfg.diagnostics.runtime;
  const int groupsJoining =
      static_cast<int>(std::count(membership.joining.begin(), membership.joining.end(), true)) / replicas.groupSize();
  try {
    TestKill().at(done, "build");
    run = setUpRunFrom(*run, done, replicas.communicatorFor(membership, rank, options.commTimeout, options.flightEntries));
    const auto [counterparts, root] = replicas.counterpartsOf(membership, rank, options.commTimeout);
    if (counterparts->rank() == root) TestKill().at(done, "share");
    shareState(*run, *counterparts, root);
    agreeTheRejoinIsDone(*run);
  } catch (const PeerLostError& e) {
    // Lost during the rejoin (while its world is built, or the donor mid-transfer): the
    // groups that hold their state go on without the lost group (from `run`, the parts of
    // the world before or after the admission: either holds this rank's state); the
    // joiners, who do not report, ask again.
    run = goOnWithoutTheLostGroup(replicas, std::move(run), done, e.what(), groupsJoining);
    return;
  }
  diagnostics::flight::addToCounter(diagnostics::flight::kGroupsRejoinedCounter, groupsJoining);
  diagnostics::flight::dump(strCat("fault.survive: a lost replica group rejoined after step ", done, ": world ",
                                   membership.worldBefore, " -> ", membership.launcherRanks.size(), " ranks"));
  TLOG_INFO0("fault.survive: a lost replica group rejoined after step " << done << ": world "
             << membership.worldBefore << " -> " << membership.launcherRanks.size() << " ranks, its state sent from "
             << "live ranks in " << steadySeconds() - start << " s");
}

// fault.survive, in a process its launcher restarted into a live run (ReplicaGroups::rejoins):
// waits to be admitted, then builds its parts and receives its state from a live rank; null
// when the run finished before it could rejoin. A rank lost during the rejoin (the donor)
// fails it: this rank asks again, and is admitted at a later boundary with another donor.
std::unique_ptr<RunParts> rejoin(const TrainConfig& cfg, const std::string& resolvedYaml,
                                 std::unique_ptr<ReplicaGroups>& replicas, std::chrono::milliseconds groupAsksWithin) {
  const distributed::RankEnv env = distributed::RankEnv::fromEnvironment();
  replicas.reset();  // a live rank's former groups: their watcher must not abort the new world's builds
  replicas = std::make_unique<ReplicaGroups>(env, replicaGroupSize(cfg, env.world_size, env.local_world_size),
                                             cfg.fault.quorum_wait, cfg.fault.lost_after,
                                             cfg.diagnostics.runtime.rendezvousTimeout, /*joining=*/true);
  if (groupAsksWithin.count() <= 0) {
    TLOG_INFO("fault.survive: restarted into a live run; waiting to rejoin at a step boundary");
  }
  while (true) {
    const std::optional<Membership> admitted = replicas->join(groupAsksWithin);
    if (!admitted) return nullptr;
    const Membership& membership = *admitted;
    const double start = steadySeconds();
    const int rank = membership.rankOfLauncherRank(env.rank);
    const distributed::RuntimeOptions& options = cfg.diagnostics.runtime;
    try {
      std::unique_ptr<RunParts> run =
          setUpRunToJoin(cfg, resolvedYaml, membership.stepsDone, membership.skippedSteps,
                         replicas->communicatorFor(membership, rank, options.commTimeout, options.flightEntries));
      const auto [counterparts, root] = replicas->counterpartsOf(membership, rank, options.commTimeout);
      shareState(*run, *counterparts, root);
      agreeTheRejoinIsDone(*run);
      TLOG_INFO("fault.survive: rejoined as rank " << rank << " of " << membership.launcherRanks.size()
                << " after step " << membership.stepsDone << ", its state from a live rank in "
                << steadySeconds() - start << " s, no checkpoint read");
      return run;
    } catch (const PeerLostError& e) {
      TLOG_WARN("fault.survive: the rejoin after step " << membership.stepsDone << " lost a peer ("
                << firstLine(e.what()) << "); asking to rejoin again");
    }
  }
}

TestKill::TestKill() {
  const char* spec = std::getenv("TESSERA_TEST_KILL");
  const char* rank = std::getenv("RANK");
  if (spec == nullptr || rank == nullptr) return;
  // A process its launcher restarted does not kill itself again: it comes back to stay.
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const bool restarted = restart != nullptr && *restart != '\0' && std::string(restart) != "0";
  std::istringstream all(spec);
  for (std::string text; std::getline(all, text, ',');) {
    const size_t a = text.find(':'), b = text.find(':', a == std::string::npos ? a : a + 1);
    const std::string when = b == std::string::npos ? "" : text.substr(b + 1);
    if (b == std::string::npos ||
        (when != "start" && when != "update" && when != "save" && when != "stop" && when != "pause" &&
         when != "share" && when != "build")) {
      throw UsageError(strCat("TESSERA_TEST_KILL '", text,
                              "': RANK:STEP:WHEN expected, WHEN start, update, save, stop, pause, share or build"));
    }
    const std::string step = text.substr(a + 1, b - a - 1);
    if (step.empty() || step.find_first_not_of("0123456789") != std::string::npos || step.size() > 18) {
      throw UsageError(strCat("TESSERA_TEST_KILL '", text, "': STEP '", step, "' is not a step number"));
    }
    if (text.substr(0, a) == rank && !restarted) kills_.push_back({std::stoll(step), when});
  }
}

void TestKill::at(int64_t step, const char* when) const {
  for (const auto& [s, w] : kills_) {
    const bool firstAfter = w == "share" || w == "build";  // at the first such point after step s
    if ((firstAfter ? step >= s : s == step) && w == when) ::kill(::getpid(), SIGKILL);
    if (s == step && w == "stop" && std::string(when) == "start") ::kill(::getpid(), SIGSTOP);
    if (s == step && w == "pause" && std::string(when) == "start" && !paused_) {
      paused_ = true;  // once: the step it stalled in is redone
      // Frozen for kPause, then continued by a child of its own (a stopped process runs no
      // thread of its own): a node that stalls and comes back. The child only sleeps, signals
      // and exits (all a child of a threaded process may do).
      const pid_t self = ::getpid();
      const pid_t helper = ::fork();
      if (helper == 0) {
        const struct timespec pause{kPause.count() / 1000, (kPause.count() % 1000) * 1000000};
        ::nanosleep(&pause, nullptr);
        ::kill(self, SIGCONT);
        ::_exit(0);
      }
      if (helper > 0) {
        ::kill(self, SIGSTOP);
        ::waitpid(helper, nullptr, 0);
      }
    }
  }
}

}  // namespace tessera::trainer
