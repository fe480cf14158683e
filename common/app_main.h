// The exit-status contract shared by every Tessera program:
//   0 success; 2 bad input (ConfigError, UsageError); 1 any other failure; programs may
//   also exit kResumableStopStatus (75) and kNothingToRejoinStatus (76) below.
// On failure the message is logged and, when torchrun (or tessera-run) set
// TORCHELASTIC_ERROR_FILE, written there in torchelastic's JSON format so the launcher
// can report the failing rank's own message. It goes to stderr too, unless tessera-run
// (TESSERA_RUN_REPORTS_ERRORS=1) will print it from that file.
#pragma once

#include <functional>
#include <string>

namespace tessera {

// A program that stopped early with its state saved, because a peer was stopped (EX_TEMPFAIL:
// try again): tessera-train exits with it when another rank had SIGTERM and this one none,
// so that tessera-run or torchrun restarts it and the run resumes.
constexpr int kResumableStopStatus = 75;

// tessera-run sets it to "1" for ranks it restarts into the elastic round that still runs,
// because no other node's ranks failed with them (a run under tessera-train's fault.survive
// went on without this node). A program that finds no such run to rejoin exits
// kNothingToRejoinStatus, and the launcher takes its node to the next rendezvous round
// without counting a failure.
constexpr const char* kRestartedIntoLiveRoundEnv = "TESSERA_RESTARTED_INTO_LIVE_ROUND";
constexpr int kNothingToRejoinStatus = 76;

// tessera-run sets it to "1" in each rank's environment: the launcher prints the ranks'
// error files, identical messages once, so a rank whose error file was written does not
// print its message too.
constexpr const char* kLauncherReportsErrorsEnv = "TESSERA_RUN_REPORTS_ERRORS";

// Runs `body` and maps exceptions to exit statuses as above.
int runMain(const std::string& programName, const std::function<int()>& body);

// Called by runMain with the failure's message when `body` throws, before the error file
// is written (the flight recorder registers its dump here). Hooks must not throw.
void addFailureHook(std::function<void(const std::string& message)> hook);

// Writes {"message": {"message": ..., "extraInfo": {...}}} to $TORCHELASTIC_ERROR_FILE;
// false when the variable is unset or the file could not be written (never throws).
bool writeErrorFile(const std::string& message);

}  // namespace tessera
