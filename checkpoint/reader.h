// Reading sharded checkpoints: an opened checkpoint (CheckpointReader), loading a new
// layout's shards from it (resharding), verification, and finding the checkpoint to
// resume from.
//
// Resharding: a rank that needs global rows [b, e) of a tensor reads, from each saved
// chunk that intersects them, only the intersecting bytes, so the same code loads a
// checkpoint saved on any number of ranks into any other (and Shard(0) <-> Replicate:
// a replicated destination needs all rows). Checksums cover blocks of block_bytes
// (1 MiB by default) of each chunk: a verified read also reads the rest of the first
// and last block it touches (at most 2 blocks extra per chunk), never whole chunks, and
// hashes each block as it arrives (while it is in the CPU's caches).
//
// Errors are CheckpointError naming the checkpoint directory, the file and the tensor:
// missing metadata, missing or truncated rank files, metadata pointing outside a file,
// checksum mismatches, a tensor missing from the checkpoint, dtype or shape mismatch
// with the destination.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/file_io.h"
#include "checkpoint/format.h"
#include "checkpoint/metadata.h"
#include "checkpoint/state.h"

namespace tessera::distributed {
class Communicator;
}

namespace tessera::checkpoint {

class CheckpointReader {
 public:
  // Reads and validates <dir>/metadata.json. A directory without it is not a checkpoint
  // (CheckpointError "... is not a complete checkpoint").
  explicit CheckpointReader(std::string dir);

  const CheckpointMetadata& metadata() const { return metadata_; }
  // The tensor's metadata; CheckpointError naming the checkpoint when absent.
  const TensorInfo& tensor(const std::string& name) const;

  // Reads global rows [rowBegin, rowEnd) of `t` into dst ((rowEnd - rowBegin) x row bytes,
  // contiguous, CPU), reading only the intersecting bytes of each chunk (plus the edges
  // of the checksum blocks touched, when verify).
  void readRows(const TensorInfo& t, int64_t rowBegin, int64_t rowEnd, void* dst, bool verify = true);
  // Streams the whole tensor in row-major order, one checksum block at a time (each
  // verified first): fn(data, bytes). Memory: one block.
  void streamTensor(const TensorInfo& t, const std::function<void(const void* data, int64_t bytes)>& fn,
                    bool verify = true);
  // The whole tensor (CPU, its saved dtype and global shape).
  at::Tensor readFull(const std::string& name, bool verify = true);
  // Reads every block of every chunk and the trainer state, checking every checksum and
  // file size. Throws at the first problem.
  void verifyAll();
  // The same for the chunks in one of its files (rank_R.bin): what a rank that holds only
  // that file can vouch for.
  void verifyFile(const std::string& name);
  // trainer_state.json, checked against its recorded size and checksum.
  std::string trainerState(bool verify = true);

  int64_t bytesRead() const { return bytesRead_; }

 private:
  const File& file(const std::string& name, const std::string& tensorName);
  // Opens every file holding a chunk of `t`, checking its size against the metadata, so
  // that a buffer sized from metadata.json is allocated only for data that is there.
  void checkFilesOf(const TensorInfo& t);
  // Reads bytes [begin, end) of chunk c into dst; when verify, checks every block it
  // touches (reading the rest of an edge block into scratch).
  void readChunkRange(const TensorInfo& t, const ChunkInfo& c, int64_t begin, int64_t end, uint8_t* dst, bool verify);
  [[noreturn]] void checksumMismatch(const TensorInfo& t, const ChunkInfo& c, int64_t block, uint64_t got) const;

  std::string dir_;
  CheckpointMetadata metadata_;
  std::map<std::string, int64_t> recordedBytes_;
  std::map<std::string, File> files_;
  int64_t bytesRead_ = 0;
};

// One difference between the state a program loads and a checkpoint's metadata: the
// entry's name and what differs ("saved with shape [64, 4], this program has [64, 16]").
struct PlanMismatch {
  std::string tensor;
  std::string problem;
};

// Plans a load before any byte is read, as DCP plans one from the destination's tensors
// and the checkpoint's metadata: each entry against `metadata` — absent (unless optional,
// or present under its formerName), saved as another dtype, or with another global shape —
// and with `strict`, the checkpoint's tensors that no entry asks for. Empty: the load fits.
// Metadata is checksummed, so a difference is a mismatch of layouts (another model shape,
// optimizer or EMA set), not damage: loads refuse it instead of falling back.
std::vector<PlanMismatch> planLoad(const CheckpointMetadata& metadata, const std::vector<StateEntry>& entries,
                                   bool strict);

// "'a' saved with shape [2], this program has [3]; 'b' not in the checkpoint" for
// messages, the first `limit` of them and a count of the rest.
std::string describeMismatches(const std::vector<PlanMismatch>& mismatches, size_t limit = 6);

// A load whose plan failed (planLoad): the checkpoint is sound, the state it was asked to
// fill has another layout. Not a CheckpointError: resume-auto does not fall back on it.
class LoadPlanError : public Error {
 public:
  LoadPlanError(std::string dir, std::vector<PlanMismatch> mismatches, const std::string& message)
      : Error(message), dir_(std::move(dir)), mismatches_(std::move(mismatches)) {}
  const std::string& dir() const { return dir_; }
  // This rank's differences (empty on a rank that learnt of another's failure).
  const std::vector<PlanMismatch>& mismatches() const { return mismatches_; }

 private:
  std::string dir_;
  std::vector<PlanMismatch> mismatches_;
};

struct LoadResult;

struct LoadOptions {
  // Verify the checksum of every block read (costs one XXH3 pass, ~10+ GB/s per core).
  bool verify = true;
  // Refuse (LoadPlanError) a checkpoint that holds tensors no entry asks for (off:
  // loading only the model, or a subset, is normal; a resume turns it on).
  bool strict = false;
  // The caller's own checks of a loaded checkpoint (its trainer state's counters, say),
  // run after the tensors load; what they throw fails the checkpoint as damage does, so
  // resumeLatest falls back to the one before. Same answer on every rank (same files).
  std::function<void(const LoadResult&)> check;
};

struct LoadResult {
  std::string dir;
  int64_t step = 0;
  int savedWorldSize = 1;
  std::string strategy;
  std::string trainerState;              // the JSON object the caller saved
  std::vector<std::string> rankStates;   // per saved rank (RNG state...): convert or refuse
                                         // when savedWorldSize differs from the new one
  int64_t bytesRead = 0;
  // Entries marked optional that the checkpoint does not have (left as they were).
  std::vector<std::string> missingOptional;
  double seconds = 0;
};

// Loads every entry's shard (entry.spec: the NEW layout, this rank) from checkpoint
// directory `dir` into entry.local in place (CPU or CUDA; padding rows zeroed). Each rank
// calls it independently; no communication.
LoadResult loadCheckpoint(const std::string& dir, const std::vector<StateEntry>& entries, const LoadOptions& options = {});

// The Stateful forms (checkpoint/state.h): every component's entries ("<key>/<name>")
// loaded in place, then each component's afterLoad() — the strategies publish the loaded
// masters, so every rank calls these (collectively for zero1/zero2's gathers). Each rank
// reads its own rows; when one fails, every rank throws (naming the lowest failing rank)
// before any afterLoad, so no rank waits in a gather the failed one never joins.
// `comm` nullptr: a single process.
LoadResult load(const std::string& dir, const StateMap& states, distributed::Communicator* comm,
                const LoadOptions& options = {});

struct CheckpointRef {
  int64_t step = 0;
  std::string dir;  // full path of step_XXXXXXXX
};

// Complete checkpoints (step_N directories holding metadata.json) under a run's
// checkpoints directory, oldest first. *.tmp directories and directories without
// metadata are skipped. A missing directory yields an empty list.
std::vector<CheckpointRef> listCheckpoints(const std::string& checkpointsDir);
// `dir` itself when it is a complete checkpoint (holds metadata.json), else the newest
// complete checkpoint in it; "" when it is neither (callers say why in their own terms).
std::string checkpointOrNewestIn(const std::string& dir);

// Refuses an output a command is about to write when it would land in checkpoint state:
// `out` (a file, or the directory of a sharded export) inside a checkpoint step directory
// or post-hoc snapshot (a directory holding metadata.json, or named step_<digits> with or
// without a suffix), or directly in a checkpoints directory (one holding `latest` or a
// checkpoint listCheckpoints finds), links followed; or the same file as one of `inputs`. Throws UsageError
// naming `option`, `out` and what it would have overwritten or polluted.
void checkOutputOutsideState(const std::string& out, const std::string& option,
                             const std::vector<std::string>& inputs = {});
// The directory `latest` names (empty when there is no `latest` file).
std::string readLatest(const std::string& checkpointsDir);

// resume: auto. Tries the complete checkpoints newest first (by step: `latest` is moved
// after the rename, so a checkpoint newer than `latest` is complete too) and loads the
// first one that every rank loads without error; a candidate that fails on any rank is
// logged with the reason and the next older one is tried. Collective over `comm`
// (nullptr: a single process). Returns nullopt when there is no checkpoint; throws
// CheckpointError listing every candidate's failure when all fail. A failed attempt
// may have overwritten some destination buffers; the next attempt rewrites all of them.
std::optional<LoadResult> resumeAuto(const std::string& checkpointsDir, const std::vector<StateEntry>& entries,
                                     distributed::Communicator* comm, const LoadOptions& options = {});

// resumeAuto for a map of Stateful components, each restored (afterLoad) once one loaded.
std::optional<LoadResult> resumeLatest(const std::string& checkpointsDir, const StateMap& states,
                                       distributed::Communicator* comm, const LoadOptions& options = {});

// Offline summary for tessera-ckpt info: the checkpoint's metadata and its sizes.
struct CheckpointSummary {
  std::string dir;
  CheckpointMetadata metadata;
  int64_t tensorBytes = 0;
  int64_t fileBytes = 0;  // data files and trainer_state.json
};
CheckpointSummary summarizeCheckpoint(const std::string& dir);

}  // namespace tessera::checkpoint
