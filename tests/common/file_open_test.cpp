// common/file_open.h: reads refuse anything but a regular file (without blocking on a
// FIFO), writes never go through a link or into a special file planted at the name.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "common/errors.h"
#include "common/file_open.h"
#include "tests/support/scratch_path.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

std::string readAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class FileOpenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::scratchPath("tessera_file_open", "dir");
    fs::create_directories(dir_);
    victim_ = dir_ + "/victim";
    std::ofstream(victim_) << "precious";
    link_ = dir_ + "/link";
    fs::create_symlink(victim_, link_);
    fifo_ = dir_ + "/fifo";
    ASSERT_EQ(::mkfifo(fifo_.c_str(), 0600), 0);
  }

  // The message of the tessera::Error `f` throws ("" if none).
  template <typename F>
  static std::string errorOf(F&& f) {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }

  std::string dir_, victim_, link_, fifo_;
};

TEST_F(FileOpenTest, ReadsRefuseWhatIsNotARegularFile) {
  EXPECT_NE(errorOf([&] { openRegularForRead(fifo_, LinkPolicy::kFollow); }).find("is a FIFO"), std::string::npos);
  EXPECT_NE(errorOf([&] { openRegularForRead(dir_, LinkPolicy::kFollow); }).find("is a directory"), std::string::npos);
  EXPECT_NE(errorOf([&] { openRegularForRead("/dev/zero", LinkPolicy::kFollow); }).find("character device"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { openRegularForRead(link_, LinkPolicy::kRefuse); }).find("symbolic link"), std::string::npos);
  EXPECT_EQ(openRegularForRead(dir_ + "/missing", LinkPolicy::kFollow), -1);  // the caller names a missing file
  const int fd = openRegularForRead(link_, LinkPolicy::kFollow);
  ASSERT_GE(fd, 0);
  ::close(fd);
  EXPECT_EQ(readRegularFile(link_, 100), "precious");
  const std::string big = errorOf([&] { readRegularFile(victim_, 3); });
  EXPECT_NE(big.find(victim_), std::string::npos) << big;
  EXPECT_NE(big.find("more than the 3"), std::string::npos) << big;
}

TEST_F(FileOpenTest, FreshFilesReplaceALinkWithoutFollowingIt) {
  const int fd = createFreshFile(link_);
  writeAllTo(fd, "new", 3, link_);
  ::close(fd);
  EXPECT_EQ(readAll(victim_), "precious");
  EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(link_)));
  EXPECT_EQ(readAll(link_), "new");
  EXPECT_NE(errorOf([&] { createFreshFile(dir_); }).find("a directory is in the way"), std::string::npos);
  EXPECT_NE(errorOf([&] { createFreshFile(""); }).find("empty name"), std::string::npos);
}

TEST_F(FileOpenTest, AppendsRefuseLinksAndSpecialFiles) {
  EXPECT_NE(errorOf([&] { openForAppend(link_); }).find("symbolic link"), std::string::npos);
  EXPECT_NE(errorOf([&] { openForAppend(fifo_); }).find("is a FIFO"), std::string::npos);
  EXPECT_EQ(readAll(victim_), "precious");
  const std::string log = dir_ + "/log";
  for (int i = 0; i < 2; ++i) {
    const int fd = openForAppend(log);
    writeAllTo(fd, "x", 1, log);
    ::close(fd);
  }
  EXPECT_EQ(readAll(log), "xx");
}

TEST_F(FileOpenTest, ReplacingAFileNeverWritesThroughAndRefusesDevices) {
  replaceFile(link_, "replaced");
  EXPECT_EQ(readAll(victim_), "precious");
  EXPECT_EQ(readAll(link_), "replaced");
  // A link planted at the temporary name is not followed either.
  const std::string out = dir_ + "/out";
  fs::create_symlink(victim_, out + ".tmp");
  replaceFile(out, "mine");
  EXPECT_EQ(readAll(victim_), "precious");
  EXPECT_EQ(readAll(out), "mine");
  EXPECT_NE(errorOf([&] { replaceFile(fifo_, "x"); }).find("refusing to replace"), std::string::npos);
  EXPECT_NE(errorOf([&] { checkReplaceable("/dev/null"); }).find("character device"), std::string::npos);
  EXPECT_NE(errorOf([&] { checkReplaceable(""); }).find("empty"), std::string::npos);
  struct stat st {};
  ASSERT_EQ(::lstat(fifo_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
}

}  // namespace
}  // namespace tessera
