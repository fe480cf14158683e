// The process's timeline recorder (see trace.h).
#include "common/trace.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <mutex>

namespace tessera::trace {
namespace {

std::atomic<bool> g_active{false};
std::mutex g_mutex;
std::vector<Event> g_events;  // guarded by g_mutex
std::atomic<int> g_threads{0};

thread_local std::string t_name;
thread_local std::string t_tag;
std::atomic<int64_t> g_step{0};

// One thread's stack of open spans, readable by other threads (the flight recorder's dump).
struct SpanStack {
  std::mutex mutex;
  std::string thread;
  std::vector<std::pair<std::string, int64_t>> spans;  // name, begin
  std::vector<std::string> unwound;                    // ThreadActivity::unwound
  std::string detail;                                  // setThreadDetail
  int64_t detailNs = 0;
};

// Every live thread's stack. Threads register at their first span and leave at exit (the
// batch loader's threads come and go), so the list holds live threads only.
std::mutex g_stacksMutex;
std::vector<std::shared_ptr<SpanStack>> g_stacks;

struct StackRegistration {
  std::shared_ptr<SpanStack> stack = std::make_shared<SpanStack>();
  StackRegistration() {
    std::lock_guard<std::mutex> lock(g_stacksMutex);
    g_stacks.push_back(stack);
  }
  ~StackRegistration() {
    std::lock_guard<std::mutex> lock(g_stacksMutex);
    g_stacks.erase(std::remove(g_stacks.begin(), g_stacks.end(), stack), g_stacks.end());
  }
};

SpanStack& thisThreadStack() {
  thread_local StackRegistration registration;
  return *registration.stack;
}

}  // namespace

std::vector<ThreadActivity> currentActivities() {
  std::vector<std::shared_ptr<SpanStack>> stacks;
  {
    std::lock_guard<std::mutex> lock(g_stacksMutex);
    stacks = g_stacks;
  }
  std::vector<ThreadActivity> out;
  for (const auto& stack : stacks) {
    std::lock_guard<std::mutex> lock(stack->mutex);
    ThreadActivity a;
    a.thread = stack->thread;
    for (const auto& [name, begin] : stack->spans) {
      a.spans.push_back(name);
      a.sinceNs = begin;
    }
    if (!stack->detail.empty()) {
      a.spans.push_back(stack->detail);
      a.sinceNs = stack->detailNs;
    }
    a.unwound = stack->unwound;
    out.push_back(std::move(a));
  }
  return out;
}

void setThreadDetail(const std::string& detail) {
  SpanStack& stack = thisThreadStack();
  const int64_t now = nowNs();
  std::lock_guard<std::mutex> lock(stack.mutex);
  if (stack.thread.empty()) stack.thread = thisThreadName();
  stack.detail = detail;
  stack.detailNs = now;
}

void setCurrentStep(int64_t step) { g_step.store(step, std::memory_order_relaxed); }
int64_t currentStep() { return g_step.load(std::memory_order_relaxed); }

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

void nameThisThread(const std::string& name) {
  t_name = name;
  SpanStack& stack = thisThreadStack();
  std::lock_guard<std::mutex> lock(stack.mutex);
  stack.thread = name;
}

const std::string& thisThreadName() {
  if (t_name.empty()) {
    const int n = g_threads.fetch_add(1);
    t_name = n == 0 ? "main" : "thread " + std::to_string(n);
  }
  return t_name;
}

Span::Span(const char* category, std::string name)
    : category_(category), name_(std::move(name)), uncaught_(std::uncaught_exceptions()) {
  SpanStack& stack = thisThreadStack();
  const int64_t now = nowNs();
  {
    std::lock_guard<std::mutex> lock(stack.mutex);
    if (stack.thread.empty()) stack.thread = thisThreadName();
    if (stack.spans.empty()) stack.unwound.clear();
    stack.spans.emplace_back(name_, now);
  }
  if (active()) beginNs_ = now;
}

Span::~Span() {
  SpanStack& stack = thisThreadStack();
  {
    std::lock_guard<std::mutex> lock(stack.mutex);
    if (std::uncaught_exceptions() > uncaught_ && stack.unwound.empty()) {
      for (const auto& span : stack.spans) stack.unwound.push_back(span.first);  // the innermost unwinds first
      if (!stack.detail.empty()) stack.unwound.push_back(stack.detail);
    }
    if (stack.spans.size() == 1) stack.detail.clear();  // the outermost span ends: so does any detail
    if (!stack.spans.empty()) stack.spans.pop_back();
  }
  if (beginNs_ < 0 || !active()) return;
  record({std::move(name_), category_, thisThreadName(), beginNs_, nowNs()});
}

Tag::Tag(std::string what) : previous_(std::move(t_tag)) { t_tag = std::move(what); }
Tag::~Tag() { t_tag = std::move(previous_); }
const std::string& currentTag() { return t_tag; }

}  // namespace tessera::trace
