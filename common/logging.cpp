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
std::shared_ptr<spdlog::logger> g_logger;  // guarded by g_mutex for replacement
std::atomic<int> g_level{static_cast<int>(Level::kInfo)};
std::atomic<int> g_rank{0};

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

std::shared_ptr<spdlog::logger> makeLogger(const LogOptions& options) {
  std::vector<spdlog::sink_ptr> sinks;
  if (options.console) sinks.push_back(std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  if (!options.file.empty()) {
    try {
      sinks.push_back(std::make_shared<AppendFileSink>(options.file));
    } catch (const Error& e) {
      throw Error(strCat("log::init: cannot open log file: ", e.what()));
    }
  }
  auto logger = std::make_shared<spdlog::logger>("tessera", sinks.begin(), sinks.end());
  // Time, level, then the rank prefix: "[12:00:01.123] [info] [rank 3] message".
  std::string prefix = options.rank >= 0 ? strCat("[rank ", options.rank, "] ") : std::string();
  logger->set_pattern("[%H:%M:%S.%e] [%l] " + prefix + "%v");
  logger->set_level(spdlog::level::trace);  // filtering is done by g_level
  logger->flush_on(spdlog::level::warn);
  return logger;
}

std::shared_ptr<spdlog::logger> current() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_logger) {
    LogOptions defaults;
    const char* env = std::getenv("TESSERA_LOG_LEVEL");
    if (env && *env) {
      try {
        g_level = static_cast<int>(parseLevel(env));
      } catch (const Error&) {
        // An unparsable environment level must not make logging itself fail; init()
        // reports it properly when the app configures logging.
      }
    }
    g_logger = makeLogger(defaults);
  }
  return g_logger;
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

const char* levelName(Level level) {
  switch (level) {
    case Level::kTrace: return "trace";
    case Level::kDebug: return "debug";
    case Level::kInfo: return "info";
    case Level::kWarn: return "warn";
    case Level::kError: return "error";
    case Level::kOff: return "off";
  }
  return "info";
}

void init(const LogOptions& options) {
  Level lvl = Level::kInfo;
  if (!options.level.empty()) {
    lvl = parseLevel(options.level);
  } else if (const char* env = std::getenv("TESSERA_LOG_LEVEL"); env && *env) {
    try {
      lvl = parseLevel(env);
    } catch (const ConfigError& e) {
      throw ConfigError(strCat("TESSERA_LOG_LEVEL: ", e.what()));
    }
  }
  auto logger = makeLogger(options);
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_logger) g_logger->flush();
  g_logger = std::move(logger);
  g_level = static_cast<int>(lvl);
  g_rank = options.rank;
}

Level level() { current(); return static_cast<Level>(g_level.load()); }
void setLevel(Level lvl) { g_level = static_cast<int>(lvl); }
int rank() { return g_rank.load(); }
bool enabled(Level lvl) { return lvl != Level::kOff && static_cast<int>(lvl) >= static_cast<int>(level()); }

void write(Level lvl, const std::string& message) { current()->log(toSpd(lvl), "{}", message); }

void flush() { current()->flush(); }

}  // namespace tessera::log
