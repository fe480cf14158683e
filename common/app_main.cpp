// Exit-status mapping and torchelastic error files (see app_main.h).
#include "common/app_main.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <mutex>
#include <vector>

#include "common/errors.h"
#include "common/file_open.h"
#include "common/logging.h"

namespace tessera {

bool writeErrorFile(const std::string& message) {
  const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (!path || !*path) return false;
  try {
    const auto now = std::chrono::system_clock::now().time_since_epoch();
    nlohmann::json j = {
        {"message",
         {{"message", message},
          {"extraInfo",
           {{"py_callstack", ""}, {"timestamp", std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now).count())}}}}}};
    replaceFile(path, j.dump() + "\n");
    return true;
  } catch (...) {
    return false;  // reporting must never turn one failure into another
  }
}

namespace {

std::mutex g_hooksMutex;
std::vector<std::function<void(const std::string&)>> g_failureHooks;

void runFailureHooks(const std::string& message) {
  std::vector<std::function<void(const std::string&)>> hooks;
  {
    std::lock_guard<std::mutex> lock(g_hooksMutex);
    hooks = g_failureHooks;
  }
  for (const auto& hook : hooks) {
    try {
      hook(message);
    } catch (...) {
      // A hook's failure must not hide the failure being reported.
    }
  }
}

// LibTorch's errors carry their C++ backtrace after the message ("Exception raised from
// ... frame #0 ..."): for a user, the message is the part that says what went wrong.
std::string withoutBacktrace(const std::string& what) {
  const size_t at = what.find("\nException raised from ");
  return at == std::string::npos ? what : what.substr(0, at);
}

}  // namespace

void addFailureHook(std::function<void(const std::string& message)> hook) {
  std::lock_guard<std::mutex> lock(g_hooksMutex);
  g_failureHooks.push_back(std::move(hook));
}

int runMain(const std::string& programName, const std::function<int()>& body) {
  auto report = [&](const char* kind, const std::string& what, int status) {
    const std::string message = strCat(programName, ": ", kind, what);
    // Under tessera-run the launcher prints the error file, identical messages of several
    // ranks once; the console gets the message here only when no launcher will.
    if (log::rank() >= 0) TLOG_DEBUG(message);
    runFailureHooks(message);
    const char* launcherReports = std::getenv(kLauncherReportsErrorsEnv);
    const bool written = writeErrorFile(message);
    if (!written || launcherReports == nullptr || std::string(launcherReports) != "1") std::cerr << message << std::endl;
    log::flush();
    return status;
  };
  try {
    return body();
  } catch (const ConfigError& e) {
    return report("config error: ", e.what(), 2);
  } catch (const UsageError& e) {
    return report("usage error: ", e.what(), 2);
  } catch (const std::exception& e) {
    return report("error: ", withoutBacktrace(e.what()), 1);
  } catch (...) {
    return report("error: ", "unknown exception", 1);
  }
}

}  // namespace tessera
