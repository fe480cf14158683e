// Consolidated safetensors export: offline from a checkpoint directory (no distributed
// job, any saved world size) and online at the end of a run (rank 0 writes, gathering
// one tensor at a time over the CPU communicator).
//
// Names: the tensors under a prefix ("ema/decoder_ema/", "decoder/") with the prefix
// stripped, i.e. the user's module names ("layers.0.weight"). Which prefix a name stands
// for is the checkpoint's to say: its component table's export names (metadata.h). Memory: the offline export
// streams each tensor from its chunks one checksum block (1 MiB by default) at a time, so its peak
// is about one block plus the process, whatever the model size; the online export holds
// one full tensor at a time on rank 0.
// Splitting: with maxShardBytes, tensors go, in order, into files of at most that many
// data bytes (a larger tensor gets a file of its own) named
// <base>-00001-of-0000K.safetensors, plus <base>.safetensors.index.json in Hugging Face's
// format {"metadata": {"total_size": N}, "weight_map": {name: file}}; when everything
// fits in one file it is written as <base>.safetensors with no index (as HF does).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/format.h"
#include "checkpoint/metadata.h"
#include "checkpoint/state.h"

namespace tessera::distributed {
class Communicator;
}

namespace tessera::checkpoint {

struct ExportOptions {
  // What to export: an export name the checkpoint records ("decoder", "decoder_ema",
  // "decoder_ema_0.999"), a component's key, or a raw prefix ending in '/'. See exportPrefix.
  std::string what;
  // Cast floating-point tensors to this dtype (integer and bool tensors are kept).
  std::optional<at::ScalarType> dtype;
  // 0: one file at `out`. Otherwise `out` is a directory of shards (see above).
  int64_t maxShardBytes = 0;
  std::string shardBaseName = "model";
  // Extra __metadata__ entries ("format": "pt" is always there).
  std::map<std::string, std::string> metadata;
  bool verify = true;  // offline: check checksums while reading
};

struct ExportResult {
  std::string prefix;               // the tensor-name prefix exported
  std::vector<std::string> files;   // safetensors files written
  std::string indexFile;            // "" when not split
  int64_t tensors = 0;
  int64_t totalBytes = 0;           // data bytes written (after casting)
  int64_t largestTensorBytes = 0;   // as written
  double seconds = 0;
};

// Maps `what` to a tensor-name prefix: a raw prefix ending in '/' is used as is; an export
// name (e.g. "decoder_ema_0.999" -> "ema/decoder_ema/") is looked up in `exportNames`;
// anything else names a component's key ("decoder" -> "decoder/"). UsageError when
// `what` is empty.
std::string exportPrefix(const std::string& what, const std::map<std::string, std::string>& exportNames);
// exportPrefix with a checkpoint's export names (`exportNames`, or those it records:
// CheckpointMetadata::exportNames); throws CheckpointError when no tensor has the prefix,
// listing the names that would work.
std::string resolveExportPrefix(const CheckpointMetadata& metadata, const std::string& what);
std::string resolveExportPrefix(const CheckpointMetadata& metadata, const std::string& what,
                                const std::map<std::string, std::string>& exportNames);

// Offline export of checkpoint directory `checkpointDir` to `out` (options.what resolved
// with the export names the checkpoint records).
ExportResult exportCheckpoint(const std::string& checkpointDir, const std::string& out, const ExportOptions& options);

// Online export, collective over `comm` (the CPU/gloo group; nullptr: one process): the
// entries under exportPrefix(options.what, exportNames) (stripped in the file), in order.
// Every rank passes the same entries; rank 0 writes. Errors on rank 0 are raised on every
// rank; what names nothing is an error listing what can be exported.
ExportResult exportOnline(const std::vector<StateEntry>& entries, const std::map<std::string, std::string>& exportNames,
                          distributed::Communicator* comm, const std::string& out, const ExportOptions& options);
// The same for a map of Stateful components (checkpoint/state.h), e.g. {{"ema", ema}} and
// options.what "decoder_ema": their export names (Stateful::exportNames).
ExportResult exportOnline(const StateMap& states, distributed::Communicator* comm, const std::string& out,
                          const ExportOptions& options);

// "2GB" (10^9, as Hugging Face), "500MiB" (2^20), "123" bytes; UsageError otherwise.
int64_t parseByteSize(const std::string& text);
// sharding::parseFloatDtype for the --dtype argument: UsageError for an unknown name.
at::ScalarType parseExportDtype(const std::string& text);

}  // namespace tessera::checkpoint
