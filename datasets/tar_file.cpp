// The tar reader and writer of WebDataset shards (see tar_file.h).
#include "datasets/tar_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/errors.h"
#include "common/file_open.h"

namespace tessera::datasets {
namespace {

constexpr int64_t kBlock = 512;
constexpr int64_t kMaxExtendedHeader = int64_t{1} << 20;  // a pax header or GNU long name above 1 MiB is refused
constexpr size_t kMaxName = 4096;

int64_t roundUpToBlock(int64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

// A local shard file, read with pread (no shared file position: safe from several threads).
class LocalShard : public ShardSource {
 public:
  explicit LocalShard(std::string path) : path_(std::move(path)) {
    fd_ = openRegularForRead(path_, LinkPolicy::kFollow);
    if (fd_ < 0) throw Error(strCat("tar file ", quote(path_), ": no such file"));
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      const int err = errno;
      ::close(fd_);
      throw Error(strCat("tar file ", quote(path_), ": ", errnoText(err)));
    }
    size_ = static_cast<int64_t>(st.st_size);
  }
  ~LocalShard() override { ::close(fd_); }
  LocalShard(const LocalShard&) = delete;
  LocalShard& operator=(const LocalShard&) = delete;

  const std::string& name() const override { return path_; }
  int64_t size() const override { return size_; }
  bool readAt(int64_t offset, char* out, int64_t size) const override {
    int64_t done = 0;
    while (done < size) {
      const ssize_t n = ::pread(fd_, out + done, static_cast<size_t>(size - done), static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw Error(strCat("tar file ", quote(path_), ": read at byte ", offset + done, " failed: ", errnoText(errno)));
      if (n == 0) return false;
      done += n;
    }
    return true;
  }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
};

// A numeric header field: octal ASCII (space or NUL terminated), or GNU's base-256 (the
// first byte's top bit set) for sizes above 8 GiB. -1 when it is neither.
int64_t numericField(const char* field, size_t width) {
  const auto* b = reinterpret_cast<const unsigned char*>(field);
  if (b[0] & 0x80) {
    if (b[0] != 0x80) return -1;  // negative or beyond 63 bits
    int64_t v = 0;
    for (size_t i = 1; i < width; ++i) {
      if (v > (INT64_MAX >> 8)) return -1;
      v = (v << 8) | b[i];
    }
    return v;
  }
  size_t i = 0;
  while (i < width && field[i] == ' ') ++i;
  int64_t v = 0;
  bool digits = false;
  for (; i < width && field[i] >= '0' && field[i] <= '7'; ++i) {
    if (v > (INT64_MAX >> 3)) return -1;
    v = v * 8 + (field[i] - '0');
    digits = true;
  }
  for (; i < width; ++i) {
    if (field[i] != ' ' && field[i] != '\0') return -1;
  }
  return digits ? v : -1;
}

// A NUL-terminated (or full-width) string field.
std::string stringField(const char* field, size_t width) { return std::string(field, strnlen(field, width)); }

bool isZeroBlock(const char* block) {
  return std::all_of(block, block + kBlock, [](char c) { return c == '\0'; });
}

// The records of a pax extended header ("<length> <key>=<value>\n") that matter here.
struct PaxRecords {
  std::string path;
  int64_t size = -1;  // -1: none (the header's own size field holds it)
};

PaxRecords paxRecords(const std::string& records, const std::string& path, int64_t at) {
  PaxRecords found;
  size_t pos = 0;
  while (pos < records.size()) {
    const size_t space = records.find(' ', pos);
    // At most 7 digits: an extended header is at most 1 MiB.
    TESSERA_CHECK(space != std::string::npos && space > pos && space - pos <= 7, "tar file ", quote(path),
                  ": malformed pax header at byte ", at);
    int64_t length = 0;
    for (size_t i = pos; i < space; ++i) {
      TESSERA_CHECK(records[i] >= '0' && records[i] <= '9', "tar file ", quote(path), ": malformed pax header at byte ", at);
      length = length * 10 + (records[i] - '0');
    }
    TESSERA_CHECK(length > static_cast<int64_t>(space - pos) + 1 &&
                      pos + static_cast<size_t>(length) <= records.size() && records[pos + length - 1] == '\n',
                  "tar file ", quote(path), ": malformed pax header at byte ", at);
    const std::string record = records.substr(space + 1, pos + static_cast<size_t>(length) - space - 2);
    if (record.rfind("path=", 0) == 0) found.path = record.substr(5);
    if (record.rfind("size=", 0) == 0) {
      const std::string digits = record.substr(5);
      TESSERA_CHECK(!digits.empty() && digits.size() <= 18 && digits.find_first_not_of("0123456789") == std::string::npos,
                    "tar file ", quote(path), ": pax header at byte ", at, " has a size that is not a number");
      found.size = std::stoll(digits);
    }
    pos += static_cast<size_t>(length);
  }
  return found;
}

}  // namespace

std::unique_ptr<ShardSource> openShard(const std::string& path) { return std::make_unique<LocalShard>(path); }

TarReader::TarReader(std::unique_ptr<ShardSource> source)
    : source_(std::move(source)), path_(source_->name()), fileSize_(source_->size()) {}

bool TarReader::next(TarMember& member) {
  std::string longName;  // from a GNU 'L' or pax 'x' header, for the member that follows
  int64_t paxSize = -1;  // from a pax 'x' header: the size of the member that follows
  int64_t firstHeader = cursor_;
  char block[kBlock];
  while (true) {
    const int64_t at = cursor_;
    // Every writer ends an archive with zero blocks: a file that ends at a member's boundary
    // without them was cut short there (a copy interrupted at a block boundary).
    TESSERA_CHECK(at < fileSize_, "tar file ", quote(path_), ": truncated: the file ends at byte ", fileSize_,
                  " without the blocks that end an archive (cut short at a member's boundary)");
    TESSERA_CHECK(source_->readAt(at, block, kBlock), "tar file ", quote(path_), ": truncated: the file ends at byte ",
                  fileSize_, " inside the header at byte ", at);
    if (isZeroBlock(block)) return false;
    unsigned sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      sum += (i >= 148 && i < 156) ? ' ' : static_cast<unsigned char>(block[i]);
    }
    const int64_t stored = numericField(block + 148, 8);
    TESSERA_CHECK(stored == static_cast<int64_t>(sum), "tar file ", quote(path_), ": the header at byte ", at,
                  " is damaged (checksum ", stored, ", its bytes sum to ", sum, "); not a tar file, or corrupt there");
    const char type = block[156];
    int64_t size = numericField(block + 124, 12);
    if (paxSize >= 0 && type != 'x' && type != 'L') size = paxSize;  // pax overrides the header's field
    TESSERA_CHECK(size >= 0, "tar file ", quote(path_), ": the header at byte ", at, " has no valid size");
    const int64_t dataAt = at + kBlock;
    TESSERA_CHECK(size <= fileSize_ - dataAt, "tar file ", quote(path_), ": truncated: the member at byte ", at, " holds ",
                  size, " bytes, the file ends ", fileSize_ - dataAt, " bytes after its header");
    cursor_ = dataAt + roundUpToBlock(size);
    if (type == 'L' || type == 'x') {
      TESSERA_CHECK(size <= kMaxExtendedHeader, "tar file ", quote(path_), ": the extended header at byte ", at, " holds ",
                    size, " bytes");
      std::string data(static_cast<size_t>(size), '\0');
      TESSERA_CHECK(source_->readAt(dataAt, data.data(), size), "tar file ", quote(path_), ": truncated at byte ", dataAt);
      std::string name;
      if (type == 'L') {
        name = data.c_str();
      } else {
        PaxRecords pax = paxRecords(data, path_, at);
        name = std::move(pax.path);
        paxSize = pax.size;
      }
      if (!name.empty()) longName = std::move(name);
      continue;
    }
    if (type != '0' && type != '\0' && type != '7') {  // a directory, link, device or global header
      longName.clear();
      paxSize = -1;
      firstHeader = cursor_;
      continue;
    }
    std::string name = longName;
    if (name.empty()) {
      name = stringField(block, 100);
      // POSIX ustar ("ustar\0") keeps a prefix; old GNU headers ("ustar  ") hold times there.
      const bool posix = std::memcmp(block + 257, "ustar\0", 6) == 0;
      const std::string prefix = posix ? stringField(block + 345, 155) : std::string();
      if (!prefix.empty()) name = prefix + "/" + name;
    }
    TESSERA_CHECK(!name.empty() && name.size() <= kMaxName, "tar file ", quote(path_), ": the member at byte ", at,
                  " has ", name.empty() ? "no name" : "a name longer than 4096 bytes");
    member.name = std::move(name);
    member.headerOffset = firstHeader;
    member.offset = dataAt;
    member.size = size;
    return true;
  }
}

std::string TarReader::readData(const TarMember& member, int64_t maxBytes) const {
  TESSERA_CHECK(member.size <= maxBytes, "tar file ", quote(path_), ": member ", quote(member.name), " at byte ",
                member.headerOffset, " holds ", member.size, " bytes, more than the ", maxBytes, " allowed");
  std::string data(static_cast<size_t>(member.size), '\0');
  TESSERA_CHECK(source_->readAt(member.offset, data.data(), member.size), "tar file ", quote(path_),
                ": truncated inside member ", quote(member.name), " at byte ", member.headerOffset);
  return data;
}

std::string readShardRange(const std::string& path, int64_t offset, int64_t size) {
  const std::unique_ptr<ShardSource> source = openShard(path);
  std::string data(static_cast<size_t>(size), '\0');
  TESSERA_CHECK(source->readAt(offset, data.data(), size), "tar file ", quote(path), ": ends before byte ", offset + size,
                " (it was cut short after it was indexed)");
  return data;
}

TarWriter::TarWriter(std::string path) : path_(std::move(path)), temporary_(path_ + ".partial") {
  checkReplaceable(path_);
  fd_ = createFreshFile(temporary_);
}

TarWriter::~TarWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(temporary_.c_str());
  }
}

void TarWriter::write(const void* data, size_t bytes) {
  writeAllTo(fd_, data, bytes, temporary_);
  written_ += static_cast<int64_t>(bytes);
}

void TarWriter::add(const std::string& name, const std::string& data) {
  TESSERA_CHECK(fd_ >= 0, "tar file ", quote(path_), ": add after finish");
  std::string base = name, prefix;
  if (base.size() > 100) {  // ustar: split at a '/' into prefix (<= 155) and name (<= 100)
    const size_t slash = name.find('/', name.size() > 101 ? name.size() - 101 : 0);
    TESSERA_CHECK(slash != std::string::npos && slash <= 155 && name.size() - slash - 1 <= 100 && slash > 0,
                  "tar file ", quote(path_), ": member name ", quote(name), " does not fit a ustar header");
    prefix = name.substr(0, slash);
    base = name.substr(slash + 1);
  }
  TESSERA_CHECK(!base.empty() && name.find('\0') == std::string::npos, "tar file ", quote(path_), ": member name ", quote(name),
                " is not one");
  char header[kBlock] = {};
  std::memcpy(header, base.data(), base.size());
  std::snprintf(header + 100, 8, "%07o", 0644);
  std::snprintf(header + 108, 8, "%07o", 0);
  std::snprintf(header + 116, 8, "%07o", 0);
  TESSERA_CHECK(data.size() < (size_t{1} << 33), "tar file ", quote(path_), ": member ", quote(name), " of ", data.size(),
                " bytes is above ustar's 8 GiB");
  std::snprintf(header + 124, 12, "%011llo", static_cast<unsigned long long>(data.size()));
  std::snprintf(header + 136, 12, "%011o", 0);
  header[156] = '0';
  std::memcpy(header + 257, "ustar", 6);  // "ustar\0" then version "00"
  header[263] = '0';
  header[264] = '0';
  std::memcpy(header + 345, prefix.data(), prefix.size());
  std::memset(header + 148, ' ', 8);
  unsigned sum = 0;
  for (char c : header) sum += static_cast<unsigned char>(c);
  std::snprintf(header + 148, 8, "%06o", sum);  // six digits, NUL, then the space already there
  write(header, sizeof header);
  write(data.data(), data.size());
  const int64_t pad = roundUpToBlock(static_cast<int64_t>(data.size())) - static_cast<int64_t>(data.size());
  const char zeros[kBlock] = {};
  write(zeros, static_cast<size_t>(pad));
}

int64_t TarWriter::finish() {
  TESSERA_CHECK(fd_ >= 0, "tar file ", quote(path_), ": finished twice");
  const char zeros[2 * kBlock] = {};
  write(zeros, sizeof zeros);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(temporary_.c_str());
    throw Error(strCat("tar file ", quote(temporary_), ": close failed: ", errnoText(err)));
  }
  if (::rename(temporary_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(temporary_.c_str());
    throw Error(strCat("cannot rename ", quote(temporary_), " to ", quote(path_), ": ", errnoText(err)));
  }
  return written_;
}

}  // namespace tessera::datasets
