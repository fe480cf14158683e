// The local ranks of tessera-run as processes (see child_processes.h).
#include "distributed/child_processes.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <sstream>

#include "common/app_main.h"
#include "common/errors.h"
#include "common/file_open.h"
#include "common/logging.h"

extern char** environ;

namespace tessera::distributed {

std::string formatSeconds(double seconds, int precision) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(precision) << seconds;
  return out.str();
}

std::string describeStatus(int waitStatus) {
  if (WIFSIGNALED(waitStatus)) return strCat("killed by signal ", signalName(WTERMSIG(waitStatus)));
  return strCat("exit code ", WEXITSTATUS(waitStatus));
}

namespace {

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

// A rank's argv and environment as exec wants them (null-terminated char* arrays into the
// strings held here), built before fork(): the parent's environment with the rank's
// variables (rankEnvironment) replacing any of the same name. Neither copied nor moved,
// so the pointers stay valid.
struct ChildCommand {
  ChildCommand(const LaunchOptions& options, int localRank, int restartCount, const std::string& errorFile,
               const std::string& flightDir, bool intoLiveRound) {
    auto overrides = rankEnvironment(options, localRank, restartCount, errorFile, std::getenv("OMP_NUM_THREADS"));
    // Where Tessera's programs also write their flight-recorder dump, for the verdict.
    overrides["TESSERA_FLIGHT_DIR"] = flightDir;
    if (intoLiveRound) overrides[kRestartedIntoLiveRoundEnv] = "1";
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

}  // namespace

ChildProcesses::ChildProcesses(const LaunchOptions& options, const std::string& fileDir) : options_(options) {
  console_ = options_.logDir.empty() || options_.tee;
  // Make sure fds 0-2 exist, so no pipe lands on them and confuses the children's dup2().
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) < 0) ::open("/dev/null", O_RDWR);
  }
  devNull_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devNull_ < 0) throw Error(strCat("Launcher: cannot open /dev/null: ", errnoText(errno)));
  const int nproc = options_.nprocPerNode;
  ranks_.resize(static_cast<size_t>(nproc));
  for (int local = 0; local < nproc; ++local) {
    RankProcess& rank = ranks_[static_cast<size_t>(local)];
    rank.localRank = local;
    rank.globalRank = options_.nodeRank * nproc + local;
    rank.out.consoleFd = STDOUT_FILENO;
    rank.err.consoleFd = STDERR_FILENO;
    // Elastic: a rank's global rank may change from round to round; its files keep the local one.
    const std::string name = options_.elastic() ? strCat("local_rank_", local) : strCat("rank_", rank.globalRank);
    rank.errorFile = strCat(fileDir, "/", name, ".error.json");
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

ChildProcesses::~ChildProcesses() {
  killEverythingNow();
  restoreSignalHandlers();
  for (RankProcess& rank : ranks_) {
    closeFd(rank.out.fd);
    closeFd(rank.err.fd);
    closeFd(rank.logFd);
  }
  closeFd(devNull_);
}

void ChildProcesses::setNodeRank(int nodeRank) {
  for (RankProcess& rank : ranks_) rank.globalRank = nodeRank * options_.nprocPerNode + rank.localRank;
}

void ChildProcesses::startAll(int restartCount, const std::string& flightDir, bool intoLiveRound) {
  failure_.reset();
  attemptStart_ = LaunchClock::now();
  for (RankProcess& rank : ranks_) {
    std::remove(rank.errorFile.c_str());  // a stale message must not be blamed on this attempt
    rank.killed = false;
    if (rank.logFd >= 0 && restartCount > 0) {
      writeAll(rank.logFd, strCat("tessera-run: restart ", restartCount, " of ", options_.maxRestarts,
                                  " (TORCHELASTIC_RESTART_COUNT=", restartCount, ")\n"));
    }
    spawn(rank, restartCount, flightDir, intoLiveRound);
  }
}

bool ChildProcesses::anyRunning() const {
  return std::any_of(ranks_.begin(), ranks_.end(), [](const RankProcess& r) { return r.running; });
}

void ChildProcesses::installSignalHandlers() {
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

void ChildProcesses::restoreSignalHandlers() {
  for (const auto& [sig, action] : savedActions_) ::sigaction(sig, &action, nullptr);
  savedActions_.clear();
  closeFd(g_signalPipe[0]);
  closeFd(g_signalPipe[1]);
}

void ChildProcesses::spawn(RankProcess& rank, int restartCount, const std::string& flightDir, bool intoLiveRound) {
  // Everything the child needs is built before fork(): the child only calls
  // async-signal-safe functions.
  ChildCommand child(options_, rank.localRank, restartCount, rank.errorFile, flightDir, intoLiveRound);
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

pid_t ChildProcesses::forkRank(const RankProcess& rank, const int outPipe[2], const int errPipe[2], int execPipe, char** argv,
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

void ChildProcesses::waitForExec(RankProcess& rank, int execPipe) {
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

void ChildProcesses::execChild(const int outPipe[2], const int errPipe[2], int execPipe, char** argv, char** envp) {
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

void ChildProcesses::pump(double timeoutS) {
  std::vector<pollfd> fds;
  std::vector<std::pair<RankProcess*, RankStream*>> owners;
  fds.push_back({g_signalPipe[0], POLLIN, 0});
  owners.emplace_back(nullptr, nullptr);
  for (RankProcess& rank : ranks_) {
    for (RankStream* stream : {&rank.out, &rank.err}) {
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

void ChildProcesses::readOutput(RankProcess& rank, RankStream& stream) {
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

void ChildProcesses::emitLine(RankProcess& rank, RankStream& stream, const std::string& line) {
  if (rank.logFd >= 0) writeAll(rank.logFd, line + "\n");
  if (console_) writeAll(stream.consoleFd, strCat("[rank ", rank.globalRank, "]: ", line, "\n"));
}

void ChildProcesses::closeStream(RankProcess& rank, RankStream& stream) {
  if (!stream.pending.empty()) emitLine(rank, stream, stream.pending);
  stream.pending.clear();
  closeFd(stream.fd);
}

void ChildProcesses::reapChildren() {
  while (true) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;  // 0: none exited; -1/ECHILD: no children at all
    for (RankProcess& rank : ranks_) {
      if (rank.pid != pid || !rank.running) continue;
      rank.running = false;
      rank.waitStatus = status;
      if ((isFailure(status) || !rank.execError.empty()) && !stopping_ && !failure_) {
        failure_ = RankFailure{rank.globalRank, status, rank.execError, secondsSince(attemptStart_)};
      }
    }
    // Other pids are grandchildren re-parented to the launcher (child subreaper).
  }
}

bool ChildProcesses::anyProcessLeft() const {
  for (const RankProcess& rank : ranks_) {
    if (rank.running) return true;
    // The rank's own process is gone, but its process group may still have members.
    if (rank.pid > 0 && (::kill(-rank.pid, 0) == 0 || errno == EPERM)) return true;
  }
  return false;
}

bool ChildProcesses::anyStreamOpen() const {
  return std::any_of(ranks_.begin(), ranks_.end(), [](const RankProcess& r) { return r.out.fd >= 0 || r.err.fd >= 0; });
}

void ChildProcesses::signalGroups(int signal) const {
  for (const RankProcess& rank : ranks_) {
    if (rank.pid > 0) ::kill(-rank.pid, signal);  // ESRCH: that group is already gone
  }
}

double ChildProcesses::stopAll(int signal, double gracePeriodS) {
  const auto start = LaunchClock::now();
  stopping_ = true;
  const int signalsBefore = signalsReceived_;
  // Checked before the signal: a rank's own handler must not be mistaken for a stop.
  if (signal == SIGTERM) {
    for (RankProcess& rank : ranks_) rank.stopped = rank.running && isStopped(rank.pid);
  }
  signalGroups(signal);
  // A stopped rank (SIGSTOP, a debugger) is left stopped: it gets SIGKILL after the grace
  // period. Woken up instead, it would run into its peers' closed sockets before it could
  // say where it stood; the verdict names it from its state and the others' dumps.
  // Wait out the grace period, unless another signal to the launcher asks to hurry.
  while (anyProcessLeft() && secondsSince(start) < gracePeriodS && signalsReceived_ == signalsBefore) {
    pump(std::min(kPollPeriodS, gracePeriodS - secondsSince(start)));
  }
  if (anyProcessLeft()) {
    TLOG_WARN("tessera-run: ranks still running " << formatSeconds(secondsSince(start)) << " s after "
              << signalName(signal) << "; sending SIGKILL");
    for (RankProcess& rank : ranks_) rank.killed = rank.running;
    signalGroups(SIGKILL);
    const auto killStart = LaunchClock::now();
    while (anyProcessLeft() && secondsSince(killStart) < kKillWaitS) pump(kPollPeriodS);
    if (anyProcessLeft()) {
      TLOG_ERROR("tessera-run: some rank processes survived SIGKILL for " << kKillWaitS << " s; giving up on them");
    }
  }
  drainOutput();
  stopping_ = false;
  return secondsSince(start);
}

void ChildProcesses::drainOutput() {
  const auto start = LaunchClock::now();
  while (anyStreamOpen() && secondsSince(start) < kDrainWaitS) pump(kDrainWaitS - secondsSince(start));
  for (RankProcess& rank : ranks_) {
    closeStream(rank, rank.out);
    closeStream(rank, rank.err);
  }
}

void ChildProcesses::killEverythingNow() {
  // Only reached with live ranks when run() threw; never leave orphans behind.
  if (!anyProcessLeft()) return;
  signalGroups(SIGKILL);
  for (RankProcess& rank : ranks_) {
    if (rank.running && ::waitpid(rank.pid, nullptr, 0) == rank.pid) rank.running = false;
  }
}

}  // namespace tessera::distributed
