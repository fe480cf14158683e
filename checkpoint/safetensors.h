// Safetensors files (the format Hugging Face uses for weights), written and read without
// Python: streaming writer, bounds-checked reader, and strict import into shards.
//
// Format: 8-byte little-endian header length N; N bytes of JSON header, padded with
// spaces to a multiple of 8; then the data section. The header maps each tensor name to
// {"dtype": "F32"|"BF16"|..., "shape": [...], "data_offsets": [begin, end)} (offsets
// relative to the data section) and may hold "__metadata__": a string -> string map
// ({"format": "pt"} for PyTorch). Tensors are laid out back to back: the offsets cover
// the data section exactly, with no holes or overlaps. Data is raw little-endian,
// row-major.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/file_io.h"
#include "checkpoint/format.h"
#include "checkpoint/state.h"

namespace tessera::distributed {
class Communicator;
}

namespace tessera::checkpoint {

// The safetensors library refuses headers above 100 MB; so does this reader.
constexpr int64_t kMaxSafetensorsHeader = 100'000'000;
// An index lists names and file names only; 64 MiB is ~500k tensors.
constexpr int64_t kMaxIndexBytes = int64_t{64} << 20;

struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t begin = 0;  // data_offsets, relative to the data section
  int64_t end = 0;

  int64_t numel() const;
  int64_t bytes() const { return end - begin; }
};

struct SafetensorsHeader {
  int64_t headerBytes = 0;  // N
  std::vector<SafetensorsEntry> tensors;  // in data order
  std::map<std::string, std::string> metadata;

  int64_t dataOffset() const { return 8 + headerBytes; }
  int64_t dataBytes() const { return tensors.empty() ? 0 : tensors.back().end; }
  const SafetensorsEntry* find(const std::string& name) const;
};

// What a file must hold, by tensor name: its shape and dtype.
using SafetensorsLayout = std::map<std::string, std::pair<std::vector<int64_t>, at::ScalarType>>;
// What is wrong with `header` as a file of exactly the tensors of `layout` (no other
// tensor, each of its shape and dtype), "" when nothing is: checked before any data is read
// (a cache file with an extra tensor of 8 GiB is refused without reading it). Names from
// the file are quoted.
std::string safetensorsLayoutProblem(const SafetensorsHeader& header, const SafetensorsLayout& layout);

// Validates a header held in data[0, size) of a file of fileSize bytes (size may be the
// whole file or just its first 8 + N bytes). Throws CheckpointError naming `source` for
// a header length that is absurd or past the end of the file, invalid JSON, unknown
// dtypes, negative or overflowing shapes, offsets outside the data section, sizes that
// differ from shape x dtype size, overlaps or holes.
SafetensorsHeader parseSafetensorsHeader(const uint8_t* data, size_t size, int64_t fileSize, const std::string& source);

// A sharded export's index (model.safetensors.index.json, as Hugging Face writes it):
// {"metadata": {...}, "weight_map": {tensor name: file name}}. Returns the weight map.
// Throws CheckpointError naming `source` for invalid JSON (a name written twice
// included), a missing or non-object weight_map, a file that is not a plain name in the
// index's directory ("../x", "a/b", "", "."), an empty tensor name, or a
// metadata.total_size that is not a non-negative integer. Opening the set (SafetensorsSet)
// then checks the index against its files: every tensor of every file is in weight_map,
// under that file, and total_size (when given) is the sum of the tensors' bytes.
std::map<std::string, std::string> parseSafetensorsIndex(const std::string& text, const std::string& source);

// Lays `tensors` out back to back in the given order (sets begin/end) and returns the
// 8-byte length + JSON header padded to a multiple of 8. metadata gets "format": "pt"
// unless it sets "format" itself.
std::string buildSafetensorsHeader(std::vector<SafetensorsEntry>& tensors, std::map<std::string, std::string> metadata);

// Writes one file: the header at construction, then the data section streamed through
// write() in tensor order, then finish() (checks the byte count, fsyncs, renames
// path.tmp -> path). Without finish() (an exception) the .tmp file is removed.
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, std::vector<SafetensorsEntry> tensors, std::map<std::string, std::string> metadata);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  void write(const void* data, int64_t bytes);
  // Writes a whole tensor (contiguous CPU, the planned dtype and numel).
  void writeTensor(const at::Tensor& t);
  void finish();

 private:
  std::string path_;
  std::vector<SafetensorsEntry> tensors_;
  File file_;
  int64_t headerSize_ = 0;
  int64_t dataBytes_ = 0;
  int64_t written_ = 0;
  bool finished_ = false;
};

class SafetensorsReader {
 public:
  explicit SafetensorsReader(std::string path);
  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  // The entry; CheckpointError naming the file when absent.
  const SafetensorsEntry& entry(const std::string& name) const;
  at::Tensor read(const std::string& name) const;
  // Rows [rowBegin, rowEnd) of a tensor (0-d: one row) into dst (contiguous CPU).
  void readRows(const SafetensorsEntry& e, int64_t rowBegin, int64_t rowEnd, void* dst) const;

 private:
  std::string path_;
  File file_;
  SafetensorsHeader header_;
};

// The files a safetensors path stands for: the path itself, or the shard files a sharded
// export's *.index.json lists (beside it, each once, in weight_map order). Throws
// CheckpointError naming the index when it cannot be read or parsed.
std::vector<std::string> safetensorsFiles(const std::string& path);

// A single safetensors file, or the files of a sharded export listed by its *.index.json:
// every tensor by name, with the reader that holds it. Throws CheckpointError naming the
// file for a tensor in two files or one the index puts in a file that lacks it.
class SafetensorsSet {
 public:
  explicit SafetensorsSet(const std::string& path);
  struct Located {
    const SafetensorsReader* reader;
    const SafetensorsEntry* entry;
  };
  const std::map<std::string, Located>& byName() const { return byName_; }

 private:
  void open(const std::vector<std::string>& files);
  std::vector<std::unique_ptr<SafetensorsReader>> readers_;
  std::map<std::string, Located> byName_;
};

// Every tensor of a file (or of a sharded export: a *.index.json path), by name.
std::map<std::string, at::Tensor> loadSafetensors(const std::string& path);

// Writes `tensors` (any device; copied to the CPU one at a time) to one file, in name
// order, through SafetensorsWriter (atomic: path.tmp, fsync, rename).
void saveSafetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                     std::map<std::string, std::string> metadata = {});

// Names and shapes expected vs found.
struct MatchReport {
  std::vector<std::string> missing;     // expected, not in the file
  std::vector<std::string> unexpected;  // in the file, not expected
  std::vector<std::string> mismatched;  // "name: file has [2, 3], expected [3, 2]"
  bool ok(bool strict = true) const { return missing.empty() && mismatched.empty() && (!strict || unexpected.empty()); }
  std::string str() const;  // one line per problem, grouped
};
MatchReport matchTensors(const std::map<std::string, std::vector<int64_t>>& found,
                         const std::map<std::string, std::vector<int64_t>>& expected);

struct ImportOptions {
  // Entry names start with this; the file's names are the rest ("model/" + "layers.0.weight").
  std::string stripPrefix;
  // Tensors in the file that no entry takes are an error.
  bool strict = true;
  // Entries whose file name starts with one of these may be missing from the file: they
  // keep their values (a part the file's model did not have, such as a GAN head).
  std::vector<std::string> mayBeMissing;
  // Convert floating dtypes (a bf16 export into an fp32 model); off: a dtype difference is
  // an error.
  bool allowCast = true;
  // The ranks that import together (null: this rank alone). Each reads its own rows, so a
  // bad value may be seen by some ranks only: with a communicator, a failure on any rank
  // throws on every rank (an all-reduce after the import) instead of leaving the others
  // to wait for it in their next collective.
  distributed::Communicator* comm = nullptr;
};

// Initialises each entry's shard (its spec's rows of this rank, padding zeroed) from a
// safetensors file or a sharded export's *.index.json, reading only those rows. Checks
// all names, shapes and dtypes first and throws CheckpointError naming the file and
// listing every missing, unexpected (strict) and mismatched tensor; an integer or bool
// tensor for a floating-point entry is refused whatever allowCast says, and so are NaN
// and Inf values (the tensor named). Every rank of options.comm calls it.
void importSafetensors(const std::string& path, const std::vector<StateEntry>& entries, const ImportOptions& options = {});

}  // namespace tessera::checkpoint
