// CheckpointReader (reader.h): one checkpoint directory's metadata, files and tensors, read
// and verified against their checksums. Apart from the loaders (reader.cpp) because it needs
// no communicator: the fuzz build compiles it with the local tier's inventory
// (fuzz/local_tier_fuzz.cpp).
#include <algorithm>
#include <filesystem>
#include <functional>
#include <optional>
#include <vector>

#include "checkpoint/format.h"
#include "checkpoint/reader.h"
#include "common/errors.h"

namespace tessera::checkpoint {

namespace fs = std::filesystem;

CheckpointReader::CheckpointReader(std::string dir) : dir_(std::move(dir)) {
  const std::string path = (fs::path(dir_) / kMetadataFile).string();
  if (!pathExists(path)) {
    throw CheckpointError(strCat("checkpoint ", dir_, " is not a complete checkpoint: it has no ", kMetadataFile));
  }
  metadata_ = parseMetadata(readFileBounded(path, kMaxJsonBytes), path);
  // A step directory holds the step it is named for: a renamed one would resume the run
  // at another step than the one it claims.
  fs::path dirPath = fs::path(dir_).lexically_normal();
  if (!dirPath.has_filename()) dirPath = dirPath.parent_path();  // "step_00000010/"
  const std::optional<int64_t> named = parseStepDirName(dirPath.filename().string());
  if (named && *named != metadata_.step) {
    throw CheckpointError(strCat("checkpoint ", dir_, " is named for step ", *named, " but ", path, " says step ",
                                 metadata_.step));
  }
  for (const auto& f : metadata_.files) recordedBytes_[f.name] = f.bytes;
}

const TensorInfo& CheckpointReader::tensor(const std::string& name) const {
  const TensorInfo* t = metadata_.find(name);
  if (t == nullptr) {
    std::string some;
    for (size_t i = 0; i < metadata_.tensors.size() && i < 5; ++i) some += (i ? ", " : "") + metadata_.tensors[i].name;
    throw CheckpointError(strCat("checkpoint ", dir_, ": tensor '", name, "' is missing (the checkpoint has ",
                                 metadata_.tensors.size(), " tensors", some.empty() ? "" : ": ", some,
                                 metadata_.tensors.size() > 5 ? ", ..." : "", ")"));
  }
  return *t;
}

const File& CheckpointReader::file(const std::string& name, const std::string& tensorName) {
  auto it = files_.find(name);
  if (it != files_.end()) return it->second;
  const std::string path = (fs::path(dir_) / name).string();
  File f;
  try {
    f = File::openRead(path);
  } catch (const CheckpointError& e) {
    throw CheckpointError(strCat("checkpoint ", dir_, ": ", e.what(), " (needed by tensor '", tensorName, "')"));
  }
  const int64_t size = f.size();
  const int64_t recorded = recordedBytes_.at(name);
  if (size != recorded) {
    throw CheckpointError(strCat("checkpoint ", dir_, ": file ", path, " is ", size, " bytes, metadata records ", recorded,
                                 size < recorded ? " (truncated)" : " (wrong size)", "; needed by tensor '", tensorName,
                                 "'"));
  }
  return files_.emplace(name, std::move(f)).first->second;
}

void CheckpointReader::checkFilesOf(const TensorInfo& t) {
  for (const auto& c : t.chunks) file(c.file, t.name);
}

void CheckpointReader::checksumMismatch(const TensorInfo& t, const ChunkInfo& c, int64_t block, uint64_t got) const {
  const int64_t b = block * metadata_.blockBytes;
  const int64_t e = std::min(c.length, b + metadata_.blockBytes);
  throw CheckpointError(strCat("checkpoint ", dir_, ": checksum mismatch in file ", (fs::path(dir_) / c.file).string(),
                               ", tensor '", t.name, "' (rows [", c.rowBegin, ", ", c.rowEnd, ") saved by rank ", c.rank,
                               ", block ", block, " = file bytes [", c.offset + b, ", ", c.offset + e, ")): expected ",
                               checksumHex(c.checksums.at(static_cast<size_t>(block))), ", got ", checksumHex(got)));
}

namespace {

// Bytes per positioned read: at most this, or one checksum block where blocks are larger
// (one block at the default block size). A verified read hashes each read right after it
// arrives, while it is still in the CPU's caches, rather than a long run from memory
// after reading all of it; measured against that, against hashing on a helper thread,
// and against one read of the whole range in docs/benchmarks.md (Checkpoints).
constexpr int64_t kReadBytes = 1 << 20;

}  // namespace

void CheckpointReader::readChunkRange(const TensorInfo& t, const ChunkInfo& c, int64_t begin, int64_t end, uint8_t* dst,
                                      bool verify) {
  if (end <= begin) return;
  const File& f = file(c.file, t.name);
  const std::string what = strCat("tensor '", t.name, "'");
  bytesRead_ += end - begin;
  if (!verify) {
    for (int64_t pos = begin; pos < end; pos += kReadBytes) {
      f.readAt(dst + (pos - begin), static_cast<size_t>(std::min(kReadBytes, end - pos)), c.offset + pos, what);
    }
    return;
  }
  const int64_t B = metadata_.blockBytes;
  const int64_t segmentBlocks = std::max<int64_t>(1, kReadBytes / B);
  int64_t block = begin / B;
  const int64_t lastBlock = (end - 1) / B;
  while (block <= lastBlock) {
    const int64_t kb = block * B;
    const int64_t ke = std::min(c.length, kb + B);
    if (kb >= begin && ke <= end) {
      // A segment of whole blocks (at most kReadBytes, or one block) goes straight into
      // dst with one read and is hashed in place.
      int64_t segEnd = block;
      while (segEnd + 1 <= lastBlock && segEnd + 1 < block + segmentBlocks &&
             std::min(c.length, (segEnd + 2) * B) <= end) {
        ++segEnd;
      }
      const int64_t se = std::min(c.length, (segEnd + 1) * B);
      uint8_t* out = dst + (kb - begin);
      f.readAt(out, static_cast<size_t>(se - kb), c.offset + kb, what);
      for (int64_t k = block; k <= segEnd; ++k) {
        const int64_t b0 = k * B - kb;
        const int64_t b1 = std::min(c.length, (k + 1) * B) - kb;
        const uint64_t got = checksum(out + b0, static_cast<size_t>(b1 - b0));
        if (got != c.checksums[static_cast<size_t>(k)]) checksumMismatch(t, c, k, got);
      }
      block = segEnd + 1;
    } else {
      // Edge block: the part asked for is read straight into dst, the rest of the block
      // into scratch (sized for that rest only), and the pieces are hashed in order.
      const int64_t from = std::max(kb, begin), to = std::min(ke, end);
      const int64_t rest = (from - kb) + (ke - to);
      std::unique_ptr<uint8_t[]> scratch(new uint8_t[static_cast<size_t>(rest)]);  // not zeroed: read over
      uint8_t* before = scratch.get();
      uint8_t* after = scratch.get() + (from - kb);
      uint8_t* wanted = dst + (from - begin);
      f.readAt(before, static_cast<size_t>(from - kb), c.offset + kb, what);
      f.readAt(wanted, static_cast<size_t>(to - from), c.offset + from, what);
      f.readAt(after, static_cast<size_t>(ke - to), c.offset + to, what);
      bytesRead_ += rest;
      const uint64_t got = checksum({{before, static_cast<size_t>(from - kb)},
                                     {wanted, static_cast<size_t>(to - from)},
                                     {after, static_cast<size_t>(ke - to)}});
      if (got != c.checksums[static_cast<size_t>(block)]) checksumMismatch(t, c, block, got);
      ++block;
    }
  }
}

void CheckpointReader::readRows(const TensorInfo& t, int64_t rowBegin, int64_t rowEnd, void* dst, bool verify) {
  TESSERA_CHECK(0 <= rowBegin && rowBegin <= rowEnd && rowEnd <= t.rows(), "CheckpointReader::readRows: rows [",
                rowBegin, ", ", rowEnd, ") of tensor '", t.name, "' with ", t.rows(), " rows");
  const int64_t rowBytes = t.rowBytes();
  auto* out = static_cast<uint8_t*>(dst);
  for (const auto& c : t.chunks) {
    const int64_t b = std::max(rowBegin, c.rowBegin);
    const int64_t e = std::min(rowEnd, c.rowEnd);
    if (e <= b) continue;
    readChunkRange(t, c, (b - c.rowBegin) * rowBytes, (e - c.rowBegin) * rowBytes, out + (b - rowBegin) * rowBytes,
                   verify);
  }
}

void CheckpointReader::streamTensor(const TensorInfo& t, const std::function<void(const void*, int64_t)>& fn,
                                    bool verify) {
  const int64_t B = metadata_.blockBytes;
  std::vector<uint8_t> buf;
  checkFilesOf(t);
  for (const auto& c : t.chunks) {
    for (int64_t off = 0; off < c.length; off += B) {
      const int64_t n = std::min(B, c.length - off);
      buf.resize(static_cast<size_t>(n));
      readChunkRange(t, c, off, off + n, buf.data(), verify);
      fn(buf.data(), n);
    }
  }
}

at::Tensor CheckpointReader::readFull(const std::string& name, bool verify) {
  const TensorInfo& t = tensor(name);
  checkFilesOf(t);  // the sizes come from metadata.json: allocate only what the files hold
  at::Tensor out = at::empty(t.shape, at::TensorOptions().dtype(t.dtype));
  if (out.numel() > 0) readRows(t, 0, t.rows(), out.data_ptr(), verify);
  return out;
}

std::string CheckpointReader::trainerState(bool verify) {
  const std::string path = (fs::path(dir_) / metadata_.trainerState.name).string();
  std::string text = readFileBounded(path, kMaxJsonBytes);
  if (verify) {
    if (static_cast<int64_t>(text.size()) != metadata_.trainerState.bytes) {
      throw CheckpointError(strCat("checkpoint ", dir_, ": file ", path, " is ", text.size(), " bytes, metadata records ",
                                   metadata_.trainerState.bytes));
    }
    const uint64_t got = checksum(text.data(), text.size());
    if (got != metadata_.trainerStateChecksum) {
      throw CheckpointError(strCat("checkpoint ", dir_, ": checksum mismatch in file ", path, ": expected ",
                                   checksumHex(metadata_.trainerStateChecksum), ", got ", checksumHex(got)));
    }
  }
  return parseTrainerState(text, path);
}

void CheckpointReader::verifyFile(const std::string& name) {
  file(name, "(file list)");
  const int64_t B = metadata_.blockBytes;
  const int64_t piece = std::max<int64_t>(1, kReadBytes / B) * B;  // whole blocks: no edge reads
  std::vector<uint8_t> buffer;
  for (const auto& t : metadata_.tensors) {
    for (const ChunkInfo& c : t.chunks) {
      if (c.file != name) continue;
      buffer.resize(static_cast<size_t>(std::min(piece, std::max<int64_t>(1, c.length))));
      for (int64_t pos = 0; pos < c.length; pos += piece) {
        readChunkRange(t, c, pos, std::min(c.length, pos + piece), buffer.data(), /*verify=*/true);
      }
    }
  }
}

void CheckpointReader::verifyAll() {
  for (const auto& f : metadata_.files) file(f.name, "(file list)");
  for (const auto& t : metadata_.tensors) streamTensor(t, [](const void*, int64_t) {}, true);
  trainerState(true);
}

}  // namespace tessera::checkpoint
