// Logging facade: rank-prefixed lines ("[rank 3] ..."), rank-0-only helpers (console of
// rank 0, and every rank's file), a level from the config or TESSERA_LOG_LEVEL, and an
// optional per-rank log file.
//
// spdlog stays inside logging.cpp; callers use the stream-style macros below, which
// skip building the message when its level is off:
//   TLOG_INFO("step " << step << " loss " << loss);
//   TLOG_INFO0("only rank 0 prints this");
#pragma once

#include <sstream>
#include <string>

namespace tessera::log {

enum class Level { kTrace = 0, kDebug, kInfo, kWarn, kError, kOff };

struct LogOptions {
  int rank = 0;             // printed as "[rank N]"; -1 prints no prefix (single-process tools)
  std::string level = "";   // trace|debug|info|warn|error|off ("" = info); TESSERA_LOG_LEVEL wins when set
  std::string file = "";    // also append every line to this file ("" = console only)
  bool console = true;      // write to stderr
};

// (Re)configures the process-wide logger. Safe to call more than once.
// Throws tessera::ConfigError for an unknown level name.
void init(const LogOptions& options);

// Parses "trace|debug|info|warn|warning|error|off" (case-insensitive).
Level parseLevel(const std::string& name);

Level level();
int rank();
bool enabled(Level level);

// Writes one line at `level` (no check of rank).
void write(Level level, const std::string& message);
// A rank-0-only line: on rank 0 (or no rank) everywhere, on other ranks to their log file
// only, so the console shows it once and every rank's file holds it.
void writeRankZero(Level level, const std::string& message);
// Writes one line to this rank's log file only (nothing without one).
void writeToFile(Level level, const std::string& message);
// Library use (no init() call): prefix lines with `rank` from now on. Runtime::init calls
// it; an application's own init() wins.
void adoptRank(int rank);
// Whether init() was called in this process.
bool configured();
// Flushes console and file sinks.
void flush();

}  // namespace tessera::log

#define TESSERA_LOG_AT_(lvl, only_rank0, expr)                                        \
  do {                                                                               \
    if (::tessera::log::enabled(lvl)) {                                              \
      std::ostringstream tessera_log_stream_;                                        \
      tessera_log_stream_ << expr;                                                   \
      if (only_rank0) {                                                              \
        ::tessera::log::writeRankZero(lvl, tessera_log_stream_.str());               \
      } else {                                                                       \
        ::tessera::log::write(lvl, tessera_log_stream_.str());                       \
      }                                                                              \
    }                                                                                \
  } while (false)

#define TLOG_TRACE(expr) TESSERA_LOG_AT_(::tessera::log::Level::kTrace, false, expr)
#define TLOG_DEBUG(expr) TESSERA_LOG_AT_(::tessera::log::Level::kDebug, false, expr)
#define TLOG_INFO(expr) TESSERA_LOG_AT_(::tessera::log::Level::kInfo, false, expr)
#define TLOG_WARN(expr) TESSERA_LOG_AT_(::tessera::log::Level::kWarn, false, expr)
#define TLOG_ERROR(expr) TESSERA_LOG_AT_(::tessera::log::Level::kError, false, expr)
// Rank-0-only variants.
#define TLOG_DEBUG0(expr) TESSERA_LOG_AT_(::tessera::log::Level::kDebug, true, expr)
#define TLOG_INFO0(expr) TESSERA_LOG_AT_(::tessera::log::Level::kInfo, true, expr)
#define TLOG_WARN0(expr) TESSERA_LOG_AT_(::tessera::log::Level::kWarn, true, expr)
