// Runs a built program the way a user would — a shell command line, bounded in time —
// and reports how it ended: the suites that test programs end to end share this one
// runner instead of each wrapping std::system.
#pragma once

#include <string>

namespace tessera::test {

// Where the build put the programs and where the sources are (tests/CMakeLists.txt).
inline const std::string kBin = TESSERA_BIN_DIR;
inline const std::string kSource = TESSERA_SOURCE_DIR;
inline const std::string kTrain = kBin + "/tessera-train";

struct CommandResult {
  int status = -1;       // exit status; 124 = killed by the timeout, 128+N = killed by signal N
  double seconds = 0;    // wall time
  std::string output;    // stdout and stderr, interleaved
  // Ended on its own with status 1 or 2: how Tessera refuses bad input (never a signal
  // or a hang).
  bool refused() const { return status == 1 || status == 2; }
};

// Runs `command` with sh -c under `timeout`, stdin from /dev/null.
CommandResult runCommand(const std::string& command, int timeoutSeconds = 120);

// `text` quoted for sh: 'it'\''s'.
std::string shellQuote(const std::string& text);

}  // namespace tessera::test
