// The checkpoint's metadata.json and the per-rank index files it is merged from.
//
// A checkpoint directory step_XXXXXXXX/ holds:
//   rank_0000R.bin      one per saving rank: the real (unpadded) rows of every sharded
//                       tensor this rank held, back to back, raw little-endian; rank 0's
//                       file also holds the replicated tensors.
//   trainer_state.json  the caller's trainer state (a JSON object).
//   metadata.json       written last: format version, step, world size, strategy, every
//                       tensor's dtype, global shape and placement, and its chunks; since
//                       format version 2, metadata_checksum: XXH3 of the file's compact
//                       JSON without that key, so a damaged or edited metadata.json (the
//                       one file no block checksum covers) is named as such; since version
//                       3, the component table (ComponentRecord), which replaces version
//                       1 and 2's flat export "aliases".
// A chunk is one rank's rows [row_begin, row_end) of one tensor: (file, byte offset,
// length, rows, checksums). Checksums are XXH3-64 of consecutive blocks of block_bytes
// bytes of the chunk (the last block shorter), so a reader that needs part of a chunk
// (resharding) verifies only the blocks it touches instead of reading the whole chunk.
// The chunks of a tensor cover its rows exactly once, in order.
//
// parseMetadata / parseRankIndex / parseTrainerState accept arbitrary bytes: everything
// is validated (types, ranges, overflow, chunk coverage, file names, offsets within the
// recorded file sizes) and any problem throws CheckpointError naming `source`.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/shard_spec.h"

namespace tessera::checkpoint {

constexpr int kFormatVersion = 3;        // written
constexpr int kOldestFormatVersion = 1;  // still read (no metadata_checksum)
constexpr const char* kFormatName = "tessera-checkpoint";
constexpr const char* kMetadataFile = "metadata.json";
constexpr const char* kTrainerStateFile = "trainer_state.json";
// Readers refuse JSON documents larger than this (the Checkpointer keeps metadata.json
// under CheckpointOptions::maxMetadataBytes, 128 MiB by default).
constexpr int64_t kMaxJsonBytes = int64_t{256} << 20;

struct ChunkInfo {
  int rank = 0;             // the saving rank that wrote it
  std::string file;         // e.g. "rank_00001.bin", relative to the checkpoint directory
  int64_t offset = 0;       // byte offset in the file
  int64_t length = 0;       // bytes = (rowEnd - rowBegin) * row bytes
  int64_t rowBegin = 0;     // global rows [rowBegin, rowEnd)
  int64_t rowEnd = 0;
  std::vector<uint64_t> checksums;  // one per block of the chunk
};

struct TensorInfo {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;  // global shape ([] for a 0-d tensor)
  dtensor::Placement placement = dtensor::Placement::kShard0;
  std::vector<ChunkInfo> chunks;

  int64_t rows() const { return shape.empty() ? 1 : shape[0]; }  // a 0-d tensor is one row
  int64_t rowElements() const;
  int64_t rowBytes() const;
  int64_t numel() const;
  int64_t bytes() const;
};

struct FileInfo {
  std::string name;
  int64_t bytes = 0;
};

// One Stateful component as a checkpoint records it (format 3's "components"), written from
// the component itself (dtensor::Stateful: its kind, parts and export names) so that tools
// without the code that wrote it (tessera-ckpt info, tessera-export) can say what each
// tensor prefix holds and export it by name. Prefixes are whole tensor-name prefixes
// ("<key>/..."), each ending in '/' and holding tensors.
struct ComponentRecord {
  std::string key;                             // its tensors are named "<key>/..."
  std::string kind;                            // the component's word for itself
  std::string of;                              // the key of the component it serves; "" for none
  std::map<std::string, std::string> parts;    // named groups of its tensors -> prefix
  std::map<std::string, std::string> exports;  // export names -> prefix

  std::string prefix() const { return key + "/"; }
};

struct CheckpointMetadata {
  int version = kFormatVersion;
  int64_t step = 0;
  int worldSize = 1;        // ranks that saved it
  std::string strategy;     // e.g. "zero3", as given by the caller
  int64_t blockBytes = 0;   // checksum block size
  FileInfo trainerState;    // trainer_state.json and its size
  uint64_t trainerStateChecksum = 0;
  std::vector<std::string> rankStates;          // one JSON object (text) per saved rank
  std::vector<ComponentRecord> components;      // format 3 (empty in older checkpoints)
  std::map<std::string, std::string> aliases;   // formats 1 and 2: export name -> tensor name prefix
  std::vector<FileInfo> files;                  // the data files and their sizes
  std::vector<TensorInfo> tensors;              // in the order they were saved

  const TensorInfo* find(const std::string& name) const;  // nullptr when absent
  int64_t tensorBytes() const;                            // sum of all tensors' bytes
  bool holdsPrefix(const std::string& prefix) const;      // some tensor's name starts with it
  // Export names -> prefixes: the components' exports (format 3) or the aliases (1, 2).
  std::map<std::string, std::string> exportNames() const;
};

// Export names -> prefixes of a component table; tessera::Error when two components
// export one name to different prefixes.
std::map<std::string, std::string> exportNamesOf(const std::vector<ComponentRecord>& components);

std::string toJson(const CheckpointMetadata& metadata);
CheckpointMetadata parseMetadata(const std::string& text, const std::string& source);
// `text` (a version 2 metadata.json) with its metadata_checksum recomputed for its
// content: what the Checkpointer writes. For tools and tests that edit a checkpoint on
// purpose; throws CheckpointError when `text` is not a JSON object.
std::string resealMetadata(const std::string& text, const std::string& source = "metadata.json");

// What one rank wrote, for rank 0 to merge into metadata.json (rank_0000R.json, deleted
// after the merge). Each tensor has at most one chunk (none when the rank owns no rows
// of it, or the tensor is replicated and this is not rank 0).
struct RankIndex {
  int rank = 0;
  int worldSize = 1;
  int64_t step = 0;
  int64_t blockBytes = 0;
  FileInfo file;
  std::string rankState = "{}";
  std::vector<TensorInfo> tensors;
};

std::string toJson(const RankIndex& index);
RankIndex parseRankIndex(const std::string& text, const std::string& source);

// Validates a trainer-state document (a JSON object) and returns it re-serialised.
std::string parseTrainerState(const std::string& text, const std::string& source);

// "rank_00003.bin", "rank_00003.json", "rank_00003.error".
std::string rankDataFile(int rank);
std::string rankIndexFile(int rank);
std::string rankErrorFile(int rank);
// "step_00000100": at least 8 digits, zero-padded.
std::string stepDirName(int64_t step);
// The step a directory name stands for, only when the name is exactly stepDirName(step):
// "step_20", "step_00000020.tmp" or "step_-0000001" are not checkpoint directories.
std::optional<int64_t> parseStepDirName(const std::string& name);

}  // namespace tessera::checkpoint
