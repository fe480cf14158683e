// Elapsed time as every deadline and rate in the library measures it: on the monotonic
// clock (std::chrono::steady_clock), which no wall-clock change moves.
#pragma once

#include <chrono>

namespace tessera {

using SteadyClock = std::chrono::steady_clock;

// Seconds since `start`.
inline double secondsSince(SteadyClock::time_point start) {
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

// The monotonic clock in seconds, for differences between two readings.
inline double steadySeconds() {
  return std::chrono::duration<double>(SteadyClock::now().time_since_epoch()).count();
}

}  // namespace tessera
