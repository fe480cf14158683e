// tessera-run's launcher core (see launcher.h): fork/exec of the local ranks, a poll()
// loop over their output pipes and a self-pipe for signals, and the teardown that stops
// whole process groups. Single-threaded on purpose: fork() and signal handling stay simple.
// The options' checks, the ranks' environment and the small shared helpers are in
// launch_options.cpp; this file is the Launcher class that launch() runs (kept here: it
// has no user but launch()).
#include "distributed/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <sstream>

#include "common/errors.h"
#include "common/file_open.h"
#include "common/filesystem.h"
#include "common/logging.h"
#include "diagnostics/flight_verdict.h"
#include "distributed/elastic_rendezvous.h"

extern char** environ;

namespace tessera::distributed {
namespace {

using Clock = std::chrono::steady_clock;

// Signals the launcher forwards to every rank's process group.
constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
// After SIGKILL, how long to wait for the process groups to disappear before giving up.
constexpr double kKillWaitS = 5.0;
// After the ranks are gone, how long to wait for their pipes to close: a process that left
// the rank's process group (setsid) can hold them open forever.
constexpr double kDrainWaitS = 1.0;
// Poll period: bounds how late the launcher notices a grandchild's exit on systems
// without a child subreaper (children's exits wake it at once through SIGCHLD).
constexpr double kPollPeriodS = 0.05;
// A rank line longer than this is printed in pieces rather than buffered without bound.
constexpr size_t kMaxLineBytes = 64 * 1024;

// Self-pipe: the signal handler writes the signal number, the poll() loop reads it.
int g_signalPipe[2] = {-1, -1};

extern "C" void onSignal(int signal) {
  const int savedErrno = errno;
  const unsigned char byte = static_cast<unsigned char>(signal);
  [[maybe_unused]] const ssize_t ignored = ::write(g_signalPipe[1], &byte, 1);
  errno = savedErrno;
}

double secondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string formatSeconds(double seconds, int precision = 2) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(precision) << seconds;
  return out.str();
}


void setFdFlag(int fd, int getCmd, int setCmd, int flag) {
  const int flags = ::fcntl(fd, getCmd);
  if (flags < 0 || ::fcntl(fd, setCmd, flags | flag) < 0) {
    throw Error(strCat("Launcher: fcntl on fd ", fd, " failed: ", errnoText(errno)));
  }
}

// A pipe whose ends are not inherited by exec'd programs (the child dup2()s what it needs).
void makePipe(int fds[2]) {
  if (::pipe(fds) != 0) throw Error(strCat("Launcher: pipe() failed: ", errnoText(errno)));
  setFdFlag(fds[0], F_GETFD, F_SETFD, FD_CLOEXEC);
  setFdFlag(fds[1], F_GETFD, F_SETFD, FD_CLOEXEC);
}

void closeFd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// Writes everything unless the reader is gone (EPIPE: SIGPIPE is ignored) or the fd
// fails; rank output must never stop the launcher.
void writeAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    done += static_cast<size_t>(n);
  }
}

// How a rank's leader process ended, in words: "exit code 7", "killed by signal SIGKILL".
std::string describeStatus(int waitStatus) {
  if (WIFSIGNALED(waitStatus)) return strCat("killed by signal ", signalName(WTERMSIG(waitStatus)));
  return strCat("exit code ", WEXITSTATUS(waitStatus));
}

// Whether process `pid` is stopped (state T or t in /proc/<pid>/stat; false where there is no /proc).
bool isStopped(pid_t pid) {
  // procfs files report size 0: read until EOF rather than by size.
  const int fd = ::open(strCat("/proc/", pid, "/stat").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buffer[1024];
  const ssize_t n = ::read(fd, buffer, sizeof buffer);
  ::close(fd);
  if (n <= 0) return false;
  const std::string stat(buffer, static_cast<size_t>(n));
  const size_t paren = stat.rfind(')');  // "pid (comm) S ...": comm may hold spaces and parentheses
  return paren != std::string::npos && paren + 2 < stat.size() && (stat[paren + 2] == 'T' || stat[paren + 2] == 't');
}

bool isFailure(int waitStatus) { return !WIFEXITED(waitStatus) || WEXITSTATUS(waitStatus) != 0; }

// What Tessera's programs exit with on bad configuration or arguments (common/app_main.h).
constexpr int kBadInputStatus = 2;

// A rank's argv and environment as exec wants them (null-terminated char* arrays into the
// strings held here), built before fork(): the parent's environment with the rank's
// variables (rankEnvironment) replacing any of the same name. Neither copied nor moved,
// so the pointers stay valid.
struct ChildCommand {
  ChildCommand(const LaunchOptions& options, int localRank, int restartCount, const std::string& errorFile,
               const std::string& flightDir) {
    auto overrides = rankEnvironment(options, localRank, restartCount, errorFile, std::getenv("OMP_NUM_THREADS"));
    // Where Tessera's programs also write their flight-recorder dump, for the verdict.
    overrides["TESSERA_FLIGHT_DIR"] = flightDir;
    for (char** entry = environ; *entry; ++entry) {
      const std::string kv = *entry;
      if (overrides.count(kv.substr(0, kv.find('='))) == 0) envStrings.push_back(kv);
    }
    for (const auto& [key, value] : overrides) envStrings.push_back(key + "=" + value);
    for (std::string& s : envStrings) envp.push_back(s.data());
    envp.push_back(nullptr);
    argStrings = options.command;
    for (std::string& s : argStrings) argv.push_back(s.data());
    argv.push_back(nullptr);
  }
  ChildCommand(const ChildCommand&) = delete;
  ChildCommand& operator=(const ChildCommand&) = delete;

  std::vector<std::string> envStrings;
  std::vector<char*> envp;
  std::vector<std::string> argStrings;
  std::vector<char*> argv;
};

class Launcher {
 public:
  explicit Launcher(LaunchOptions options);
  ~Launcher();
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  int run();

 private:
  struct OutputStream {
    int fd = -1;
    int consoleFd = -1;    // the launcher's stdout or stderr
    std::string pending;   // the partial line read so far
  };
  struct Rank {
    int localRank = 0;
    int globalRank = 0;
    pid_t pid = -1;        // also the process group id
    bool running = false;  // started and not yet reaped
    int waitStatus = 0;
    std::string execError; // set when execvp() failed
    OutputStream out;
    OutputStream err;
    int logFd = -1;
    std::string errorFile;
    bool killed = false;   // the launcher sent SIGKILL: it outlived SIGTERM's grace period
    bool stopped = false;  // found stopped (SIGSTOP, a debugger) when the launcher tore the run down
  };
  struct Failure {
    int globalRank = 0;
    int waitStatus = 0;
    std::string execError;
    double afterS = 0;     // since the attempt started
  };
  // kRejoin: another node restarted, left or waits to join; this node's ranks were stopped
  // for the next rendezvous round (not a failure of this node).
  enum class Outcome { kSucceeded, kFailed, kInterrupted, kRejoin };

  void installSignalHandlers();
  void restoreSignalHandlers();
  Outcome runAttempt(int restartCount);
  int runElastic();
  // Takes the round's node rank, node count and master as this attempt's.
  void applyRound(const ElasticRound& round);
  void spawn(Rank& rank, int restartCount);
  // Forks the rank's process, which runs execChild; returns its pid (throws if fork() fails).
  pid_t forkRank(const Rank& rank, const int outPipe[2], const int errPipe[2], int execPipe, char** argv, char** envp);
  // Waits until the rank's program runs or its execvp() fails (then sets rank.execError).
  void waitForExec(Rank& rank, int execPipe);
  [[noreturn]] void execChild(const int outPipe[2], const int errPipe[2], int execPipe, char** argv, char** envp);
  void pump(double timeoutS);
  void readOutput(Rank& rank, OutputStream& stream);
  void emitLine(Rank& rank, OutputStream& stream, const std::string& line);
  void closeStream(Rank& rank, OutputStream& stream);
  void reapChildren();
  bool anyProcessLeft() const;
  bool anyStreamOpen() const;
  void signalGroups(int signal) const;
  double stopRanks(int signal);
  // Reads what the ranks wrote until their pipes close (bounded by kDrainWaitS).
  void drainOutput();
  void killEverythingNow();
  void reportFailure(double stoppedInS);
  // The flight recorder's verdict from the ranks' dumps (this node's and, through the
  // rendezvous or a server at MASTER_PORT + 1 in a static multi-node run, the others'),
  // logged line by line.
  void reportVerdict();
  // This node's dumps by file name (rank_<r>.json).
  std::map<std::string, std::string> localDumps() const;
  // Sends this node's dumps to the other nodes and writes theirs into the flight dir: through
  // the elastic rendezvous, or in a static multi-node run through a server at
  // MASTER_PORT + 1 that the first launcher to fail hosts for the others.
  void fetchOtherNodesDumps(const std::map<std::string, std::string>& mine);
  // How `rank` ended, in words, for the verdict.
  std::string fateOf(const Rank& rank) const;
  // The launcher's exit status for a failed rank: the rank's own exit status (2: bad
  // input), or 1 when it was killed by a signal or could not start.
  static int failureExitStatus(const Failure& f);

  LaunchOptions options_;
  bool console_ = true;
  std::vector<Rank> ranks_;
  std::string tempDir_;      // holds the error files when there is no --log-dir
  bool keepTempDir_ = false; // a verdict named its flight dumps: they outlive the launcher
  std::string flightDir_;    // the ranks' flight-recorder dumps (TESSERA_FLIGHT_DIR)
  int devNull_ = -1;         // the ranks' stdin
  int signalsReceived_ = 0;
  int firstSignal_ = 0;
  bool stopping_ = false;    // exits while stopping are not failures
  std::optional<Failure> failure_;
  Clock::time_point start_;
  Clock::time_point attemptStart_;
  std::vector<std::pair<int, struct sigaction>> savedActions_;
  std::unique_ptr<ElasticRendezvous> rendezvous_;  // elastic runs only
  int64_t round_ = 0;                               // the elastic round the ranks run in
};

Launcher::Launcher(LaunchOptions options) : options_(std::move(options)), start_(Clock::now()) {
  console_ = options_.logDir.empty() || options_.tee;

  // Make sure fds 0-2 exist, so no pipe lands on them and confuses the children's dup2().
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) < 0) ::open("/dev/null", O_RDWR);
  }
  devNull_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devNull_ < 0) throw Error(strCat("Launcher: cannot open /dev/null: ", errnoText(errno)));

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

  flightDir_ = strCat(options_.logDir.empty() ? tempDir_ : options_.logDir, "/flight");
  const int nproc = options_.nprocPerNode;
  ranks_.resize(static_cast<size_t>(nproc));
  for (int local = 0; local < nproc; ++local) {
    Rank& rank = ranks_[static_cast<size_t>(local)];
    rank.localRank = local;
    rank.globalRank = options_.nodeRank * nproc + local;
    rank.out.consoleFd = STDOUT_FILENO;
    rank.err.consoleFd = STDERR_FILENO;
    const std::string dir = options_.logDir.empty() ? tempDir_ : options_.logDir;
    // Elastic: a rank's global rank may change from round to round; its files keep the local one.
    const std::string name = options_.elastic() ? strCat("local_rank_", local) : strCat("rank_", rank.globalRank);
    rank.errorFile = strCat(dir, "/", name, ".error.json");
    if (!options_.logDir.empty()) {
      const std::string logFile = strCat(options_.logDir, "/", name, ".log");
      try {
        rank.logFd = createFreshFile(logFile);  // never through a link planted at the name
      } catch (const Error& e) {
        throw Error(strCat("--log-dir: ", e.what()));
      }
    }
  }
  installSignalHandlers();
#ifdef __linux__
  // Orphaned grandchildren are re-parented to the launcher, which reaps them: no zombies
  // left behind by ranks whose helpers outlive them.
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
#endif
}

Launcher::~Launcher() {
  killEverythingNow();
  restoreSignalHandlers();
  for (Rank& rank : ranks_) {
    closeFd(rank.out.fd);
    closeFd(rank.err.fd);
    closeFd(rank.logFd);
  }
  closeFd(devNull_);
  if (!tempDir_.empty() && !keepTempDir_) {
    std::error_code ec;
    removeTree(tempDir_, ec);
  }
}

void Launcher::installSignalHandlers() {
  makePipe(g_signalPipe);
  setFdFlag(g_signalPipe[0], F_GETFL, F_SETFL, O_NONBLOCK);
  setFdFlag(g_signalPipe[1], F_GETFL, F_SETFL, O_NONBLOCK);
  struct sigaction action {};
  action.sa_handler = onSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  std::vector<int> handled(std::begin(kForwardedSignals), std::end(kForwardedSignals));
  handled.push_back(SIGCHLD);
  for (int sig : handled) {
    struct sigaction old {};
    ::sigaction(sig, &action, &old);
    savedActions_.emplace_back(sig, old);
  }
  // A closed console (`tessera-run ... | head`) must not kill the launcher and orphan the ranks.
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  struct sigaction old {};
  ::sigaction(SIGPIPE, &ignore, &old);
  savedActions_.emplace_back(SIGPIPE, old);
}

void Launcher::restoreSignalHandlers() {
  for (const auto& [sig, action] : savedActions_) ::sigaction(sig, &action, nullptr);
  savedActions_.clear();
  closeFd(g_signalPipe[0]);
  closeFd(g_signalPipe[1]);
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
      TLOG_INFO("tessera-run: " << ranks << " exited 0 in " << formatSeconds(secondsSince(start_)) << " s" << restarts);
      return 0;
    }
    if (outcome == Outcome::kInterrupted) return 128 + firstSignal_;
    const int status = failureExitStatus(*failure_);
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

Launcher::Outcome Launcher::runAttempt(int restartCount) {
  failure_.reset();
  attemptStart_ = Clock::now();
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(flightDir_, ec)) {
    std::filesystem::remove(entry.path(), ec);  // a stale dump (of any rank, any node) must not either
  }
  for (Rank& rank : ranks_) {
    std::remove(rank.errorFile.c_str());  // a stale message must not be blamed on this attempt
    rank.killed = false;
    if (rank.logFd >= 0 && restartCount > 0) {
      writeAll(rank.logFd, strCat("tessera-run: restart ", restartCount, " of ", options_.maxRestarts,
                                  " (TORCHELASTIC_RESTART_COUNT=", restartCount, ")\n"));
    }
    spawn(rank, restartCount);
  }
  const int nproc = options_.nprocPerNode;
  const int world = options_.nnodes * nproc;
  const int firstRank = options_.nodeRank * nproc;
  TLOG_INFO("tessera-run: started " << nproc << " rank" << (nproc > 1 ? "s" : "") << " (RANK " << firstRank
            << (nproc > 1 ? strCat("-", firstRank + nproc - 1) : "") << " of WORLD_SIZE " << world << ", MASTER "
            << options_.masterAddr << ":" << options_.masterPort
            << (restartCount > 0 ? strCat(", restart ", restartCount) : "") << ") in "
            << formatSeconds(secondsSince(attemptStart_) * 1000.0, 1) << " ms ("
            << formatSeconds(secondsSince(start_) * 1000.0, 1) << " ms after launcher start)");

  auto lastPoll = Clock::now();
  while (true) {
    pump(kPollPeriodS * 10);
    if (rendezvous_ && !failure_ && firstSignal_ == 0 && secondsSince(lastPoll) >= 1.0) {
      lastPoll = Clock::now();
      if (rendezvous_->restartWanted(round_)) {
        TLOG_WARN("tessera-run: another node restarted, left or waits to join: stopping the local ranks for the "
                  "next rendezvous round");
        stopRanks(SIGTERM);
        return Outcome::kRejoin;
      }
    }
    if (firstSignal_ != 0) {
      TLOG_WARN("tessera-run: got " << signalName(firstSignal_) << "; forwarding it to the ranks (Tessera's trainer "
                << "stops after its current step with a checkpoint). Waiting up to " << options_.gracePeriodS
                << " s for them; a second " << signalName(firstSignal_) << " (Ctrl-C) kills them now, "
                << "without a checkpoint");
      const double stoppedIn = stopRanks(firstSignal_);
      TLOG_WARN("tessera-run: ranks stopped in " << formatSeconds(stoppedIn) << " s after "
                << signalName(firstSignal_) << "; exiting with status " << 128 + firstSignal_);
      return Outcome::kInterrupted;
    }
    if (failure_) {
      const double stoppedIn = stopRanks(SIGTERM);
      reportFailure(stoppedIn);
      // A signal during the teardown ends the run: no restart after the user said stop.
      return firstSignal_ != 0 ? Outcome::kInterrupted : Outcome::kFailed;
    }
    if (!std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.running; })) {
      if (anyProcessLeft()) {
        TLOG_WARN("tessera-run: every rank exited 0 but left processes behind in its process group; stopping them");
        stopRanks(SIGTERM);
      } else {
        drainOutput();
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
  for (Rank& rank : ranks_) rank.globalRank = options_.nodeRank * options_.nprocPerNode + rank.localRank;
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
              << round.nodeRank << (change.empty() ? strCat(", world ", world, " ranks") : change));
  }
}

int Launcher::runElastic() {
  rendezvous_ = std::make_unique<ElasticRendezvous>(
      ElasticOptions{options_.runId, options_.rdzvEndpoint.substr(0, options_.rdzvEndpoint.rfind(':')),
                     std::stoi(options_.rdzvEndpoint.substr(options_.rdzvEndpoint.rfind(':') + 1)), options_.minNodes,
                     options_.maxNodes, options_.rdzvTimeoutS, options_.rdzvLastCallS},
      options_.nprocPerNode);
  int failures = 0;
  while (true) {
    try {
      applyRound(rendezvous_->join([this] {
        pump(0);  // reads the signal pipe
        return firstSignal_ != 0;
      }));
    } catch (const Error& e) {
      if (firstSignal_ != 0) return 128 + firstSignal_;
      TLOG_ERROR("tessera-run: " << e.what());
      return 1;
    }
    // Every node's ranks must see the same TORCHELASTIC_RESTART_COUNT (it names the ranks'
    // rendezvous keys): the round's, not this launcher's own count of attempts.
    const Outcome outcome = runAttempt(static_cast<int>(round_ - 1));
    if (outcome == Outcome::kSucceeded) {
      TLOG_INFO("tessera-run: all " << options_.nprocPerNode << " local ranks of node " << options_.nodeRank
                << " exited 0 in " << formatSeconds(secondsSince(start_)) << " s (round " << round_ << ")");
      rendezvous_->finished(round_, 60);
      return 0;
    }
    if (outcome == Outcome::kInterrupted) return 128 + firstSignal_;
    if (outcome == Outcome::kRejoin) continue;  // not this node's failure
    const int status = failureExitStatus(*failure_);
    if (status == kBadInputStatus) return status;
    if (++failures > options_.maxRestarts) {
      if (options_.maxRestarts > 0) {
        TLOG_ERROR("tessera-run: giving up after " << options_.maxRestarts << " restart"
                   << (options_.maxRestarts > 1 ? "s" : "") << " (--max-restarts " << options_.maxRestarts << ")");
      }
      return status;
    }
    TLOG_WARN("tessera-run: restart " << failures << " of " << options_.maxRestarts
              << ": joining the next rendezvous round");
  }
}

void Launcher::spawn(Rank& rank, int restartCount) {
  // Everything the child needs is built before fork(): the child only calls
  // async-signal-safe functions.
  ChildCommand child(options_, rank.localRank, restartCount, rank.errorFile, flightDir_);
  int outPipe[2], errPipe[2], execPipe[2];
  makePipe(outPipe);
  makePipe(errPipe);
  makePipe(execPipe);
  const pid_t pid = forkRank(rank, outPipe, errPipe, execPipe[1], child.argv.data(), child.envp.data());

  // Also set in the child; doing it here too closes the race with an early killpg().
  ::setpgid(pid, pid);
  rank.pid = pid;
  rank.running = true;
  rank.waitStatus = 0;
  rank.execError.clear();
  ::close(outPipe[1]);
  ::close(errPipe[1]);
  ::close(execPipe[1]);
  rank.out.fd = outPipe[0];
  rank.err.fd = errPipe[0];
  rank.out.pending.clear();
  rank.err.pending.clear();
  setFdFlag(rank.out.fd, F_GETFL, F_SETFL, O_NONBLOCK);
  setFdFlag(rank.err.fd, F_GETFL, F_SETFL, O_NONBLOCK);
  waitForExec(rank, execPipe[0]);
}

pid_t Launcher::forkRank(const Rank& rank, const int outPipe[2], const int errPipe[2], int execPipe, char** argv,
                         char** envp) {
  // Signals stay blocked across fork() so that none runs the launcher's handler in the
  // child (which still shares the self-pipe) before the child resets it.
  sigset_t all, previous;
  sigfillset(&all);
  ::sigprocmask(SIG_BLOCK, &all, &previous);
  const pid_t pid = ::fork();
  if (pid == 0) execChild(outPipe, errPipe, execPipe, argv, envp);
  const int forkErrno = errno;
  ::sigprocmask(SIG_SETMASK, &previous, nullptr);
  if (pid < 0) throw Error(strCat("Launcher: fork() for rank ", rank.globalRank, " failed: ", errnoText(forkErrno)));
  return pid;
}

void Launcher::waitForExec(Rank& rank, int execPipe) {
  // The exec pipe closes on a successful exec (FD_CLOEXEC) or carries execvp()'s errno.
  // Waiting for it makes "started" mean "running PROGRAM".
  int childErrno = 0;
  ssize_t n;
  do {
    n = ::read(execPipe, &childErrno, sizeof childErrno);
  } while (n < 0 && errno == EINTR);
  ::close(execPipe);
  if (n == static_cast<ssize_t>(sizeof childErrno)) {
    rank.execError = strCat("cannot execute '", options_.command[0], "': ", errnoText(childErrno));
  }
}

void Launcher::execChild(const int outPipe[2], const int errPipe[2], int execPipe, char** argv, char** envp) {
  // The program gets default signal dispositions and an empty mask (exec keeps ignored
  // signals and the mask). Signals are still blocked here, from before fork().
  for (int sig : kForwardedSignals) ::signal(sig, SIG_DFL);
  ::signal(SIGCHLD, SIG_DFL);
  ::signal(SIGPIPE, SIG_DFL);
  ::setpgid(0, 0);
#ifdef __linux__
  // If the launcher is killed outright (SIGKILL), its ranks still get SIGTERM.
  const pid_t launcherPid = ::getppid();
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (::getppid() != launcherPid) ::_exit(1);
#endif
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::dup2(devNull_, STDIN_FILENO);
  ::dup2(outPipe[1], STDOUT_FILENO);
  ::dup2(errPipe[1], STDERR_FILENO);
  environ = envp;
  ::execvp(argv[0], argv);
  const int error = errno;
  [[maybe_unused]] const ssize_t ignored = ::write(execPipe, &error, sizeof error);
  ::_exit(127);
}

void Launcher::pump(double timeoutS) {
  std::vector<pollfd> fds;
  std::vector<std::pair<Rank*, OutputStream*>> owners;
  fds.push_back({g_signalPipe[0], POLLIN, 0});
  owners.emplace_back(nullptr, nullptr);
  for (Rank& rank : ranks_) {
    for (OutputStream* stream : {&rank.out, &rank.err}) {
      if (stream->fd < 0) continue;
      fds.push_back({stream->fd, POLLIN, 0});
      owners.emplace_back(&rank, stream);
    }
  }
  const int timeoutMs = std::max(0, static_cast<int>(std::ceil(timeoutS * 1000.0)));
  const int ready = ::poll(fds.data(), fds.size(), timeoutMs);
  if (ready < 0 && errno != EINTR) throw Error(strCat("Launcher: poll() failed: ", errnoText(errno)));
  if (ready > 0) {
    if (fds[0].revents & POLLIN) {
      unsigned char sig;
      while (::read(g_signalPipe[0], &sig, 1) == 1) {
        if (sig == SIGCHLD) continue;  // reaped below, whatever woke us
        ++signalsReceived_;
        if (firstSignal_ == 0) firstSignal_ = sig;
      }
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) readOutput(*owners[i].first, *owners[i].second);
    }
  }
  reapChildren();
}

void Launcher::readOutput(Rank& rank, OutputStream& stream) {
  char buffer[64 * 1024];
  const ssize_t n = ::read(stream.fd, buffer, sizeof buffer);
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  if (n <= 0) {  // EOF: every writer (the rank and its children) is gone
    closeStream(rank, stream);
    return;
  }
  stream.pending.append(buffer, static_cast<size_t>(n));
  size_t start = 0;
  for (size_t newline; (newline = stream.pending.find('\n', start)) != std::string::npos; start = newline + 1) {
    emitLine(rank, stream, stream.pending.substr(start, newline - start));
  }
  stream.pending.erase(0, start);
  while (stream.pending.size() >= kMaxLineBytes) {
    emitLine(rank, stream, stream.pending.substr(0, kMaxLineBytes));
    stream.pending.erase(0, kMaxLineBytes);
  }
}

void Launcher::emitLine(Rank& rank, OutputStream& stream, const std::string& line) {
  if (rank.logFd >= 0) writeAll(rank.logFd, line + "\n");
  if (console_) writeAll(stream.consoleFd, strCat("[rank ", rank.globalRank, "]: ", line, "\n"));
}

void Launcher::closeStream(Rank& rank, OutputStream& stream) {
  if (!stream.pending.empty()) emitLine(rank, stream, stream.pending);
  stream.pending.clear();
  closeFd(stream.fd);
}

void Launcher::reapChildren() {
  while (true) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;  // 0: none exited; -1/ECHILD: no children at all
    for (Rank& rank : ranks_) {
      if (rank.pid != pid || !rank.running) continue;
      rank.running = false;
      rank.waitStatus = status;
      if ((isFailure(status) || !rank.execError.empty()) && !stopping_ && !failure_) {
        failure_ = Failure{rank.globalRank, status, rank.execError, secondsSince(attemptStart_)};
      }
    }
    // Other pids are grandchildren re-parented to the launcher (child subreaper).
  }
}

bool Launcher::anyProcessLeft() const {
  for (const Rank& rank : ranks_) {
    if (rank.running) return true;
    // The rank's own process is gone, but its process group may still have members.
    if (rank.pid > 0 && (::kill(-rank.pid, 0) == 0 || errno == EPERM)) return true;
  }
  return false;
}

bool Launcher::anyStreamOpen() const {
  return std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.out.fd >= 0 || r.err.fd >= 0; });
}

void Launcher::signalGroups(int signal) const {
  for (const Rank& rank : ranks_) {
    if (rank.pid > 0) ::kill(-rank.pid, signal);  // ESRCH: that group is already gone
  }
}

double Launcher::stopRanks(int signal) {
  const auto start = Clock::now();
  stopping_ = true;
  const int signalsBefore = signalsReceived_;
  // Checked before the signal: a rank's own handler must not be mistaken for a stop.
  if (signal == SIGTERM) {
    for (Rank& rank : ranks_) rank.stopped = rank.running && isStopped(rank.pid);
  }
  signalGroups(signal);
  // A stopped rank (SIGSTOP, a debugger) is left stopped: it gets SIGKILL after the grace
  // period. Woken up instead, it would run into its peers' closed sockets before it could
  // say where it stood; the verdict names it from its state and the others' dumps.
  // Wait out the grace period, unless another signal to the launcher asks to hurry.
  while (anyProcessLeft() && secondsSince(start) < options_.gracePeriodS && signalsReceived_ == signalsBefore) {
    pump(std::min(kPollPeriodS, options_.gracePeriodS - secondsSince(start)));
  }
  if (anyProcessLeft()) {
    TLOG_WARN("tessera-run: ranks still running " << formatSeconds(secondsSince(start)) << " s after "
              << signalName(signal) << "; sending SIGKILL");
    for (Rank& rank : ranks_) rank.killed = rank.running;
    signalGroups(SIGKILL);
    const auto killStart = Clock::now();
    while (anyProcessLeft() && secondsSince(killStart) < kKillWaitS) pump(kPollPeriodS);
    if (anyProcessLeft()) {
      TLOG_ERROR("tessera-run: some rank processes survived SIGKILL for " << kKillWaitS << " s; giving up on them");
    }
  }
  drainOutput();
  stopping_ = false;
  return secondsSince(start);
}

void Launcher::drainOutput() {
  const auto start = Clock::now();
  while (anyStreamOpen() && secondsSince(start) < kDrainWaitS) pump(kDrainWaitS - secondsSince(start));
  for (Rank& rank : ranks_) {
    closeStream(rank, rank.out);
    closeStream(rank, rank.err);
  }
}

void Launcher::killEverythingNow() {
  // Only reached with live ranks when run() threw; never leave orphans behind.
  if (!anyProcessLeft()) return;
  signalGroups(SIGKILL);
  for (Rank& rank : ranks_) {
    if (rank.running && ::waitpid(rank.pid, nullptr, 0) == rank.pid) rank.running = false;
  }
}

int Launcher::failureExitStatus(const Failure& f) {
  if (!f.execError.empty() || !WIFEXITED(f.waitStatus)) return 1;
  return WEXITSTATUS(f.waitStatus);
}

void Launcher::reportFailure(double stoppedInS) {
  const Failure& f = *failure_;
  const std::string how = f.execError.empty() ? describeStatus(f.waitStatus) : f.execError;
  const int others = options_.nprocPerNode - 1;
  TLOG_ERROR("tessera-run: rank " << f.globalRank << " failed (" << how << ") after " << formatSeconds(f.afterS)
             << " s; stopped the other " << others << " rank" << (others == 1 ? "" : "s") << " in "
             << formatSeconds(stoppedInS, 3) << " s");
  // Every rank's message (the ranks leave their console to the launcher when their error
  // file is written): a config error all ranks found is one line, not one per rank.
  std::map<int, std::string> messages;
  for (const Rank& rank : ranks_) {
    if (auto message = readErrorFile(rank.errorFile)) messages[rank.globalRank] = std::move(*message);
  }
  for (const std::string& line : foldRankErrors(messages, f.globalRank)) TLOG_ERROR("tessera-run: " << line);
  if (failureExitStatus(f) != kBadInputStatus) reportVerdict();  // a refused config says all there is
}

std::map<std::string, std::string> Launcher::localDumps() const {
  std::map<std::string, std::string> dumps;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(flightDir_, ec)) {
    try {
      dumps[entry.path().filename().string()] = readRegularFile(entry.path().string(), int64_t{64} << 20,
                                                                LinkPolicy::kRefuse);
    } catch (const Error&) {
      // Not a dump (or not readable): the verdict reports what it cannot read.
    }
  }
  return dumps;
}

void Launcher::fetchOtherNodesDumps(const std::map<std::string, std::string>& mine) {
  std::unique_ptr<ElasticRendezvous> staticExchange;
  ElasticRendezvous* exchange = rendezvous_.get();
  if (exchange == nullptr && options_.nnodes > 1 && !mine.empty()) {  // no dumps: not a Tessera program
    try {
      ElasticOptions o;
      o.runId = options_.runId;
      o.host = options_.masterAddr;
      o.port = options_.masterPort < 65535 ? options_.masterPort + 1 : options_.masterPort - 1;
      o.minNodes = o.maxNodes = options_.nnodes;
      o.quiet = true;
      staticExchange = std::make_unique<ElasticRendezvous>(o, options_.nprocPerNode);
      exchange = staticExchange.get();
    } catch (const std::exception& e) {
      TLOG_WARN("tessera-run: the other nodes' flight dumps: " << e.what());
    }
  }
  if (exchange == nullptr) return;
  const int expected = rendezvous_ ? 0 : options_.nnodes;
  for (const auto& [name, text] : exchange->exchangeDumps(round_, mine, 5.0, expected)) {
    if (mine.count(name) != 0 || name.find('/') != std::string::npos || name.rfind("rank_", 0) != 0) continue;
    try {
      std::filesystem::create_directories(flightDir_);
      replaceFile(strCat(flightDir_, "/", name), text);
    } catch (const Error& e) {
      TLOG_WARN("tessera-run: " << e.what());
    }
  }
}

std::string Launcher::fateOf(const Rank& rank) const {
  std::string fate = describeStatus(rank.waitStatus);
  if (!rank.execError.empty()) fate = rank.execError;
  if (rank.killed) {
    fate = strCat("killed by the launcher: it was still running ", formatSeconds(options_.gracePeriodS, 1),
                  " s after SIGTERM");
  }
  if (failure_ && failure_->globalRank == rank.globalRank) {
    fate = strCat(fate, " after ", formatSeconds(failure_->afterS), " s, the first rank to fail");
  }
  if (rank.globalRank == 0) {
    fate += strCat(" (it hosted the ranks' store at ", options_.masterAddr, ":", options_.masterPort, ")");
  }
  if (rank.stopped) fate += " (it was stopped when the run was torn down: SIGSTOP or a debugger)";
  return fate;
}

void Launcher::reportVerdict() {
  fetchOtherNodesDumps(localDumps());
  std::error_code ec;
  if (!std::filesystem::is_directory(flightDir_, ec)) return;  // no rank wrote a dump (not a Tessera program)
  diagnostics::VerdictInput input;
  input.dir = flightDir_;
  input.worldSize = options_.nnodes * options_.nprocPerNode;
  for (const Rank& rank : ranks_) {
    if (rank.stopped) input.stopped.insert(rank.globalRank);
    input.fates[rank.globalRank] = fateOf(rank);
  }
  try {
    const auto lines = diagnostics::flightVerdict(input);
    TLOG_ERROR("tessera-run: verdict from the flight recorder (dumps in " << flightDir_ << "):");
    for (const auto& line : lines) TLOG_ERROR("tessera-run:   " << line);
    if (!tempDir_.empty()) {
      // The verdict points there: the folder is kept (it was deleted at exit before).
      keepTempDir_ = true;
      TLOG_ERROR("tessera-run: the dumps stay in " << flightDir_ << " (tessera-flight " << flightDir_
                 << " reads them again; --log-dir puts them elsewhere); delete " << tempDir_ << " when done");
    }
  } catch (const std::exception& e) {
    TLOG_WARN("tessera-run: no verdict: " << e.what());
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
