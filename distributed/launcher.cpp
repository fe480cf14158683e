// tessera-run's launcher core (see launcher.h): the attempts of a run, its restarts and,
// in an elastic run, its rendezvous rounds. The local ranks' processes (fork/exec, their
// output, signals, the teardown) are child_processes.h's; what a failure prints is
// failure_report.h's; the options' checks, the ranks' environment and the small shared
// helpers are launch_options.cpp's.
#include "distributed/launcher.h"

#include <signal.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <memory>

#include "common/app_main.h"
#include "common/errors.h"
#include "common/file_open.h"
#include "common/filesystem.h"
#include "common/logging.h"
#include "diagnostics/flight_recorder.h"
#include "diagnostics/flight_verdict.h"
#include "distributed/child_processes.h"
#include "distributed/elastic_rendezvous.h"
#include "distributed/failure_report.h"

namespace tessera::distributed {
namespace {

// How long one turn of an attempt's loop waits for the ranks' output or a signal.
constexpr double kPumpPeriodS = 0.5;
// How often an elastic launcher asks the rendezvous whether to stop for a new round: also
// its heartbeat there (a live node is heard within a second, elastic_protocol.cpp).
constexpr double kRendezvousPollS = 0.5;

// What the ranks' flight dumps say their run survived (fault.survive), for the line that
// ends a successful run: "; the run went on without 1 lost replica group and took 1 back
// (fault.survive)", or "".
std::string survivedFailures(const std::string& flightDir) {
  auto counters = diagnostics::dumpCounters(flightDir);
  const int64_t lost = counters[diagnostics::flight::kGroupsLostCounter];
  const int64_t back = counters[diagnostics::flight::kGroupsRejoinedCounter];
  if (lost == 0 && back == 0) return "";
  if (lost == 0) return strCat("; the run took ", back, " lost replica group", back == 1 ? "" : "s", " back (fault.survive)");
  return strCat("; the run went on without ", lost, " lost replica group", lost == 1 ? "" : "s",
                back > 0 ? strCat(" and took ", back, " back") : std::string(), " (fault.survive)");
}

class Launcher {
 public:
  explicit Launcher(LaunchOptions options);
  ~Launcher();
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  int run();

 private:
  // kRejoin: another node restarted, left or waits to join; this node's ranks were stopped
  // for the next rendezvous round (not a failure of this node). kNothingToRejoin: ranks
  // restarted into the running round found no run there that takes them back.
  enum class Outcome { kSucceeded, kFailed, kInterrupted, kRejoin, kNothingToRejoin };

  // `intoLiveRound`: an elastic node's ranks restarted into the round that still runs.
  Outcome runAttempt(int restartCount, bool intoLiveRound = false);
  int runElastic();
  // Takes the round's node rank, node count and master as this attempt's.
  void applyRound(const ElasticRound& round);

  LaunchOptions options_;    // an elastic round changes the node rank, node count and master
  std::string tempDir_;      // holds the error files when there is no --log-dir
  bool keepTempDir_ = false; // a verdict named its flight dumps: they outlive the launcher
  std::string flightDir_;    // the ranks' flight-recorder dumps (TESSERA_FLIGHT_DIR)
  LaunchClock::time_point start_;
  std::unique_ptr<ChildProcesses> processes_;      // reads options_
  std::unique_ptr<ElasticRendezvous> rendezvous_;  // elastic runs only
  int64_t round_ = 0;                               // the elastic round the ranks run in
  int64_t otherNodesFailed_ = -1;                   // the last failure's (FailureReported)
};

Launcher::Launcher(LaunchOptions options) : options_(std::move(options)), start_(LaunchClock::now()) {
  if (options_.logDir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = strCat(tmp && *tmp ? tmp : "/tmp", "/tessera-run-XXXXXX");
    if (!::mkdtemp(pattern.data())) {
      throw Error(strCat("Launcher: cannot create a temporary directory '", pattern, "': ", errnoText(errno)));
    }
    tempDir_ = pattern;
  } else {
    std::error_code ec;
    std::filesystem::create_directories(options_.logDir, ec);
    if (ec) throw Error(strCat("--log-dir '", options_.logDir, "': cannot create directory: ", ec.message()));
  }
  const std::string fileDir = options_.logDir.empty() ? tempDir_ : options_.logDir;
  flightDir_ = fileDir + "/flight";
  processes_ = std::make_unique<ChildProcesses>(options_, fileDir);
}

Launcher::~Launcher() {
  processes_.reset();  // kills what is left before the folder goes
  if (!tempDir_.empty() && !keepTempDir_) {
    std::error_code ec;
    removeTree(tempDir_, ec);
  }
}

int Launcher::run() {
  if (options_.elastic()) return runElastic();
  const int nproc = options_.nprocPerNode;
  if (nproc > 1) {
    const char* omp = std::getenv("OMP_NUM_THREADS");
    if (!omp || !*omp) {
      TLOG_INFO("tessera-run: setting OMP_NUM_THREADS=1 for each of the " << nproc
                << " ranks (set OMP_NUM_THREADS to choose another value)");
    }
  }
  for (int restart = 0;; ++restart) {
    const Outcome outcome = runAttempt(restart);
    if (outcome == Outcome::kSucceeded) {
      std::string ranks = nproc == 1 ? "1 rank" : strCat("all ", nproc, " ranks");
      if (options_.nnodes > 1) ranks = strCat(nproc == 1 ? "1 local rank" : strCat("all ", nproc, " local ranks"),
                                              " of node ", options_.nodeRank);
      const std::string restarts = restart > 0 ? strCat(" (after ", restart, " restart", restart > 1 ? "s" : "", ")") : "";
      TLOG_INFO("tessera-run: " << ranks << " exited 0 in " << formatSeconds(secondsSince(start_)) << " s" << restarts
                << survivedFailures(flightDir_));
      return 0;
    }
    if (outcome == Outcome::kInterrupted) return 128 + processes_->firstSignal();
    const int status = failureExitStatus(*processes_->failure());
    if (status == kBadInputStatus) {
      // Bad configuration or arguments: a restart would fail the same way.
      if (restart < options_.maxRestarts) TLOG_ERROR("tessera-run: rank exited 2 (bad input): not restarting");
      return status;
    }
    if (restart >= options_.maxRestarts) {
      if (options_.maxRestarts > 0) {
        TLOG_ERROR("tessera-run: giving up after " << options_.maxRestarts << " restart"
                   << (options_.maxRestarts > 1 ? "s" : "") << " (--max-restarts " << options_.maxRestarts << ")");
      }
      return status;
    }
    TLOG_WARN("tessera-run: restarting all " << nproc << " ranks (restart " << restart + 1 << " of "
              << options_.maxRestarts << ")");
  }
}

Launcher::Outcome Launcher::runAttempt(int restartCount, bool intoLiveRound) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(flightDir_, ec)) {
    std::filesystem::remove(entry.path(), ec);  // a stale dump (of any rank, any node) must not either
  }
  processes_->startAll(restartCount, flightDir_, intoLiveRound);
  const int nproc = options_.nprocPerNode;
  const int world = options_.nnodes * nproc;
  const int firstRank = options_.nodeRank * nproc;
  TLOG_INFO("tessera-run: started " << nproc << " rank" << (nproc > 1 ? "s" : "") << " (RANK " << firstRank
            << (nproc > 1 ? strCat("-", firstRank + nproc - 1) : "") << " of WORLD_SIZE " << world << ", MASTER "
            << options_.masterAddr << ":" << options_.masterPort
            << (restartCount > 0 ? strCat(", restart ", restartCount) : "") << ") in "
            << formatSeconds(secondsSince(processes_->attemptStart()) * 1000.0, 1) << " ms ("
            << formatSeconds(secondsSince(start_) * 1000.0, 1) << " ms after launcher start)");

  auto lastPoll = LaunchClock::now();
  while (true) {
    processes_->pump(kPumpPeriodS);
    const int signal = processes_->firstSignal();
    if (rendezvous_ && !processes_->failure() && signal == 0 && secondsSince(lastPoll) >= kRendezvousPollS) {
      lastPoll = LaunchClock::now();
      if (rendezvous_->restartWanted(round_)) {
        TLOG_WARN("tessera-run: another node restarted, left or waits to join: stopping the local ranks for the "
                  "next rendezvous round");
        processes_->stopAll(SIGTERM, options_.gracePeriodS);
        return Outcome::kRejoin;
      }
    }
    if (signal != 0) {
      TLOG_WARN("tessera-run: got " << signalName(signal) << "; forwarding it to the ranks (Tessera's trainer "
                << "stops after its current step with a checkpoint). Waiting up to " << options_.gracePeriodS
                << " s for them; a second " << signalName(signal) << " (Ctrl-C) kills them now, "
                << "without a checkpoint");
      const double stoppedIn = processes_->stopAll(signal, options_.gracePeriodS);
      TLOG_WARN("tessera-run: ranks stopped in " << formatSeconds(stoppedIn) << " s after " << signalName(signal)
                << "; exiting with status " << 128 + signal);
      return Outcome::kInterrupted;
    }
    if (processes_->failure()) {
      const double stoppedIn = processes_->stopAll(SIGTERM, options_.gracePeriodS);
      if (intoLiveRound && failureExitStatus(*processes_->failure()) == kNothingToRejoinStatus) {
        return Outcome::kNothingToRejoin;
      }
      const FailureReport report{options_, *processes_, flightDir_, rendezvous_.get(), round_};
      const FailureReported reported = reportFailure(report, stoppedIn);
      otherNodesFailed_ = reported.otherNodesFailed;
      if (reported.verdictFromDumps && !tempDir_.empty()) {
        // The verdict points there: the folder is kept (it was deleted at exit before).
        keepTempDir_ = true;
        TLOG_ERROR("tessera-run: the dumps stay in " << flightDir_ << " (tessera-flight " << flightDir_
                   << " reads them again; --log-dir puts them elsewhere); delete " << tempDir_ << " when done");
      }
      // A signal during the teardown ends the run: no restart after the user said stop.
      return processes_->firstSignal() != 0 ? Outcome::kInterrupted : Outcome::kFailed;
    }
    if (!processes_->anyRunning()) {
      if (processes_->anyProcessLeft()) {
        TLOG_WARN("tessera-run: every rank exited 0 but left processes behind in its process group; stopping them");
        processes_->stopAll(SIGTERM, options_.gracePeriodS);
      } else {
        processes_->drainOutput();
      }
      return Outcome::kSucceeded;
    }
  }
}

void Launcher::applyRound(const ElasticRound& round) {
  const int before = options_.nnodes * options_.nprocPerNode;
  round_ = round.round;
  options_.nnodes = static_cast<int>(round.nodes.size());
  options_.nodeRank = round.nodeRank;
  options_.masterAddr = round.master().host;
  options_.masterPort = round.master().storePort;
  processes_->setNodeRank(options_.nodeRank);
  const int world = round.worldSize();
  std::string change;
  if (round.round > 1 && before != world) change = strCat(": world ", before, " -> ", world, " ranks");
  const std::string nodes = strCat(round.nodes.size(), " node", round.nodes.size() == 1 ? "" : "s", " of ",
                                   options_.minNodes, ":", options_.maxNodes);
  if (round.round == 1) {
    TLOG_INFO("tessera-run: rendezvous round 1: " << nodes << ", this one node rank " << round.nodeRank << ", world "
              << world << " ranks");
  } else {
    TLOG_WARN("tessera-run: rendezvous round " << round.round << ": " << nodes << ", this one node rank "
              << round.nodeRank << (change.empty() ? strCat(", world ", world, " ranks") : change)
              << (round.closedByQuorum ? strCat(" (closed as soon as every node still alive from round ",
                                                round.round - 1, " joined)")
                                       : std::string()));
  }
}

int Launcher::runElastic() {
  rendezvous_ = std::make_unique<ElasticRendezvous>(
      ElasticOptions{options_.runId, options_.rdzvEndpoint.substr(0, options_.rdzvEndpoint.rfind(':')),
                     std::stoi(options_.rdzvEndpoint.substr(options_.rdzvEndpoint.rfind(':') + 1)), options_.minNodes,
                     options_.maxNodes, options_.rdzvTimeoutS, options_.rdzvLastCallS},
      options_.nprocPerNode);
  int failures = 0;
  int restartsIntoRound = 0;  // of the ranks into the running round (0: join the next round)
  while (true) {
    if (restartsIntoRound == 0) {
      try {
        applyRound(rendezvous_->join([this] {
          processes_->pump(0);  // reads the signal pipe
          return processes_->firstSignal() != 0;
        }));
      } catch (const Error& e) {
        if (processes_->firstSignal() != 0) return 128 + processes_->firstSignal();
        TLOG_ERROR("tessera-run: " << e.what());
        return 1;
      }
    }
    // Every node's ranks must see the same TORCHELASTIC_RESTART_COUNT (it names the ranks'
    // rendezvous keys): the round's, not this launcher's own count of attempts. Ranks
    // restarted into the running round count on from it (a rejoining rank needs one > 0).
    const Outcome outcome = runAttempt(static_cast<int>(round_ - 1) + restartsIntoRound, restartsIntoRound > 0);
    if (outcome == Outcome::kSucceeded) {
      TLOG_INFO("tessera-run: all " << options_.nprocPerNode << " local ranks of node " << options_.nodeRank
                << " exited 0 in " << formatSeconds(secondsSince(start_)) << " s (round " << round_ << ")"
                << survivedFailures(flightDir_));
      rendezvous_->finished(round_, 60);
      return 0;
    }
    if (outcome == Outcome::kInterrupted) return 128 + processes_->firstSignal();
    if (outcome == Outcome::kRejoin) {  // not this node's failure
      restartsIntoRound = 0;
      continue;
    }
    if (outcome == Outcome::kNothingToRejoin) {  // the same restart, through the next round
      TLOG_WARN("tessera-run: the ranks found no run in round " << round_ << " to rejoin; joining the next rendezvous "
                "round");
      restartsIntoRound = 0;
      continue;
    }
    const int status = failureExitStatus(*processes_->failure());
    if (status == kBadInputStatus) return status;
    if (++failures > options_.maxRestarts) {
      if (options_.maxRestarts > 0) {
        TLOG_ERROR("tessera-run: giving up after " << options_.maxRestarts << " restart"
                   << (options_.maxRestarts > 1 ? "s" : "") << " (--max-restarts " << options_.maxRestarts << ")");
      }
      return status;
    }
    // No other node's ranks failed with these, and nobody opened a new round: the others
    // went on (tessera-train's fault.survive). Restart the ranks into their round, where such
    // a run takes them back; a program that finds none exits kNothingToRejoinStatus (or is
    // stopped when the others open the next round).
    // Node 0's rank 0 hosts the ranks' store: without it no run lives on.
    if (otherNodesFailed_ == 0 && options_.nodeRank != 0 && !rendezvous_->restartWanted(round_)) {
      ++restartsIntoRound;
      TLOG_WARN("tessera-run: restart " << failures << " of " << options_.maxRestarts << ": no other node's ranks "
                << "failed, so the run may live on without this node: restarting the local ranks into round "
                << round_ << " to rejoin it");
      continue;
    }
    restartsIntoRound = 0;
    TLOG_WARN("tessera-run: restart " << failures << " of " << options_.maxRestarts
              << ": joining the next rendezvous round");
  }
}

}  // namespace

int launch(LaunchOptions options) {
  validateLaunchOptions(options);
  if (options.standalone) {
    options.masterAddr = "127.0.0.1";
    options.masterPort = pickFreePort(options.masterAddr);
  }
  Launcher launcher(std::move(options));
  return launcher.run();
}

}  // namespace tessera::distributed
