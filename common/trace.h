// A timeline of what each thread of this process did, recorded only while a profile
// window is open (the trainer's `profile:` keys): spans of compute, communication, waits,
// the optimizer, the EMA, checkpoints and data loading, each on a named track (a thread,
// or a communicator's collectives). Closed windows become Chrome-trace JSON (trainer's
// profiler). Outside a window every call costs one relaxed atomic load.
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

// A span on this thread's track from construction to destruction (recorded if a window
// was open when it began).
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
