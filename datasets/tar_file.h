// Tar files as WebDataset shards hold them: a reader that walks the member headers and
// reads a member's bytes at its offset, both through a ShardSource (a local file; the
// interface a remote store would implement), and a writer of plain ustar archives.
//
// Hand-written rather than libarchive: the streaming dataset (webdataset.h) keeps only
// (shard, offset, size) for the samples in its shuffle buffer and reads each one when a
// batch needs it, which needs each member's data offset in the file; libarchive's reading
// API is a forward stream that does not expose it. The format subset is small and checked:
// POSIX ustar and GNU headers (checksums verified, base-256 sizes), pax extended headers
// ('path', 'size') and GNU long names, the members Python's tarfile and GNU tar write.
// Interoperability with both is tested (tests/datasets/webdataset_test.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace tessera::datasets {

// One regular file in a tar archive.
struct TarMember {
  std::string name;          // its path in the archive (a pax 'path' or GNU long name when present)
  int64_t headerOffset = 0;  // the byte where its first header starts (pax or long-name header included)
  int64_t offset = 0;        // the byte where its data starts
  int64_t size = 0;          // its data's length in bytes
};

// Where a shard's bytes come from. Local files today; a remote store (HTTP range requests,
// an object store) would implement the same calls and be returned by openShard for its URLs.
class ShardSource {
 public:
  virtual ~ShardSource() = default;
  virtual const std::string& name() const = 0;  // for messages: the path or URL
  virtual int64_t size() const = 0;
  // Exactly `size` bytes from `offset` into `out`; false when the source ends first.
  // tessera::Error naming the source when the read fails.
  virtual bool readAt(int64_t offset, char* out, int64_t size) const = 0;
};

// The shard at `path`: a local regular file (a FIFO, device or directory is refused).
// tessera::Error naming it.
std::unique_ptr<ShardSource> openShard(const std::string& path);

// Reads the members of one tar file in order, by their headers only: a member's data is
// passed over (not read) unless readData() asks for it.
class TarReader {
 public:
  // Opens `path` (openShard). Throws tessera::Error naming it.
  explicit TarReader(const std::string& path) : TarReader(openShard(path)) {}
  explicit TarReader(std::unique_ptr<ShardSource> source);
  TarReader(const TarReader&) = delete;
  TarReader& operator=(const TarReader&) = delete;

  // The next regular file (directories, links and pax global headers are passed over);
  // false at the end of the archive (a zero block). Throws tessera::Error naming the file
  // and the byte offset: a header whose checksum does not match, a size that is not a
  // number, a member whose data runs past the end of the file, a file that ends inside a
  // header or without the zero blocks that end an archive (each a truncated shard).
  bool next(TarMember& member);
  // The data of the member next() returned last, at most `maxBytes` of it (tessera::Error
  // when it is larger).
  std::string readData(const TarMember& member, int64_t maxBytes) const;


 private:
  std::unique_ptr<ShardSource> source_;
  const std::string& path_;  // source_'s name
  int64_t fileSize_ = 0;
  int64_t cursor_ = 0;  // the next header's offset
};

// `size` bytes of shard `path` from byte `offset` (one member's data): an exact read, or
// tessera::Error naming the shard when it is shorter than that now.
std::string readShardRange(const std::string& path, int64_t offset, int64_t size);

// Writes a ustar archive: each member a regular file with mode 0644, owner 0 and time 0,
// so that the same contents give the same bytes. The archive is written to a temporary
// next to `path` and renamed over it by finish(): a reader never sees half of one.
class TarWriter {
 public:
  explicit TarWriter(std::string path);
  ~TarWriter();  // without finish(): the temporary is removed
  TarWriter(const TarWriter&) = delete;
  TarWriter& operator=(const TarWriter&) = delete;

  // Appends member `name` (at most 100 bytes, or 255 split at a '/' into ustar's prefix)
  // holding `data`.
  void add(const std::string& name, const std::string& data);
  // Writes the two zero blocks that end an archive and renames it into place; returns its size.
  int64_t finish();

 private:
  void write(const void* data, size_t bytes);
  std::string path_, temporary_;
  int fd_ = -1;
  int64_t written_ = 0;
};

}  // namespace tessera::datasets
