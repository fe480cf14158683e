// One rank's part of a checkpoint step: staging, rank_R.bin, the merge (see rank_files.h).
#include "checkpoint/rank_files.h"

#include <algorithm>
#include <filesystem>
#include <future>

#include "checkpoint/file_io.h"
#include "checkpoint/format.h"
#include "checkpoint/staging_buffers.h"
#include "common/errors.h"

namespace tessera::checkpoint {

namespace fs = std::filesystem;

namespace {

// How much a writer writes before it asks the disk to start on it.
constexpr int64_t kWritebackBytes = int64_t{8} << 20;
// A save hands its file to the disk in segments of this size (the write pipeline).
constexpr int64_t kPipelineBytes = int64_t{16} << 20;

}  // namespace

std::vector<RankRows> rankRowsOf(const std::vector<StateEntry>& entries, int rank, bool copy, StagingBuffers& staging,
                                 int64_t& bytes) {
  std::vector<RankRows> out;
  out.reserve(entries.size());
  for (const auto& e : entries) {
    RankRows s;
    s.head.name = e.name;
    s.head.dtype = e.spec.dtype();
    s.head.shape = e.spec.globalShape();
    s.head.placement = e.spec.placement();
    const bool replicated = e.spec.placement() == dtensor::Placement::kReplicate;
    if (!replicated || rank == 0) {
      std::tie(s.rowBegin, s.rowEnd) = e.spec.localRowRange();
      if (s.rowEnd > s.rowBegin) {
        const int64_t bufferRows = replicated ? e.spec.globalRows() : e.spec.chunkRows();
        at::Tensor rows = e.local.reshape({bufferRows, e.spec.rowNumel()}).narrow(0, 0, s.rowEnd - s.rowBegin);
        if (copy || !rows.device().is_cpu()) {
          s.rows = staging.bufferFor(out.size(), rows);
          s.rows.copy_(rows);
        } else {
          s.rows = rows.contiguous();
        }
        bytes += s.rows.numel() * static_cast<int64_t>(s.rows.element_size());
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

StateSize stateSizeOf(const std::vector<StateEntry>& entries) {
  StateSize size;
  for (const auto& e : entries) {
    size.bytes += e.spec.globalNumel() * dtypeBytes(e.spec.dtype());  // throws for dtypes the format cannot hold
    const int64_t rows = e.spec.globalRows(), chunkRows = e.spec.chunkRows();  // both 0 for an empty tensor
    const bool replicated = e.spec.placement() == dtensor::Placement::kReplicate;
    if (rows > 0) size.chunks += replicated ? 1 : (rows + chunkRows - 1) / chunkRows;
  }
  return size;
}

RankIndex writeRankData(const std::string& dir, int rank, int world, int64_t step, int64_t blockBytes,
                        const std::string& rankState, const std::vector<RankRows>& rows, bool durable) {
  RankIndex index;
  index.rank = rank;
  index.worldSize = world;
  index.step = step;
  index.blockBytes = blockBytes;
  index.file.name = rankDataFile(rank);
  index.rankState = rankState;
  File f = File::openWrite((fs::path(dir) / index.file.name).string());
  int64_t offset = 0, writebackFrom = 0;
  // Pipelined (pipelinedChecksums()): the write of one segment (kPipelineBytes of whole
  // blocks) runs on a thread of its own while this one checksums the next, so a save
  // takes about the longer of hashing and writing, not their sum. Else inline, block by
  // block, each hashed while it is in the cache. Writes stay sequential and in order (one
  // in flight); every kWritebackBytes written, the disk is started on them, so the final
  // fsync finds most of the file on its way.
  const bool pipelined = pipelinedChecksums();
  const int64_t segmentBytes = pipelined ? kPipelineBytes : blockBytes;
  std::future<void> inFlight;
  auto writeSegment = [&](const uint8_t* data, size_t n, int64_t end) {
    auto write = [&f, &writebackFrom, durable, data, n, end] {
      f.writeAll(data, n);
      if (durable && end - writebackFrom >= kWritebackBytes) {
        f.startWriteback(writebackFrom, end - writebackFrom);
        writebackFrom = end;
      }
    };
    if (inFlight.valid()) inFlight.get();  // rethrows the previous write's error
    if (pipelined) {
      inFlight = std::async(std::launch::async, write);
    } else {
      write();
    }
  };
  for (const auto& s : rows) {
    TensorInfo t = s.head;
    if (s.rowEnd > s.rowBegin) {
      ChunkInfo c;
      c.rank = rank;
      c.file = index.file.name;
      c.offset = offset;
      c.length = (s.rowEnd - s.rowBegin) * t.rowBytes();
      c.rowBegin = s.rowBegin;
      c.rowEnd = s.rowEnd;
      const auto* data = static_cast<const uint8_t*>(c.length > 0 ? s.rows.data_ptr() : nullptr);
      int64_t segmentBegin = 0;
      for (int64_t b = 0; b < c.length; b += blockBytes) {
        const int64_t n = std::min(blockBytes, c.length - b);
        c.checksums.push_back(checksum(data + b, static_cast<size_t>(n)));
        if (b + n - segmentBegin >= segmentBytes || b + n == c.length) {
          writeSegment(data + segmentBegin, static_cast<size_t>(b + n - segmentBegin), offset + b + n);
          segmentBegin = b + n;
        }
      }
      offset += c.length;
      t.chunks.push_back(std::move(c));
    }
    index.tensors.push_back(std::move(t));
  }
  if (inFlight.valid()) inFlight.get();
  index.file.bytes = offset;
  if (durable) f.sync();
  f.close();
  return index;
}

CheckpointMetadata mergeRankIndexes(const std::vector<RankIndex>& indexes, const StepRecord& record) {
  const int64_t step = record.step;
  TESSERA_CHECK(!indexes.empty(), "checkpoint step ", step, ": no rank's chunk table to merge");
  CheckpointMetadata md;
  md.step = step;
  md.worldSize = record.world;
  md.strategy = record.strategy;
  md.blockBytes = record.blockBytes;
  md.components = record.components;
  const auto& first = indexes[0].tensors;
  for (const auto& idx : indexes) {
    md.files.push_back(idx.file);
    md.rankStates.push_back(idx.rankState);
    TESSERA_CHECK(idx.tensors.size() == first.size(), "checkpoint step ", step, ": rank ", idx.rank, " saved ",
                  idx.tensors.size(), " tensors, rank 0 saved ", first.size(), " (every rank must save the same entries)");
  }
  for (size_t i = 0; i < first.size(); ++i) {
    TensorInfo t = first[i];
    t.chunks.clear();
    for (const auto& idx : indexes) {
      const TensorInfo& o = idx.tensors[i];
      TESSERA_CHECK(o.name == t.name && o.dtype == t.dtype && o.shape == t.shape && o.placement == t.placement,
                    "checkpoint step ", step, ": entry ", i, " is '", o.name, "' ", dtypeName(o.dtype), " ",
                    at::IntArrayRef(o.shape), " on rank ", idx.rank, " but '", t.name, "' ", dtypeName(t.dtype), " ",
                    at::IntArrayRef(t.shape), " on rank 0 (every rank must save the same entries, in the same order)");
      for (const auto& c : o.chunks) t.chunks.push_back(c);
    }
    md.tensors.push_back(std::move(t));
  }
  return md;
}

void writeTrainerState(const std::string& dir, const std::string& trainerState, CheckpointMetadata& md,
                       bool durable) {
  File f = File::openWrite((fs::path(dir) / kTrainerStateFile).string());
  f.writeAll(trainerState.data(), trainerState.size());
  if (durable) f.sync();
  f.close();
  md.trainerState = {kTrainerStateFile, static_cast<int64_t>(trainerState.size())};
  md.trainerStateChecksum = checksum(trainerState.data(), trainerState.size());
}

std::string metadataText(const CheckpointMetadata& md) {
  std::string text = toJson(md);
  parseMetadata(text, strCat("merged metadata of step ", md.step));
  return text;
}

void writeMetadataFile(const std::string& dir, const std::string& text, bool durable) {
  File f = File::openWrite((fs::path(dir) / kMetadataFile).string());
  f.writeAll(text.data(), text.size());
  if (durable) f.sync();
  f.close();
  if (durable) syncDirectory(dir);
}

}  // namespace tessera::checkpoint
