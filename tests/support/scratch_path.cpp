// scratchPath and the GoogleTest listener that removes a passed test's paths (see
// scratch_path.h).
#include "tests/support/scratch_path.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <vector>

#include "common/filesystem.h"

namespace tessera::test {
namespace {

std::vector<std::string>& pathsOfThisTest() {
  static std::vector<std::string> paths;
  return paths;
}

class RemovePassedTestsPaths : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Passed()) {
      for (const std::string& path : pathsOfThisTest()) {
        std::error_code ignored;
        removeTree(path, ignored);
      }
    }
    pathsOfThisTest().clear();
  }
};

}  // namespace

std::string scratchPath(const std::string& prefix, const std::string& tag) {
  static const bool listening = [] {
    ::testing::UnitTest::GetInstance()->listeners().Append(new RemovePassedTestsPaths);  // gtest owns it
    return true;
  }();
  (void)listening;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name = info != nullptr ? info->name() : "no_test";
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() / (prefix + "_" + name + "_" + std::to_string(::getpid()) + "_" + tag);
  removeTree(path.string());
  pathsOfThisTest().push_back(path.string());
  return path.string();
}

}  // namespace tessera::test
