// The exit-status contract shared by every Tessera program:
//   0 success; 2 bad input (ConfigError, UsageError); 1 any other failure.
// On failure the message is logged and, when torchrun (or tessera-run) set
// TORCHELASTIC_ERROR_FILE, written there in torchelastic's JSON format so the launcher
// can report the failing rank's own message.
#pragma once

#include <functional>
#include <string>

namespace tessera {

// Runs `body` and maps exceptions to exit statuses as above.
int runMain(const std::string& programName, const std::function<int()>& body);

// Called by runMain with the failure's message when `body` throws, before the error file
// is written (the flight recorder registers its dump here). Hooks must not throw.
void addFailureHook(std::function<void(const std::string& message)> hook);

// Writes {"message": {"message": ..., "extraInfo": {...}}} to $TORCHELASTIC_ERROR_FILE
// (no-op when the variable is unset; never throws).
void writeErrorFile(const std::string& message);

}  // namespace tessera
