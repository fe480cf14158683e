// spdlog-backed implementation of the logging facade (the only file that sees spdlog).
#include "common/logging.h"

#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <mutex>

#include <unistd.h>

#include "common/errors.h"
#include "common/file_open.h"

namespace tessera::log {
namespace {

std::mutex g_mutex;
// The process's loggers: `all` writes to every sink (console and file), `fileOnly` to the
// rank's file alone (null without one): rank-0-only lines go to the console of rank 0 and
// to every rank's file, so that each rank's file tells its whole story.
struct Loggers {
  std::shared_ptr<spdlog::logger> all, fileOnly;
};
Loggers g_loggers;  // guarded by g_mutex for replacement
std::atomic<int> g_level{static_cast<int>(Level::kInfo)};
std::atomic<int> g_rank{0};
std::atomic<bool> g_configured{false};  // init() was called: adoptRank() leaves it alone

spdlog::level::level_enum toSpd(Level level) {
  switch (level) {
    case Level::kTrace: return spdlog::level::trace;
    case Level::kDebug: return spdlog::level::debug;
    case Level::kInfo: return spdlog::level::info;
    case Level::kWarn: return spdlog::level::warn;
    case Level::kError: return spdlog::level::err;
    case Level::kOff: return spdlog::level::off;
  }
  return spdlog::level::info;
}

// Appends log lines to a file opened by openForAppend. Not spdlog's basic_file_sink: it
// opens with fopen(), which writes through a symbolic link planted at logs/rank_N.log.
class AppendFileSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  explicit AppendFileSink(const std::string& path) : path_(path), fd_(openForAppend(path)) {}
  ~AppendFileSink() override { ::close(fd_); }
  AppendFileSink(const AppendFileSink&) = delete;
  AppendFileSink& operator=(const AppendFileSink&) = delete;

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t line;
    formatter_->format(msg, line);
    writeAllTo(fd_, line.data(), line.size(), path_);  // spdlog reports a throw on stderr
  }
  void flush_() override {}  // every line is written at once

 private:
  std::string path_;
  int fd_;
};

std::shared_ptr<spdlog::logger> makeLogger(std::vector<spdlog::sink_ptr> sinks, int rank) {
  auto logger = std::make_shared<spdlog::logger>("tessera", sinks.begin(), sinks.end());
  // Time, level, then the rank prefix: "[12:00:01.123] [info] [rank 3] message".
  std::string prefix = rank >= 0 ? strCat("[rank ", rank, "] ") : std::string();
  logger->set_pattern("[%H:%M:%S.%e] [%l] " + prefix + "%v");
  logger->set_level(spdlog::level::trace);  // filtering is done by g_level
  logger->flush_on(spdlog::level::warn);
  return logger;
}

Loggers makeLoggers(const LogOptions& options) {
  std::vector<spdlog::sink_ptr> sinks;
  if (options.console) sinks.push_back(std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  spdlog::sink_ptr file;
  if (!options.file.empty()) {
    try {
      file = std::make_shared<AppendFileSink>(options.file);
    } catch (const Error& e) {
      throw Error(strCat("log::init: cannot open log file: ", e.what()));
    }
    sinks.push_back(file);
  }
  Loggers out;
  out.all = makeLogger(sinks, options.rank);
  if (file) out.fileOnly = makeLogger({file}, options.rank);
  return out;
}

Loggers current() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_loggers.all) {
    LogOptions defaults;
    defaults.rank = g_rank;
    const char* env = std::getenv("TESSERA_LOG_LEVEL");
    if (env && *env) {
      try {
        g_level = static_cast<int>(parseLevel(env));
      } catch (const Error&) {
        // An unparsable environment level must not make logging itself fail; init()
        // reports it properly when the app configures logging.
      }
    }
    g_loggers = makeLoggers(defaults);
  }
  return g_loggers;
}

}  // namespace

Level parseLevel(const std::string& name) {
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "trace") return Level::kTrace;
  if (lower == "debug") return Level::kDebug;
  if (lower == "info") return Level::kInfo;
  if (lower == "warn" || lower == "warning") return Level::kWarn;
  if (lower == "error") return Level::kError;
  if (lower == "off") return Level::kOff;
  throw ConfigError(strCat("log level '", name, "' is not one of trace, debug, info, warn, error, off"));
}


void init(const LogOptions& options) {
  // TESSERA_LOG_LEVEL, when set, wins over the program's level (log.level, a tool's
  // default): one variable turns every program's detail up or down.
  Level lvl = Level::kInfo;
  if (const char* env = std::getenv("TESSERA_LOG_LEVEL"); env && *env) {
    try {
      lvl = parseLevel(env);
    } catch (const ConfigError& e) {
      throw ConfigError(strCat("TESSERA_LOG_LEVEL: ", e.what()));
    }
  } else if (!options.level.empty()) {
    lvl = parseLevel(options.level);
  }
  Loggers loggers = makeLoggers(options);
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_loggers.all) g_loggers.all->flush();
  g_loggers = std::move(loggers);
  g_level = static_cast<int>(lvl);
  g_rank = options.rank;
  g_configured = true;
}

bool configured() { return g_configured.load(); }

void adoptRank(int rank) {
  if (g_configured) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  g_rank = rank;
  g_loggers = Loggers{};  // remade with the rank by the next line logged
}

Level level() { current(); return static_cast<Level>(g_level.load()); }
int rank() { return g_rank.load(); }
bool enabled(Level lvl) { return lvl != Level::kOff && static_cast<int>(lvl) >= static_cast<int>(level()); }

void write(Level lvl, const std::string& message) { current().all->log(toSpd(lvl), "{}", message); }

void writeRankZero(Level lvl, const std::string& message) {
  const Loggers loggers = current();
  if (rank() <= 0) {
    loggers.all->log(toSpd(lvl), "{}", message);
  } else if (loggers.fileOnly) {
    loggers.fileOnly->log(toSpd(lvl), "{}", message);
  }
}

void writeToFile(Level lvl, const std::string& message) {
  if (!enabled(lvl)) return;
  const Loggers loggers = current();
  if (loggers.fileOnly) loggers.fileOnly->log(toSpd(lvl), "{}", message);
}

void flush() { current().all->flush(); }

}  // namespace tessera::log
