// Multi-rank harness: ranks as threads or forked processes (see multi_rank.h).
#include "tests/support/multi_rank.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include "distributed/shm_communicator.h"

namespace tessera::test {
namespace {

using Clock = std::chrono::steady_clock;

// GoogleTest failures of the current rank land here (set per rank thread / child).
thread_local std::vector<std::string>* tlFailures = nullptr;

class FailureCapture : public ::testing::EmptyTestEventListener {
 public:
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (tlFailures == nullptr || !result.failed()) return;
    tlFailures->push_back(strCat(result.file_name() != nullptr ? result.file_name() : "?", ":", result.line_number(),
                                 ": ", result.message()));
  }
};

void installFailureCapture() {
  static std::once_flag once;
  std::call_once(once, [] { ::testing::UnitTest::GetInstance()->listeners().Append(new FailureCapture()); });
}

std::string describeCurrentException() {
  try {
    throw;
  } catch (const TimeoutError& e) {
    return strCat("tessera::TimeoutError: ", e.what());
  } catch (const ConfigError& e) {
    return strCat("tessera::ConfigError: ", e.what());
  } catch (const UsageError& e) {
    return strCat("tessera::UsageError: ", e.what());
  } catch (const Error& e) {
    return strCat("tessera::Error: ", e.what());
  } catch (const c10::Error& e) {
    return strCat("c10::Error: ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    return strCat("std::exception: ", e.what());
  } catch (...) {
    return "unknown exception";
  }
}

// Runs the body for one rank and returns "" on success, else why it failed.
std::string runBody(const std::function<void(RankContext&)>& body, RankContext& ctx) {
  std::vector<std::string> failures;
  tlFailures = &failures;
  std::string error;
  {
    ::testing::ScopedTrace trace(__FILE__, __LINE__, strCat("rank ", ctx.rank, " of ", ctx.world));
    try {
      body(ctx);
    } catch (...) {
      error = describeCurrentException();
    }
  }
  tlFailures = nullptr;
  for (const auto& failure : failures) {
    if (!error.empty()) error += "\n";
    error += failure;
  }
  return error;
}

std::string formatMs(std::chrono::milliseconds ms) { return distributed::formatDuration(ms); }

// ---- threads ----------------------------------------------------------------------

struct ThreadRun {
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<RankOutcome> outcomes;
  std::vector<bool> finished;
  int finishedCount = 0;
  int failures = 0;
  std::shared_ptr<std::atomic<bool>> cancelled = std::make_shared<std::atomic<bool>>(false);
};

MultiRankResult runThreads(int world, const std::function<void(RankContext&)>& body, const HarnessOptions& options) {
  auto run = std::make_shared<ThreadRun>();
  run->outcomes.resize(static_cast<size_t>(world));
  run->finished.assign(static_cast<size_t>(world), false);
  auto store = distributed::Store::createInProcess();
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    // The thread owns copies of everything it touches, so a straggler that is detached
    // after the timeout never reads this frame.
    threads.emplace_back([run, store, body, r, world, options]() {
      RankContext ctx(r, world, HarnessMode::kThreads, store, options.commTimeout, run->cancelled, options.backend);
      const std::string error = runBody(body, ctx);
      std::lock_guard<std::mutex> lock(run->mutex);
      auto& outcome = run->outcomes[static_cast<size_t>(r)];
      outcome.rank = r;
      if (!run->finished[static_cast<size_t>(r)] && outcome.timedOut) {
        // Finished after the harness gave up: keep the timeout verdict, add what it said.
        if (!error.empty()) outcome.message += strCat("; it then failed: ", error);
      } else {
        outcome.ok = error.empty();
        outcome.message = error;
        if (!outcome.ok) outcome.failureOrder = run->failures++;
      }
      run->finished[static_cast<size_t>(r)] = true;
      ++run->finishedCount;
      run->changed.notify_all();
    });
  }

  std::unique_lock<std::mutex> lock(run->mutex);
  const bool allDone = run->changed.wait_for(lock, options.timeout, [&] { return run->finishedCount == world; });
  if (!allDone) {
    run->cancelled->store(true);
    for (int r = 0; r < world; ++r) {
      if (run->finished[static_cast<size_t>(r)]) continue;
      auto& outcome = run->outcomes[static_cast<size_t>(r)];
      outcome.rank = r;
      outcome.ok = false;
      outcome.timedOut = true;
      outcome.message = strCat("still running after the harness timeout of ", formatMs(options.timeout),
                               " (a hang: some collective or wait without a timeout?)");
      outcome.failureOrder = run->failures++;
    }
    // Grace period: bodies blocked in a collective end with its timeout.
    run->changed.wait_for(lock, options.commTimeout + std::chrono::seconds(1),
                          [&] { return run->finishedCount == world; });
  }
  MultiRankResult result;
  result.ranks = run->outcomes;
  std::vector<bool> finished = run->finished;
  lock.unlock();
  for (int r = 0; r < world; ++r) {
    if (finished[static_cast<size_t>(r)]) {
      threads[static_cast<size_t>(r)].join();
    } else {
      std::fprintf(stderr, "runOnRanks: rank %d is still blocked after the grace period; detaching its thread\n", r);
      threads[static_cast<size_t>(r)].detach();
    }
  }
  return result;
}

// ---- processes --------------------------------------------------------------------

void writeAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

[[noreturn]] void runChild(int rank, int world, int port, int fd, const std::function<void(RankContext&)>& body,
                           const HarnessOptions& options) {
  // Forked from a process that may have used LibTorch's thread pools: stay on one thread.
  at::set_num_threads(1);
  std::string error;
  try {
    auto store = distributed::Store::createTcp("127.0.0.1", port, /*isServer=*/false, options.commTimeout);
    auto cancelled = std::make_shared<std::atomic<bool>>(false);
    RankContext ctx(rank, world, HarnessMode::kProcesses, store, options.commTimeout, cancelled, options.backend);
    error = runBody(body, ctx);
  } catch (...) {
    error = describeCurrentException();
  }
  writeAll(fd, error.empty() ? std::string("O") : "F" + error);
  ::close(fd);
  std::fflush(stdout);
  std::fflush(stderr);
  // _exit: the child must not run the parent's atexit handlers or GoogleTest's reporting.
  ::_exit(error.empty() ? 0 : 1);
}

std::string describeStatus(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return strCat("killed by signal ", sig, " (", strsignal(sig), ")");
  }
  if (WIFEXITED(status)) return strCat("exited with status ", WEXITSTATUS(status));
  return "ended abnormally";
}

MultiRankResult runProcesses(int world, const std::function<void(RankContext&)>& body, const HarnessOptions& options) {
  // The parent hosts the store (its server thread lives here, not in a forked child);
  // every child connects to it as a client.
  auto server = distributed::Store::createTcp("127.0.0.1", 0, /*isServer=*/true, options.commTimeout);
  const int port = server->port();

  std::vector<int> readFds(static_cast<size_t>(world), -1);
  std::vector<int> writeFds(static_cast<size_t>(world), -1);
  for (int r = 0; r < world; ++r) {
    int fds[2];
    TESSERA_CHECK(::pipe(fds) == 0, "runOnRanks: pipe: ", std::strerror(errno));
    readFds[static_cast<size_t>(r)] = fds[0];
    writeFds[static_cast<size_t>(r)] = fds[1];
  }
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids(static_cast<size_t>(world), -1);
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      for (int k = 0; k < r; ++k) ::kill(pids[static_cast<size_t>(k)], SIGKILL);
      for (int k = 0; k < r; ++k) ::waitpid(pids[static_cast<size_t>(k)], nullptr, 0);
      throw Error(strCat("runOnRanks: fork: ", std::strerror(errno)));
    }
    if (pid == 0) {
      // Keep only this rank's write end: the parent sees EOF on a pipe only once every
      // holder of its write end is gone.
      for (int k = 0; k < world; ++k) {
        ::close(readFds[static_cast<size_t>(k)]);
        if (k != r) ::close(writeFds[static_cast<size_t>(k)]);
      }
      runChild(r, world, port, writeFds[static_cast<size_t>(r)], body, options);
    }
    pids[static_cast<size_t>(r)] = pid;
  }
  for (int fd : writeFds) ::close(fd);

  MultiRankResult result;
  result.ranks.resize(static_cast<size_t>(world));
  std::vector<std::string> reports(static_cast<size_t>(world));
  std::vector<bool> open(static_cast<size_t>(world), true);
  int openCount = world;
  int failures = 0;
  const auto deadline = Clock::now() + options.timeout;

  auto finish = [&](int r, int status) {
    auto& outcome = result.ranks[static_cast<size_t>(r)];
    outcome.rank = r;
    const std::string& report = reports[static_cast<size_t>(r)];
    if (!report.empty() && report[0] == 'O' && WIFEXITED(status) && WEXITSTATUS(status) == 0) {
      outcome.ok = true;
      return;
    }
    outcome.ok = false;
    if (!report.empty() && report[0] == 'F') {
      outcome.message = report.substr(1);
    } else {
      outcome.message = strCat("process ", describeStatus(status), " without reporting a result");
    }
    outcome.failureOrder = failures++;
  };

  while (openCount > 0) {
    const auto now = Clock::now();
    if (now >= deadline) break;
    std::vector<pollfd> fds;
    std::vector<int> ranksOf;
    for (int r = 0; r < world; ++r) {
      if (!open[static_cast<size_t>(r)]) continue;
      fds.push_back({readFds[static_cast<size_t>(r)], POLLIN, 0});
      ranksOf.push_back(r);
    }
    const auto waitMs = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
    const int ready = ::poll(fds.data(), fds.size(), static_cast<int>(std::min<int64_t>(waitMs + 1, 200)));
    if (ready <= 0) continue;
    for (size_t i = 0; i < fds.size(); ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      const int r = ranksOf[i];
      char buf[4096];
      const ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n > 0) {
        reports[static_cast<size_t>(r)].append(buf, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      // EOF: the child is exiting; reap it (bounded: it has nothing left to do).
      ::close(fds[i].fd);
      open[static_cast<size_t>(r)] = false;
      --openCount;
      int status = 0;
      const auto reapDeadline = Clock::now() + std::chrono::seconds(5);
      pid_t reaped = 0;
      while ((reaped = ::waitpid(pids[static_cast<size_t>(r)], &status, WNOHANG)) == 0 && Clock::now() < reapDeadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      if (reaped == 0) {
        ::kill(pids[static_cast<size_t>(r)], SIGKILL);
        ::waitpid(pids[static_cast<size_t>(r)], &status, 0);
      }
      finish(r, status);
    }
  }
  // Whatever is still open at the deadline is hung: kill it.
  for (int r = 0; r < world; ++r) {
    if (!open[static_cast<size_t>(r)]) continue;
    ::kill(pids[static_cast<size_t>(r)], SIGKILL);
    ::waitpid(pids[static_cast<size_t>(r)], nullptr, 0);
    ::close(readFds[static_cast<size_t>(r)]);
    auto& outcome = result.ranks[static_cast<size_t>(r)];
    outcome.rank = r;
    outcome.ok = false;
    outcome.timedOut = true;
    outcome.message = strCat("still running after the harness timeout of ", formatMs(options.timeout),
                             " (killed; a hang: some collective or wait without a timeout?)");
    outcome.failureOrder = failures++;
  }
  return result;
}

}  // namespace

const char* harnessModeName(HarnessMode mode) { return mode == HarnessMode::kThreads ? "threads" : "processes"; }

RankContext::RankContext(int rank_, int world_, HarnessMode mode_, std::shared_ptr<distributed::Store> store_,
                         std::chrono::milliseconds commTimeout, std::shared_ptr<const std::atomic<bool>> cancelled,
                         std::string backend)
    : rank(rank_),
      world(world_),
      mode(mode_),
      store(std::move(store_)),
      commTimeout_(commTimeout),
      cancelled_(std::move(cancelled)),
      backend_(std::move(backend)) {}

const std::shared_ptr<distributed::Communicator>& RankContext::comm() {
  if (comm_) return comm_;
  if (backend_ == "shm") {
    distributed::ShmOptions options;
    options.comm = glooOptions("world").comm;
    comm_ = distributed::makeShmCommunicator(store, rank, world, options);
  } else {
    comm_ = distributed::makeGlooCommunicator(store, rank, world, glooOptions("world"));
  }
  return comm_;
}

distributed::GlooOptions RankContext::glooOptions(const std::string& name) const {
  distributed::GlooOptions options;
  options.comm.timeout = commTimeout_;
  options.comm.name = name;
  options.hostname = "127.0.0.1";
  return options;
}

bool RankContext::cancelled() const { return cancelled_ && cancelled_->load(); }

bool MultiRankResult::ok() const {
  for (const auto& r : ranks) {
    if (!r.ok) return false;
  }
  return true;
}

const RankOutcome* MultiRankResult::firstFailure() const {
  const RankOutcome* first = nullptr;
  for (const auto& r : ranks) {
    if (!r.ok && (first == nullptr || r.failureOrder < first->failureOrder)) first = &r;
  }
  return first;
}

std::string MultiRankResult::summary(HarnessMode mode) const {
  const RankOutcome* first = firstFailure();
  if (first == nullptr) return strCat("all ", ranks.size(), " ranks passed (", harnessModeName(mode), ")");
  std::string out = strCat("rank ", first->rank, " of ", ranks.size(), " (", harnessModeName(mode),
                           ") failed first: ", first->message);
  for (const auto& r : ranks) {
    if (r.ok || &r == first) continue;
    out += strCat("\n  then rank ", r.rank, ": ", r.message.substr(0, r.message.find('\n')));
  }
  return out;
}

MultiRankResult runRanks(int world, const std::function<void(RankContext&)>& body, const HarnessOptions& options) {
  TESSERA_CHECK_AS(UsageError, world >= 1, "runOnRanks: world size must be >= 1, got ", world);
  installFailureCapture();
  const auto start = Clock::now();
  MultiRankResult result = options.mode == HarnessMode::kThreads ? runThreads(world, body, options)
                                                                 : runProcesses(world, body, options);
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

void runOnRanks(int world, const std::function<void(RankContext&)>& body, const HarnessOptions& options) {
  const MultiRankResult result = runRanks(world, body, options);
  if (const RankOutcome* first = result.firstFailure()) {
    throw RankFailure(first->rank, result.summary(options.mode));
  }
}

}  // namespace tessera::test
