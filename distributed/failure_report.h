// What tessera-run says when a rank fails (internal to the launcher, launcher.cpp): the
// failed rank and how it ended, every rank's own message once (folded over the ranks that
// say the same), and the flight recorder's verdict from the ranks' dumps — this node's and,
// through the elastic rendezvous or a server at MASTER_PORT + 1 in a static multi-node run,
// the other nodes'.
#pragma once

#include <cstdint>
#include <string>

#include "distributed/child_processes.h"
#include "distributed/launcher.h"

namespace tessera::distributed {

class ElasticRendezvous;

// What exits 2: a rank refused its configuration or arguments (common/app_main.h), which a
// restart would not change.
inline constexpr int kBadInputStatus = 2;

// The launcher's exit status for a failed rank: the rank's own exit status (2: bad
// input), or 1 when it was killed by a signal or could not start.
int failureExitStatus(const RankFailure& failure);

struct FailureReport {
  const LaunchOptions& options;
  const ChildProcesses& processes;  // its failure() is set
  std::string flightDir;            // the ranks' dumps (TESSERA_FLIGHT_DIR)
  ElasticRendezvous* rendezvous = nullptr;  // elastic runs: exchanges the nodes' dumps
  int64_t round = 0;                // the elastic round the ranks ran in
};

struct FailureReported {
  bool verdictFromDumps = false;  // a verdict pointed at the dumps (a temporary folder must be kept)
  // Elastic runs: how many other nodes' ranks failed with this node's (they sent their
  // dumps within the exchange's wait); -1 when unknown (static, bad input, no server).
  int64_t otherNodesFailed = -1;
};

// Logs the failure (the other ranks stopped in `stoppedInS`) and, unless it was bad input,
// the verdict.
FailureReported reportFailure(const FailureReport& report, double stoppedInS);

}  // namespace tessera::distributed
