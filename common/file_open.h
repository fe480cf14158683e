// Opening files named by users or found in directories someone else may have written
// (configs, datasets, checkpoints, run directories): one place that refuses what would
// hang, read forever or write outside the run.
//
// Reads refuse anything but a regular file: open() of a FIFO blocks until a writer comes,
// and /dev/zero or /dev/urandom read until memory runs out. Writes never go through a
// symbolic link or into a special file planted at the name: a new file is created with
// O_EXCL | O_NOFOLLOW after removing whatever entry was there, and appends refuse a link.
#pragma once

#include <cstdint>
#include <string>

namespace tessera {

// Whether the last component of a path read may be a symbolic link. Directories the user
// names (a config, a dataset, safetensors weights in a model cache) may be links; files
// inside a checkpoint step directory may not (a checkpoint never reads outside itself).
enum class LinkPolicy { kFollow, kRefuse };

// Opens `path` read-only and returns the descriptor (O_CLOEXEC). Returns -1 with errno ENOENT
// when nothing is at `path`, so that callers choose their own error for a missing file;
// throws tessera::Error naming `path` for anything that is not a regular file (a FIFO, a
// device, a directory, a link under LinkPolicy::kRefuse) and for other open() failures.
int openRegularForRead(const std::string& path, LinkPolicy links);

// Creates `path` as a new, empty regular file (mode 0644) open for writing. An entry already
// at `path` is removed first (a link is removed, not followed; a directory is refused), and
// the file is created with O_EXCL | O_NOFOLLOW, so nothing planted at the name is written
// through. Throws tessera::Error naming `path`.
int createFreshFile(const std::string& path);

// Opens `path` for appending, creating it when missing. Refuses a link or anything but a
// regular file at `path`. Throws tessera::Error naming `path`.
int openForAppend(const std::string& path);

// For an error about a path the user gave: "" when it is absolute, else the directory it
// was resolved against (" (a relative path: resolved against the working directory
// /home/u)"), so that a config run from another directory says why its file is missing.
std::string relativePathNote(const std::string& path);

// Reads the whole of a regular file of at most `maxBytes`. Throws tessera::Error naming
// `path` when it is missing, not a regular file, larger than `maxBytes`, or unreadable.
std::string readRegularFile(const std::string& path, int64_t maxBytes, LinkPolicy links = LinkPolicy::kFollow);

// Checks that `path` may be replaced by a rename: not empty, and nothing but a regular file
// (or a link, which a rename replaces without following) is there. Refuses a directory, a
// FIFO or a device (--out /dev/full must not turn the device into a file). Throws
// tessera::Error naming `path`.
void checkReplaceable(const std::string& path);

// Writes `content` to a fresh temporary next to `path` and renames it over `path`: readers
// see the old or the new content, and a link at `path` is replaced, not followed. No fsync
// (for run outputs such as config.resolved.yaml and loss.svg; checkpoints use their own
// durable version). Throws tessera::Error naming the file.
void replaceFile(const std::string& path, const std::string& content);

// Writes all of `bytes` to `fd` (retries short writes and EINTR); throws naming `path`.
void writeAllTo(int fd, const void* data, size_t bytes, const std::string& path);

// strerror(err) with the number, for messages: "No such file or directory (errno 2)".
std::string errnoText(int err);

}  // namespace tessera
