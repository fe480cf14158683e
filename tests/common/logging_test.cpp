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
  flush();
  const std::string text = readFile(file);
  EXPECT_NE(text.find("[rank 3] visible 42"), std::string::npos) << text;
  EXPECT_NE(text.find("[warning] [rank 3] a warning"), std::string::npos) << text;
  EXPECT_EQ(text.find("hidden debug line"), std::string::npos) << text;
}

// A rank-0-only line is printed once on the console (by rank 0) and kept in every rank's
// own file: a rank's file is its whole story, not an empty file.
TEST(LoggingTest, RankZeroLinesGoToEveryRanksFileButOnlyRankZerosConsole) {
  const std::string file = tempLogPath("rank3-console.log");
  std::filesystem::remove(file);
  init({/*rank=*/3, /*level=*/"info", file, /*console=*/true});
  testing::internal::CaptureStderr();
  TLOG_INFO0("rank-0-only line");
  TLOG_INFO("every rank's line");
  flush();
  const std::string console = testing::internal::GetCapturedStderr();
  const std::string text = readFile(file);
  EXPECT_NE(text.find("[rank 3] rank-0-only line"), std::string::npos) << text;
  EXPECT_EQ(console.find("rank-0-only line"), std::string::npos) << console;
  EXPECT_NE(console.find("[rank 3] every rank's line"), std::string::npos) << console;

  init({0, "info", "", true});
  testing::internal::CaptureStderr();
  TLOG_INFO0("rank zero prints it");
  flush();
  EXPECT_NE(testing::internal::GetCapturedStderr().find("[rank 0] rank zero prints it"), std::string::npos);
}

// A library user never calls init(): Runtime::init adopts the rank, so lines say who wrote
// them; an application's own init() is not overridden. It needs a process where init()
// was never called: ctest runs each test in its own; the executable run whole does not.
TEST(LoggingTest, LibraryUseTakesTheRankFromTheRuntime) {
  if (configured()) GTEST_SKIP() << "init() already called in this process (run this test on its own)";
  adoptRank(2);
  testing::internal::CaptureStderr();
  TLOG_INFO("from a library rank");
  flush();
  EXPECT_NE(testing::internal::GetCapturedStderr().find("[rank 2] from a library rank"), std::string::npos);
  init({5, "info", "", true});
  adoptRank(1);
  testing::internal::CaptureStderr();
  TLOG_INFO("after init");
  flush();
  EXPECT_NE(testing::internal::GetCapturedStderr().find("[rank 5] after init"), std::string::npos);
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
