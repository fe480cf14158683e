// A timeline of what each thread of this process did, recorded only while a profile
// window is open (the trainer's `profile:` keys): spans of compute, communication, waits,
// the optimizer, the EMA, checkpoints and data loading, each on a named track (a thread,
// or a communicator's collectives). Closed windows become Chrome-trace JSON (trainer's
// profiler). Outside a window a Span costs one uncontended lock: every thread's stack of
// open spans is kept at all times, so a flight-recorder dump (diagnostics/) can say what
// each thread is doing now, also when it hangs in compute.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tessera::trace {

struct Event {
  std::string name;      // "forward layers.1", "all-gather layers.2 (64 KiB)", "optimizer step"
  std::string category;  // compute | comm | wait | optimizer | ema | checkpoint | data | step
  std::string track;     // the thread's name, or "collectives: <group>"
  int64_t beginNs = 0;   // nowNs() clock
  int64_t endNs = 0;
};

// Whether a window is open.
bool active();
// Opens a window (dropping what an earlier one left) / closes it and returns its events.
void start();
std::vector<Event> stop();

// Nanoseconds on a monotonic clock shared by every thread of the process.
int64_t nowNs();

// Records `event` when a window is open (any thread).
void record(Event event);

// This thread's track name ("main" for the thread that first asks, "thread <n>" for others
// until they name themselves).
void nameThisThread(const std::string& name);
const std::string& thisThreadName();

// What one thread is doing now: its open Spans, outermost first, and the step.
struct ThreadActivity {
  std::string thread;
  std::vector<std::string> spans;  // "step 5", "forward (micro-batch)"
  int64_t sinceNs = 0;             // when the innermost span began (nowNs() clock)
  // The spans an exception last unwound on this thread (empty: none since its outermost
  // span began): what a rank was doing when it failed, after its stack is gone.
  std::vector<std::string> unwound;
};
// Every live thread that has opened a span (a snapshot; any thread may call it).
std::vector<ThreadActivity> currentActivities();

// What this thread does below its innermost Span when that is begun and ended by hooks
// rather than a scope (an FSDP unit's forward or backward: "forward layers.2"); shown as
// the last entry of the thread's activity. "" clears it.
void setThreadDetail(const std::string& detail);

// The training step in progress (as the log counts them, from 1; 0 before the first).
void setCurrentStep(int64_t step);
int64_t currentStep();

// A span on this thread's track from construction to destruction (recorded if a window
// was open when it began), and on this thread's stack of open spans meanwhile.
class Span {
 public:
  Span(const char* category, std::string name);
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char* category_;
  std::string name_;
  int64_t beginNs_ = -1;  // -1: no window was open
  int uncaught_;          // std::uncaught_exceptions() at construction
};

// What this thread's collectives are for while a Tag lives ("layers.1", "grad norm"):
// the name they carry on their track. Nested tags: the innermost.
class Tag {
 public:
  explicit Tag(std::string what);
  ~Tag();
  Tag(const Tag&) = delete;
  Tag& operator=(const Tag&) = delete;

 private:
  std::string previous_;
};
const std::string& currentTag();

}  // namespace tessera::trace
