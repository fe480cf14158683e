// Tests of the logging facade: rank prefix, level filtering, rank-0-only helpers,
// TESSERA_LOG_LEVEL, and the per-rank log file.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/errors.h"
#include "common/logging.h"

namespace tessera::log {
namespace {

std::string readFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// This process's log directory, removed when the process exits.
struct LogTestDir {
  std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("tessera_log_test_" + std::to_string(::getpid()));
  ~LogTestDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

std::string tempLogPath(const std::string& name) {
  static LogTestDir dir;
  std::filesystem::create_directories(dir.path);
  return (dir.path / name).string();
}

TEST(LoggingTest, RankPrefixAndLevelFilterInFile) {
  const std::string file = tempLogPath("rank3.log");
  std::filesystem::remove(file);
  init({/*rank=*/3, /*level=*/"info", file, /*console=*/false});
  TLOG_DEBUG("hidden debug line");
  TLOG_INFO("visible " << 42);
  TLOG_WARN("a warning");
  TLOG_INFO0("rank-0-only line");  // we are rank 3: must not appear
  flush();
  const std::string text = readFile(file);
  EXPECT_NE(text.find("[rank 3] visible 42"), std::string::npos) << text;
  EXPECT_NE(text.find("[warning] [rank 3] a warning"), std::string::npos) << text;
  EXPECT_EQ(text.find("hidden debug line"), std::string::npos) << text;
  EXPECT_EQ(text.find("rank-0-only line"), std::string::npos) << text;
}

TEST(LoggingTest, RankZeroHelpersPrintOnRankZero) {
  const std::string file = tempLogPath("rank0.log");
  std::filesystem::remove(file);
  init({0, "debug", file, false});
  TLOG_INFO0("rank zero says hi");
  TLOG_DEBUG0("debug from zero");
  flush();
  const std::string text = readFile(file);
  EXPECT_NE(text.find("[rank 0] rank zero says hi"), std::string::npos) << text;
  EXPECT_NE(text.find("[rank 0] debug from zero"), std::string::npos) << text;
}

TEST(LoggingTest, EnvironmentLevelAppliesWhenConfigIsSilent) {
  const std::string file = tempLogPath("env.log");
  std::filesystem::remove(file);
  ::setenv("TESSERA_LOG_LEVEL", "error", 1);
  init({1, "", file, false});
  ::unsetenv("TESSERA_LOG_LEVEL");
  EXPECT_EQ(level(), Level::kError);
  TLOG_WARN("warn is filtered");
  TLOG_ERROR("error passes");
  flush();
  const std::string text = readFile(file);
  EXPECT_EQ(text.find("warn is filtered"), std::string::npos) << text;
  EXPECT_NE(text.find("[rank 1] error passes"), std::string::npos) << text;
}

TEST(LoggingTest, BadLevelNamesAreConfigErrors) {
  EXPECT_THROW(parseLevel("loud"), ConfigError);
  EXPECT_EQ(parseLevel("WARNING"), Level::kWarn);
  ::setenv("TESSERA_LOG_LEVEL", "loud", 1);
  EXPECT_THROW(init({0, "", "", false}), ConfigError);
  ::unsetenv("TESSERA_LOG_LEVEL");
  EXPECT_THROW(init({0, "verbose", "", false}), ConfigError);
}

TEST(LoggingTest, UnwritableFileIsAnError) {
  // A regular file where a directory is needed: spdlog cannot create the log file.
  const std::string notADir = tempLogPath("plain-file");
  std::ofstream(notADir) << "x";
  EXPECT_THROW(init({0, "info", notADir + "/y.log", false}), Error);
}

TEST(LoggingTest, OffSilencesEverything) {
  const std::string file = tempLogPath("off.log");
  std::filesystem::remove(file);
  init({0, "off", file, false});
  TLOG_ERROR("nothing");
  flush();
  EXPECT_EQ(readFile(file), "");
  init({0, "info", "", true});
}

}  // namespace
}  // namespace tessera::log
