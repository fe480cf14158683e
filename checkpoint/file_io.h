// POSIX file helpers for the commit protocol: full writes and positional reads that
// report the file and errno, fsync of files and directories, atomic small-file
// replacement, and a bounded whole-file read. Every failure throws tessera::Error (or
// CheckpointError for a file that is missing or shorter than needed) naming the path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/file_open.h"

namespace tessera::checkpoint {

class File {
 public:
  File() = default;
  ~File();
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  // Opens a regular file for reading. A missing file, a FIFO, a device, a directory, and a
  // symbolic link unless `links` is kFollow, throw CheckpointError naming the file: files
  // inside a checkpoint are never links (a checkpoint does not read outside its step
  // directory); safetensors weights the user names may be.
  static File openRead(const std::string& path, LinkPolicy links = LinkPolicy::kRefuse);
  // Creates a new file for writing (mode 0644), replacing whatever entry is at `path`
  // without following a link planted there (createFreshFile).
  static File openWrite(const std::string& path);


  // Writes all bytes at the current position (retries short writes and EINTR).
  void writeAll(const void* data, size_t bytes);
  // Reads exactly `bytes` at `offset`; a file that ends earlier throws CheckpointError
  // ("truncated"), naming `what` (e.g. the tensor being read).
  void readAt(void* data, size_t bytes, int64_t offset, const std::string& what = "") const;
  int64_t size() const;
  // fsync(2); throws on failure (EIO here means the data may not be on disk).
  void sync();
  // Starts the disk writing bytes [offset, offset + bytes) without waiting for it
  // (sync_file_range WRITE), so that the final sync() finds most of the data already on
  // its way. Best effort: a filesystem without it just leaves everything to sync().
  void startWriteback(int64_t offset, int64_t bytes);
  // Drops the file's pages from the page cache (benchmarks; best effort).
  void dropCache();
  // Closes, reporting close(2) errors (NFS reports write errors here).
  void close();

 private:
  File(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
};

// fsyncs a directory, so that entries created, renamed or removed in it are durable.
void syncDirectory(const std::string& dir);
// Writes `content` to path + ".tmp", fsyncs it, renames it over `path` and (unless
// syncParent is false) fsyncs the directory: readers see the old or the new content,
// never a mix.
void writeFileAtomic(const std::string& path, const std::string& content, bool syncParent = true);
// Reads a whole file of at most maxBytes; CheckpointError when missing or larger.
std::string readFileBounded(const std::string& path, int64_t maxBytes, LinkPolicy links = LinkPolicy::kRefuse);
bool pathExists(const std::string& path);
// rename(2), throwing naming both paths.
void renamePath(const std::string& from, const std::string& to);

}  // namespace tessera::checkpoint
