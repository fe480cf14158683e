// POSIX helpers for durable writes and bounds-checked reads (see file_io.h).
#include "checkpoint/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "checkpoint/format.h"
#include "common/errors.h"

namespace tessera::checkpoint {

namespace fs = std::filesystem;

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

File::File(File&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) { other.fd_ = -1; }

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

File File::openRead(const std::string& path, LinkPolicy links) {
  int fd = -1;
  try {
    fd = openRegularForRead(path, links);
  } catch (const CheckpointError&) {
    throw;
  } catch (const Error& e) {
    // A link, FIFO or directory where a checkpoint or weights file belongs is a damaged file.
    throw CheckpointError(e.what());
  }
  if (fd < 0) throw CheckpointError(strCat("missing file ", path));
  return File(fd, path);
}

File File::openWrite(const std::string& path) { return File(createFreshFile(path), path); }

void File::writeAll(const void* data, size_t bytes) { writeAllTo(fd_, data, bytes, path_); }

void File::readAt(void* data, size_t bytes, int64_t offset, const std::string& what) const {
  char* p = static_cast<char*>(data);
  const int64_t start = offset;
  while (bytes > 0) {
    const ssize_t n = ::pread(fd_, p, bytes, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(strCat("read of ", path_, what.empty() ? "" : " (", what, what.empty() ? "" : ")", " failed: ",
                         errnoText(errno)));
    }
    if (n == 0) {
      throw CheckpointError(strCat("file ", path_, " is truncated: it ends at byte ", offset, ", but ",
                                   what.empty() ? std::string("the reader") : what, " needs bytes [", start, ", ",
                                   start + static_cast<int64_t>(bytes) + (offset - start), ")"));
    }
    p += n;
    offset += n;
    bytes -= static_cast<size_t>(n);
  }
}

int64_t File::size() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) throw Error(strCat("fstat of ", path_, " failed: ", errnoText(errno)));
  return static_cast<int64_t>(st.st_size);
}

void File::sync() {
  if (::fsync(fd_) != 0) throw Error(strCat("fsync of ", path_, " failed: ", errnoText(errno)));
}

void File::startWriteback(int64_t offset, int64_t bytes) {
#ifdef SYNC_FILE_RANGE_WRITE
  if (bytes > 0) ::sync_file_range(fd_, offset, bytes, SYNC_FILE_RANGE_WRITE);
#endif
}

void File::dropCache() {
#ifdef POSIX_FADV_DONTNEED
  ::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);
#endif
}

void File::close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) throw Error(strCat("close of ", path_, " failed: ", errnoText(errno)));
}

void syncDirectory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw Error(strCat("cannot open directory ", dir, " to fsync it: ", errnoText(errno)));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw Error(strCat("fsync of directory ", dir, " failed: ", errnoText(err)));
}

void writeFileAtomic(const std::string& path, const std::string& content, bool syncParent) {
  checkReplaceable(path);
  const std::string tmp = path + ".tmp";
  File f = File::openWrite(tmp);
  f.writeAll(content.data(), content.size());
  f.sync();
  f.close();
  renamePath(tmp, path);
  if (!syncParent) return;
  const fs::path parent = fs::path(path).parent_path();
  syncDirectory(parent.empty() ? "." : parent.string());
}

std::string readFileBounded(const std::string& path, int64_t maxBytes, LinkPolicy links) {
  File f = File::openRead(path, links);
  const int64_t size = f.size();
  if (size > maxBytes) {
    throw CheckpointError(strCat("file ", path, " is ", size, " bytes, more than the ", maxBytes, " this reader accepts"));
  }
  std::string out(static_cast<size_t>(size), '\0');
  if (size > 0) f.readAt(out.data(), out.size(), 0);
  return out;
}

bool pathExists(const std::string& path) {
  std::error_code ec;
  return fs::exists(path, ec);
}

void renamePath(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    throw Error(strCat("cannot rename ", from, " to ", to, ": ", errnoText(errno)));
  }
}

}  // namespace tessera::checkpoint
