// Safe opens for untrusted paths (see file_open.h).
#include "common/file_open.h"

#include <filesystem>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/errors.h"

namespace tessera {
namespace {

const char* kindOf(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

[[noreturn]] void refuseKind(const std::string& path, mode_t mode, const char* purpose) {
  throw Error(strCat("'", path, "' is ", kindOf(mode), ", not a regular file: refusing to ", purpose, " it"));
}

// O_NONBLOCK makes open() of a FIFO return at once (it is then refused by fstat); it is
// cleared again for regular files, where it has no effect anyway.
int openChecked(const std::string& path, int flags, mode_t createMode, const char* purpose) {
  const int fd = ::open(path.c_str(), flags | O_NONBLOCK | O_CLOEXEC, createMode);
  if (fd < 0) {
    const int err = errno;
    if (err == ELOOP && (flags & O_NOFOLLOW)) {
      throw Error(strCat("'", path, "' is a symbolic link: refusing to ", purpose, " through it"));
    }
    // A FIFO without a reader fails a non-blocking open for writing (ENXIO), a directory
    // one for writing (EISDIR): say what is there rather than the errno.
    struct stat st {};
    if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode)) {
      refuseKind(path, st.st_mode, purpose);
    }
    errno = err;
    return -1;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const mode_t mode = st.st_mode;
    ::close(fd);
    refuseKind(path, mode, purpose);
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

}  // namespace

std::string errnoText(int err) { return strCat(std::strerror(err), " (errno ", err, ")"); }

int openRegularForRead(const std::string& path, LinkPolicy links) {
  // stat() first so that a device is refused without opening it (opening some has effects).
  struct stat st {};
  const int statRc = links == LinkPolicy::kRefuse ? ::lstat(path.c_str(), &st) : ::stat(path.c_str(), &st);
  if (statRc != 0) {
    const int err = errno;
    if (err == ENOENT) return -1;
    throw Error(strCat("cannot open '", path, "' for reading: ", errnoText(err)));
  }
  if (!S_ISREG(st.st_mode)) refuseKind(path, st.st_mode, "read");
  const int fd = openChecked(path, O_RDONLY | (links == LinkPolicy::kRefuse ? O_NOFOLLOW : 0), 0, "read");
  if (fd < 0 && errno != ENOENT) throw Error(strCat("cannot open '", path, "' for reading: ", errnoText(errno)));
  return fd;
}

int createFreshFile(const std::string& path) {
  if (path.empty()) throw Error("cannot create a file with an empty name");
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) throw Error(strCat("cannot create '", path, "': a directory is in the way"));
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      throw Error(strCat("cannot replace '", path, "': ", errnoText(errno)));
    }
  }
  const int fd = openChecked(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0644, "write");
  if (fd < 0) throw Error(strCat("cannot create '", path, "': ", errnoText(errno)));
  return fd;
}

int openForAppend(const std::string& path) {
  const int fd = openChecked(path, O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW, 0644, "append to");
  if (fd < 0) throw Error(strCat("cannot open '", path, "' for appending: ", errnoText(errno)));
  return fd;
}

std::string readRegularFile(const std::string& path, int64_t maxBytes, LinkPolicy links) {
  const int fd = openRegularForRead(path, links);
  if (fd < 0) throw Error(strCat("cannot read '", path, "': no such file"));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw Error(strCat("cannot stat '", path, "': ", errnoText(errno)));
  if (st.st_size > maxBytes) {
    throw Error(strCat("'", path, "' is ", st.st_size, " bytes, more than the ", maxBytes, " accepted here"));
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::read(fd, out.data() + done, out.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(strCat("cannot read '", path, "': ", errnoText(errno)));
    }
    if (n == 0) break;  // shrank while read: keep what is there
    done += static_cast<size_t>(n);
  }
  out.resize(done);
  return out;
}

void writeAllTo(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    // Linux writes at most ~2 GiB per call; larger requests come back short.
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(strCat("write to '", path, "' failed: ", errnoText(errno)));
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void checkReplaceable(const std::string& path) {
  if (path.empty()) throw Error("an output file name is empty");
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return;  // nothing there yet (or unreadable: open will say)
  if (!S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode)) refuseKind(path, st.st_mode, "replace");
}

void replaceFile(const std::string& path, const std::string& content) {
  checkReplaceable(path);
  const std::string tmp = path + ".tmp";
  const int fd = createFreshFile(tmp);
  try {
    writeAllTo(fd, content.data(), content.size(), tmp);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) throw Error(strCat("close of '", tmp, "' failed: ", errnoText(errno)));
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw Error(strCat("cannot rename '", tmp, "' to '", path, "': ", errnoText(err)));
  }
}

std::string relativePathNote(const std::string& path) {
  if (path.empty() || path[0] == '/') return "";
  std::error_code ec;
  const std::string cwd = std::filesystem::current_path(ec).string();
  return strCat(" (a relative path: resolved against the working directory ", ec ? "?" : cwd, ")");
}

}  // namespace tessera
