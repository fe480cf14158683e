// The process's timeline recorder (see trace.h).
#include "common/trace.h"

#include <atomic>
#include <chrono>
#include <mutex>

namespace tessera::trace {
namespace {

std::atomic<bool> g_active{false};
std::mutex g_mutex;
std::vector<Event> g_events;  // guarded by g_mutex
std::atomic<int> g_threads{0};

thread_local std::string t_name;
thread_local std::string t_tag;

}  // namespace

bool active() { return g_active.load(std::memory_order_relaxed); }

void start() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_events.clear();
  g_active.store(true, std::memory_order_relaxed);
}

std::vector<Event> stop() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_active.store(false, std::memory_order_relaxed);
  std::vector<Event> out;
  out.swap(g_events);
  return out;
}

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void record(Event event) {
  if (!active()) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_active.load(std::memory_order_relaxed)) g_events.push_back(std::move(event));
}

void nameThisThread(const std::string& name) { t_name = name; }

const std::string& thisThreadName() {
  if (t_name.empty()) {
    const int n = g_threads.fetch_add(1);
    t_name = n == 0 ? "main" : "thread " + std::to_string(n);
  }
  return t_name;
}

Span::Span(const char* category, std::string name) : category_(category), name_(std::move(name)) {
  if (active()) beginNs_ = nowNs();
}

Span::~Span() {
  if (beginNs_ < 0 || !active()) return;
  record({std::move(name_), category_, thisThreadName(), beginNs_, nowNs()});
}

Tag::Tag(std::string what) : previous_(std::move(t_tag)) { t_tag = std::move(what); }
Tag::~Tag() { t_tag = std::move(previous_); }
const std::string& currentTag() { return t_tag; }

}  // namespace tessera::trace
