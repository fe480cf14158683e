// The local ranks of tessera-run as processes (internal to the launcher, launcher.cpp):
// fork/exec with the ranks' environment, each rank in a process group of its own; one
// poll() loop over their output pipes and a self-pipe that the signal handler writes to;
// reaping, and the teardown that stops whole process groups (the signal, the grace period,
// SIGKILL). Single-threaded on purpose: fork() and signal handling stay simple.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <signal.h>
#include <string>
#include <utility>
#include <vector>

#include "common/clock.h"
#include "distributed/launcher.h"

namespace tessera::distributed {

using LaunchClock = SteadyClock;
// `seconds` with `precision` decimals, as the launcher's lines print times.
std::string formatSeconds(double seconds, int precision = 2);
// How a rank's leader process ended, in words: "exit code 7", "killed by signal SIGKILL".
std::string describeStatus(int waitStatus);

// One local rank's output stream (stdout or stderr) as the launcher reads it.
struct RankStream {
  int fd = -1;
  int consoleFd = -1;    // the launcher's stdout or stderr
  std::string pending;   // the partial line read so far
};

struct RankProcess {
  int localRank = 0;
  int globalRank = 0;
  pid_t pid = -1;        // also the process group id
  bool running = false;  // started and not yet reaped
  int waitStatus = 0;
  std::string execError; // set when execvp() failed
  RankStream out;
  RankStream err;
  int logFd = -1;        // --log-dir's rank log, -1 without
  std::string errorFile; // its TORCHELASTIC_ERROR_FILE
  bool killed = false;   // the launcher sent SIGKILL: it outlived SIGTERM's grace period
  bool stopped = false;  // found stopped (SIGSTOP, a debugger) when the launcher tore the run down
};

// The first rank of an attempt that failed: exited non-zero, killed, or could not start.
struct RankFailure {
  int globalRank = 0;
  int waitStatus = 0;
  std::string execError;
  double afterS = 0;     // since the attempt started
};

class ChildProcesses {
 public:
  // Local ranks 0..nprocPerNode-1 of node options.nodeRank; each rank's error file (and with
  // --log-dir its log, created fresh now) in `fileDir`. Installs the signal handlers.
  ChildProcesses(const LaunchOptions& options, const std::string& fileDir);
  // Kills what is left (only after an exception), restores the handlers, closes the files.
  ~ChildProcesses();
  ChildProcesses(const ChildProcesses&) = delete;
  ChildProcesses& operator=(const ChildProcesses&) = delete;

  // Starts every local rank for attempt `restartCount` (its TORCHELASTIC_RESTART_COUNT),
  // their flight-recorder dumps to `flightDir`; forgets the previous attempt's failure.
  // `intoLiveRound`: restarted into an elastic round whose other nodes' ranks went on
  // (kRestartedIntoLiveRoundEnv set for them).
  void startAll(int restartCount, const std::string& flightDir, bool intoLiveRound = false);
  // Sets the ranks' global ranks for node `nodeRank` (an elastic round's).
  void setNodeRank(int nodeRank);
  // Waits up to `timeoutS` for output or a signal, prints and logs the ranks' lines, reaps.
  void pump(double timeoutS);
  // Sends `signal` to every rank's process group and waits out `gracePeriodS` (unless a
  // further signal to the launcher asks to hurry), then SIGKILL; drains the output.
  // Returns the seconds it took. Exits while stopping are not failures.
  double stopAll(int signal, double gracePeriodS);
  // Reads what the ranks wrote until their pipes close (bounded).
  void drainOutput();
  bool anyRunning() const;
  // A rank running, or a process left in a rank's process group.
  bool anyProcessLeft() const;

  const std::optional<RankFailure>& failure() const { return failure_; }
  // The first signal the launcher got (SIGINT, SIGTERM, SIGHUP, SIGQUIT), 0 before one.
  int firstSignal() const { return firstSignal_; }
  const std::vector<RankProcess>& ranks() const { return ranks_; }
  LaunchClock::time_point attemptStart() const { return attemptStart_; }

 private:
  void installSignalHandlers();
  void restoreSignalHandlers();
  void spawn(RankProcess& rank, int restartCount, const std::string& flightDir, bool intoLiveRound);
  pid_t forkRank(const RankProcess& rank, const int outPipe[2], const int errPipe[2], int execPipe, char** argv,
                 char** envp);
  // Waits until the rank's program runs or its execvp() fails (then sets rank.execError).
  void waitForExec(RankProcess& rank, int execPipe);
  [[noreturn]] void execChild(const int outPipe[2], const int errPipe[2], int execPipe, char** argv, char** envp);
  void readOutput(RankProcess& rank, RankStream& stream);
  void emitLine(RankProcess& rank, RankStream& stream, const std::string& line);
  void closeStream(RankProcess& rank, RankStream& stream);
  void reapChildren();
  bool anyStreamOpen() const;
  void signalGroups(int signal) const;
  void killEverythingNow();

  const LaunchOptions& options_;
  bool console_ = true;
  std::vector<RankProcess> ranks_;
  int devNull_ = -1;         // the ranks' stdin
  int signalsReceived_ = 0;
  int firstSignal_ = 0;
  bool stopping_ = false;
  std::optional<RankFailure> failure_;
  LaunchClock::time_point attemptStart_ = LaunchClock::now();
  std::vector<std::pair<int, struct sigaction>> savedActions_;
};

}  // namespace tessera::distributed
