// The exit-status contract shared by every Tessera program:
//   0 success; 2 bad input (ConfigError, UsageError); 1 any other failure; programs may
//   also exit kResumableStopStatus (75) below.
// On failure the message is logged and, when torchrun (or tessera-run) set
// TORCHELASTIC_ERROR_FILE, written there in torchelastic's JSON format so the launcher
// can report the failing rank's own message.
#pragma once

#include <functional>
#include <string>

namespace tessera {

// A program that stopped early with its state saved, because a peer was stopped (EX_TEMPFAIL:
// try again): tessera-train exits with it when another rank had SIGTERM and this one none,
// so that tessera-run or torchrun restarts it and the run resumes.
constexpr int kResumableStopStatus = 75;

// Runs `body` and maps exceptions to exit statuses as above.
int runMain(const std::string& programName, const std::function<int()>& body);

// Called by runMain with the failure's message when `body` throws, before the error file
// is written (the flight recorder registers its dump here). Hooks must not throw.
void addFailureHook(std::function<void(const std::string& message)> hook);

// Writes {"message": {"message": ..., "extraInfo": {...}}} to $TORCHELASTIC_ERROR_FILE
// (no-op when the variable is unset; never throws).
void writeErrorFile(const std::string& message);

}  // namespace tessera
