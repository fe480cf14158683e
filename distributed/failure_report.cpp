// What tessera-run says when a rank fails (see failure_report.h).
#include "distributed/failure_report.h"

#include <sys/wait.h>

#include <filesystem>
#include <map>
#include <memory>

#include "common/errors.h"
#include "common/file_open.h"
#include "common/logging.h"
#include "diagnostics/flight_verdict.h"
#include "distributed/elastic_rendezvous.h"

namespace tessera::distributed {
namespace {

// This node's dumps by file name (rank_<r>.json).
std::map<std::string, std::string> localDumps(const std::string& flightDir) {
  std::map<std::string, std::string> dumps;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(flightDir, ec)) {
    try {
      dumps[entry.path().filename().string()] = readRegularFile(entry.path().string(), int64_t{64} << 20,
                                                                LinkPolicy::kRefuse);
    } catch (const Error&) {
      // Not a dump (or not readable): the verdict reports what it cannot read.
    }
  }
  return dumps;
}

// Sends this node's dumps to the other nodes and writes theirs into the flight dir: through
// the elastic rendezvous, or in a static multi-node run through a server at
// MASTER_PORT + 1 that the first launcher to fail hosts for the others.
// Returns how many other nodes failed with this one (elastic; -1 when unknown).
int64_t fetchOtherNodesDumps(const FailureReport& r, const std::map<std::string, std::string>& mine) {
  const LaunchOptions& options = r.options;
  std::unique_ptr<ElasticRendezvous> staticExchange;
  ElasticRendezvous* exchange = r.rendezvous;
  if (exchange == nullptr && options.nnodes > 1 && !mine.empty()) {  // no dumps: not a Tessera program
    try {
      ElasticOptions o;
      o.runId = options.runId;
      o.host = options.masterAddr;
      o.port = options.masterPort < 65535 ? options.masterPort + 1 : options.masterPort - 1;
      o.minNodes = o.maxNodes = options.nnodes;
      o.quiet = true;
      staticExchange = std::make_unique<ElasticRendezvous>(o, options.nprocPerNode);
      exchange = staticExchange.get();
    } catch (const std::exception& e) {
      TLOG_WARN("tessera-run: the other nodes' flight dumps: " << e.what());
    }
  }
  if (exchange == nullptr) return -1;
  const int expected = r.rendezvous ? 0 : options.nnodes;
  int64_t othersFailed = -1;
  for (const auto& [name, text] :
       exchange->exchangeDumps(r.round, mine, 5.0, expected, r.rendezvous ? &othersFailed : nullptr)) {
    if (mine.count(name) != 0 || name.find('/') != std::string::npos || name.rfind("rank_", 0) != 0) continue;
    try {
      std::filesystem::create_directories(r.flightDir);
      replaceFile(strCat(r.flightDir, "/", name), text);
    } catch (const Error& e) {
      TLOG_WARN("tessera-run: " << e.what());
    }
  }
  return othersFailed;
}

// How `rank` ended, in words, for the verdict.
std::string fateOf(const FailureReport& r, const RankProcess& rank) {
  std::string fate = describeStatus(rank.waitStatus);
  if (!rank.execError.empty()) fate = rank.execError;
  if (rank.killed) {
    fate = strCat("killed by the launcher: it was still running ", formatSeconds(r.options.gracePeriodS, 1),
                  " s after SIGTERM");
  }
  const auto& failure = r.processes.failure();
  if (failure && failure->globalRank == rank.globalRank) {
    fate = strCat(fate, " after ", formatSeconds(failure->afterS), " s, the first rank to fail");
  }
  if (rank.globalRank == 0) {
    fate += strCat(" (it hosted the ranks' store at ", r.options.masterAddr, ":", r.options.masterPort, ")");
  }
  if (rank.stopped) fate += " (it was stopped when the run was torn down: SIGSTOP or a debugger)";
  return fate;
}

// The flight recorder's verdict, logged line by line (verdictFromDumps: there was one).
FailureReported reportVerdict(const FailureReport& r) {
  FailureReported reported;
  reported.otherNodesFailed = fetchOtherNodesDumps(r, localDumps(r.flightDir));
  std::error_code ec;
  if (!std::filesystem::is_directory(r.flightDir, ec)) return reported;  // no rank wrote a dump (not a Tessera program)
  diagnostics::VerdictInput input;
  input.dir = r.flightDir;
  input.worldSize = r.options.nnodes * r.options.nprocPerNode;
  for (const RankProcess& rank : r.processes.ranks()) {
    if (rank.stopped) input.stopped.insert(rank.globalRank);
    input.fates[rank.globalRank] = fateOf(r, rank);
  }
  try {
    const auto lines = diagnostics::flightVerdict(input);
    TLOG_ERROR("tessera-run: verdict from the flight recorder (dumps in " << r.flightDir << "):");
    for (const auto& line : lines) TLOG_ERROR("tessera-run:   " << line);
    reported.verdictFromDumps = true;
  } catch (const std::exception& e) {
    TLOG_WARN("tessera-run: no verdict: " << e.what());
  }
  return reported;
}

}  // namespace

int failureExitStatus(const RankFailure& f) {
  if (!f.execError.empty() || !WIFEXITED(f.waitStatus)) return 1;
  return WEXITSTATUS(f.waitStatus);
}

FailureReported reportFailure(const FailureReport& r, double stoppedInS) {
  const RankFailure& f = *r.processes.failure();
  const std::string how = f.execError.empty() ? describeStatus(f.waitStatus) : f.execError;
  const int others = r.options.nprocPerNode - 1;
  TLOG_ERROR("tessera-run: rank " << f.globalRank << " failed (" << how << ") after " << formatSeconds(f.afterS)
             << " s; stopped the other " << others << " rank" << (others == 1 ? "" : "s") << " in "
             << formatSeconds(stoppedInS, 3) << " s");
  // Every rank's message (the ranks leave their console to the launcher when their error
  // file is written): a config error all ranks found is one line, not one per rank.
  std::map<int, std::string> messages;
  for (const RankProcess& rank : r.processes.ranks()) {
    if (auto message = readErrorFile(rank.errorFile)) messages[rank.globalRank] = std::move(*message);
  }
  for (const std::string& line : foldRankErrors(messages, f.globalRank)) TLOG_ERROR("tessera-run: " << line);
  if (failureExitStatus(f) == kBadInputStatus) return {};  // a refused config says all there is
  return reportVerdict(r);
}

}  // namespace tessera::distributed
