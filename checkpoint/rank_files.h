// One rank's part of a checkpoint step, shared by the persistent Checkpointer and the
// node-local tier (local_tier.h): the rows a rank writes (staged or viewed), the write of
// rank_R.bin with its checksums, and the merge of every rank's chunk table into the
// step's metadata. Each tier has its own protocol around them (checkpointer.h: hand-off
// through the shared directory; local_tier.h: through collectives).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/metadata.h"
#include "checkpoint/state.h"

namespace tessera::checkpoint {

class StagingBuffers;

// One entry's rows as this rank writes them.
struct RankRows {
  TensorInfo head;   // name, dtype, shape, placement (no chunks)
  at::Tensor rows;   // contiguous CPU real rows of this rank, undefined when none
  int64_t rowBegin = 0, rowEnd = 0;
};

// The rows `rank` writes of each entry (a replicated entry: rank 0 only), in entry order.
// Copied into `staging` when `copy` or when they are not plain CPU memory (the caller may
// then change its tensors at once); otherwise views of the entries. Adds the bytes to
// `bytes`.
std::vector<RankRows> rankRowsOf(const std::vector<StateEntry>& entries, int rank, bool copy, StagingBuffers& staging,
                                 int64_t& bytes);

// The bytes a step's entries hold and the chunks they are saved in (a sharded tensor one
// per rank holding rows, a replicated one a single chunk): what sizes its metadata.
struct StateSize {
  int64_t bytes = 0;
  int64_t chunks = 0;
};
StateSize stateSizeOf(const std::vector<StateEntry>& entries);

// Writes `rows` to <dir>/rank_R.bin (checksummed per block of `blockBytes`; fsynced when
// `durable`) and returns its chunk table. Segments are written on a thread of their own
// while the next is hashed where pipelinedChecksums() says so.
//
// `durable`: the persistent tier fsyncs every file, so a committed step survives a power
// loss. The node-local tier does not: what it guards against is another node's loss (its
// replicas are there), a process crash keeps the page cache, and a node that loses power
// loses /dev/shm anyway; the checksums catch a file cut short either way.
RankIndex writeRankData(const std::string& dir, int rank, int world, int64_t step, int64_t blockBytes,
                        const std::string& rankState, const std::vector<RankRows>& rows, bool durable = true);

// What a step records besides its chunk tables.
struct StepRecord {
  int64_t step = 0;
  int world = 1;
  int64_t blockBytes = 0;
  std::string strategy;
  std::vector<ComponentRecord> components;
};

// The step's metadata from every rank's chunk table (indexes[r] is rank r's): Error
// naming the rank when one saved other entries than rank 0.
CheckpointMetadata mergeRankIndexes(const std::vector<RankIndex>& indexes, const StepRecord& record);

// Writes <dir>/trainer_state.json (fsynced when `durable`) and records its size and
// checksum in `md`.
void writeTrainerState(const std::string& dir, const std::string& trainerState, CheckpointMetadata& md,
                       bool durable = true);
// metadata.json's text for `md`, parsed back first: whatever a loader would refuse fails
// the save instead.
std::string metadataText(const CheckpointMetadata& md);
// Writes `text` as <dir>/metadata.json (and, when `durable`, fsyncs it and the directory):
// the step is then complete in `dir`.
void writeMetadataFile(const std::string& dir, const std::string& text, bool durable = true);

}  // namespace tessera::checkpoint
