// The verdict on a failed or hung run from every rank's flight-recorder dump
// (flight_recorder.h): which ranks are behind and at which collective and phase; which
// ranks disagree on collective #n (op, size, dtype); which rank left no dump and how it
// ended. tessera-run prints it when a rank fails; tessera-flight prints it offline.
//
// Torch-free (JSON only), so the launcher links it without LibTorch.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace tessera::diagnostics {

struct VerdictInput {
  std::string dir;        // holds rank_<r>.json files
  int worldSize = 0;      // 0: as the dumps say
  // What the launcher saw of each rank it ran ("exited 1 after 12.3 s", "killed by SIGKILL
  // after it ignored SIGTERM"); ranks without a dump are described with it.
  std::map<int, std::string> fates;
  // Ranks the launcher found stopped (SIGSTOP, a debugger: process state T) when it tore
  // the run down: they stopped answering, whatever their dumps say they were doing.
  std::set<int> stopped;
};

// The verdict as lines of text, the most telling first ("rank 1 is behind: ..."). Never
// throws for what is in the directory (an unreadable dump is a line of its own); throws
// tessera::Error when `dir` cannot be listed.
std::vector<std::string> flightVerdict(const VerdictInput& input);

// The "counters" of the dumps in `dir` (flight::addToCounter), the largest of each over the
// ranks: what a fault.survive run went through, which tessera-run reports at its end. Empty
// when there are none; never throws (an unreadable dump is skipped).
std::map<std::string, int64_t> dumpCounters(const std::string& dir);

}  // namespace tessera::diagnostics
