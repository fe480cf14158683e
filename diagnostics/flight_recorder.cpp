// The flight recorder's rings, its dump and its signal watcher (see flight_recorder.h).
#include "diagnostics/flight_recorder.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "common/app_main.h"
#include "common/errors.h"
#include "common/file_open.h"
#include "common/logging.h"
#include "common/trace.h"

namespace tessera::diagnostics {

namespace {

// Never negative: an entry may be issued between the dump's clock reading and its copy.
double secondsBetween(int64_t earlierNs, int64_t laterNs) {
  return std::max(0.0, static_cast<double>(laterNs - earlierNs) * 1e-9);
}

const char* stateName(int state) {
  static const char* const kNames[] = {"issued", "waiting", "completed", "failed"};
  return kNames[state];
}

}  // namespace

FlightRing::FlightRing(std::string group, std::string backend, int rank, std::vector<int> members, int capacity)
    : group_(std::move(group)),
      backend_(std::move(backend)),
      rank_(rank),
      members_(std::move(members)),
      records_(static_cast<size_t>(std::max(1, capacity))) {}

FlightRing::Record* FlightRing::find(int64_t seq) {
  Record& r = records_[static_cast<size_t>(seq % static_cast<int64_t>(records_.size()))];
  return r.seq == seq ? &r : nullptr;
}

int64_t FlightRing::issue(const char* op, const char* dtype, int64_t numel, int64_t bytes, const std::string& tag) {
  const int64_t now = trace::nowNs();
  const std::string& thread = trace::thisThreadName();
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t seq = next_++;
  Record& r = records_[static_cast<size_t>(seq % static_cast<int64_t>(records_.size()))];
  r.seq = seq;
  r.op = op;
  r.dtype = dtype;
  r.numel = numel;
  r.bytes = bytes;
  r.step = trace::currentStep();
  r.tag = tag;
  r.thread = thread;
  r.error.clear();
  r.issuedNs = now;
  r.waitNs = r.endNs = 0;
  r.state = State::kIssued;
  return seq;
}

void FlightRing::waiting(int64_t seq) {
  const int64_t now = trace::nowNs();
  std::lock_guard<std::mutex> lock(mutex_);
  if (Record* r = find(seq); r && r->state == State::kIssued) {
    r->state = State::kWaiting;
    r->waitNs = now;
  }
}

void FlightRing::finish(int64_t seq, const std::string& error) {
  const int64_t now = trace::nowNs();
  std::lock_guard<std::mutex> lock(mutex_);
  if (Record* r = find(seq); r && (r->state == State::kIssued || r->state == State::kWaiting)) {
    r->state = error.empty() ? State::kCompleted : State::kFailed;
    r->error = error;
    r->endNs = now;
  }
}

std::string FlightRing::toJson(int64_t nowNs) const {
  std::lock_guard<std::mutex> lock(mutex_);
  nlohmann::json entries = nlohmann::json::array();
  const int64_t size = static_cast<int64_t>(records_.size());
  for (int64_t seq = std::max<int64_t>(0, next_ - size); seq < next_; ++seq) {
    const Record& r = records_[static_cast<size_t>(seq % size)];
    if (r.seq != seq) continue;
    nlohmann::json e = {{"seq", r.seq},     {"op", r.op},         {"dtype", r.dtype},
                        {"numel", r.numel}, {"bytes", r.bytes},   {"tag", r.tag},
                        {"thread", r.thread}, {"step", r.step},   {"state", stateName(static_cast<int>(r.state))},
                        {"issued_s_ago", secondsBetween(r.issuedNs, nowNs)}};
    if (r.waitNs != 0) e["wait_s_ago"] = secondsBetween(r.waitNs, nowNs);
    if (r.endNs != 0) e["ended_s_ago"] = secondsBetween(r.endNs, nowNs);
    if (!r.error.empty()) e["error"] = r.error;
    entries.push_back(std::move(e));
  }
  nlohmann::json j = {{"group", group_}, {"backend", backend_}, {"rank", rank_},
                      {"members", members_}, {"next_seq", next_}, {"entries", std::move(entries)}};
  return j.dump();
}

namespace flight {
namespace {

// One dump at a time: a failing collective's thread and the SIGTERM watcher may dump at
// once, and both write the same files (through the same temporary names).
std::mutex g_dumpMutex;

std::mutex g_mutex;  // guards what follows
std::vector<std::weak_ptr<FlightRing>> g_rings;
std::vector<std::string> g_files;
int g_rank = -1;
int g_worldSize = 0;
nlohmann::json g_counters = nlohmann::json::object();  // addToCounter's
// The groups of the last dump that had any: a dump on the way out of an error (runMain's
// hook) comes after the communicators are gone, and repeats what the first dump saw.
nlohmann::json g_lastGroups;

// The signal watcher: handlers write the signal number into the pipe.
int g_pipe[2] = {-1, -1};
struct sigaction g_previousTerm {};
std::once_flag g_installed;

// Set when SIGTERM had its default action before installSignalHandlers(): the watcher then
// ends the process itself once the dump is written.
std::atomic<bool> g_termEndsProcess{false};

void watch() {
  trace::nameThisThread("flight recorder");
  while (true) {
    unsigned char sig = 0;
    const ssize_t n = ::read(g_pipe[0], &sig, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    // 0: SIGTERM seen by another handler (onTerminateSignal), which decides what follows.
    const std::string reason = sig == SIGUSR1 ? "SIGUSR1 (a look at a running rank)" : "SIGTERM";
    const auto written = dump(reason);
    if (sig == SIGUSR1 && !written.empty()) TLOG_WARN("flight recorder: SIGUSR1: wrote " << written.front());
    if (sig == SIGTERM && g_termEndsProcess.load()) {
      log::flush();
      ::signal(SIGTERM, SIG_DFL);
      ::kill(::getpid(), SIGTERM);  // the default action: the process ends, as it would have
    }
  }
}

extern "C" void onFlightSignal(int sig) {
  const int savedErrno = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  if (g_pipe[1] >= 0) [[maybe_unused]] const ssize_t ignored = ::write(g_pipe[1], &byte, 1);
  // A SIGTERM handler installed before ours still runs (the default action is the watcher's).
  if (sig == SIGTERM && g_previousTerm.sa_handler != SIG_DFL && g_previousTerm.sa_handler != SIG_IGN &&
      g_previousTerm.sa_handler != nullptr) {
    g_previousTerm.sa_handler(sig);
  }
  errno = savedErrno;
}

}  // namespace

std::shared_ptr<FlightRing> openRing(const std::string& group, const std::string& backend, int rank,
                                     const std::vector<int>& members, int capacity) {
  if (capacity <= 0) return nullptr;
  auto ring = std::make_shared<FlightRing>(group, backend, rank, members, capacity);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_rings.erase(std::remove_if(g_rings.begin(), g_rings.end(), [](const auto& w) { return w.expired(); }),
                g_rings.end());
  g_rings.push_back(ring);
  return ring;
}

void setDumpFiles(std::vector<std::string> files, int rank, int worldSize) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_files = std::move(files);
  g_rank = rank;
  g_worldSize = worldSize;
}

void addToCounter(const std::string& name, int64_t delta) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_counters[name] = g_counters.value(name, int64_t{0}) + delta;
}

std::vector<std::string> dumpFilesFor(const std::string& runDir, int rank) {
  const std::string name = strCat("rank_", rank, ".json");
  std::vector<std::string> files = {(std::filesystem::path(runDir) / "flight" / name).string()};
  if (const char* dir = std::getenv("TESSERA_FLIGHT_DIR"); dir && *dir) {
    files.push_back((std::filesystem::path(dir) / name).string());
  }
  return files;
}

std::string dumpJson(const std::string& reason) {
  const int64_t now = trace::nowNs();
  std::vector<std::shared_ptr<FlightRing>> rings;
  nlohmann::json j;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (const auto& weak : g_rings) {
      if (auto ring = weak.lock()) rings.push_back(std::move(ring));
    }
    j["format"] = "tessera.flight/1";
    j["rank"] = g_rank;
    j["world_size"] = g_worldSize;
    if (!g_counters.empty()) j["counters"] = g_counters;
  }
  j["reason"] = reason;
  j["pid"] = static_cast<int64_t>(::getpid());
  j["time_unix_s"] =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  j["step"] = trace::currentStep();
  nlohmann::json threads = nlohmann::json::array();
  for (const auto& a : trace::currentActivities()) {
    if (a.spans.empty() && a.unwound.empty()) continue;  // idle
    nlohmann::json t = {{"thread", a.thread}, {"doing", a.spans}};
    if (!a.spans.empty()) t["for_s"] = secondsBetween(a.sinceNs, now);
    if (!a.unwound.empty()) t["failed_in"] = a.unwound;
    threads.push_back(std::move(t));
  }
  j["threads"] = std::move(threads);
  nlohmann::json groups = nlohmann::json::array();
  for (const auto& ring : rings) groups.push_back(nlohmann::json::parse(ring->toJson(now)));
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!groups.empty()) {
      g_lastGroups = groups;
    } else if (!g_lastGroups.is_null()) {
      groups = g_lastGroups;
      j["groups_from_earlier_dump"] = true;  // their communicators are gone; times are those of that dump
    }
  }
  j["groups"] = std::move(groups);
  return j.dump(1);
}

std::vector<std::string> dump(const std::string& reason) noexcept {
  std::vector<std::string> written;
  try {
    std::lock_guard<std::mutex> serial(g_dumpMutex);
    std::vector<std::string> files;
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      files = g_files;
    }
    if (files.empty()) return written;
    const std::string text = dumpJson(reason) + "\n";
    for (const std::string& file : files) {
      try {
        std::filesystem::create_directories(std::filesystem::path(file).parent_path());
        replaceFile(file, text);
        written.push_back(file);
      } catch (const std::exception& e) {
        TLOG_WARN("flight recorder: cannot write " << file << ": " << e.what());
      }
    }
  } catch (...) {
    // A dump is written on the way out of a failure: it must never add one.
  }
  return written;
}

void installSignalHandlers() {
  std::call_once(g_installed, [] {
    if (::pipe(g_pipe) != 0) throw Error(strCat("flight recorder: pipe() failed: ", errnoText(errno)));
    for (const int fd : g_pipe) ::fcntl(fd, F_SETFD, FD_CLOEXEC);
    ::fcntl(g_pipe[1], F_SETFL, O_NONBLOCK);
    std::thread(watch).detach();
    struct sigaction action {};
    action.sa_handler = onFlightSignal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    ::sigaction(SIGUSR1, &action, nullptr);
    ::sigaction(SIGTERM, &action, &g_previousTerm);
    g_termEndsProcess = g_previousTerm.sa_handler == SIG_DFL;
    addFailureHook([](const std::string& message) { dump(message); });
  });
}

void onTerminateSignal() noexcept {
  const int savedErrno = errno;
  const unsigned char byte = 0;
  if (g_pipe[1] >= 0) [[maybe_unused]] const ssize_t ignored = ::write(g_pipe[1], &byte, 1);
  errno = savedErrno;
}

}  // namespace flight
}  // namespace tessera::diagnostics
