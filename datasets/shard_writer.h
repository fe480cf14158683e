// Writing WebDataset shards from the image data Tessera reads (the tessera-shards tool):
// each sample a KEY.png (or the image file's own .jpg/.png bytes) and a KEY.cls, shards of
// a fixed number of samples, and a manifest.json with each shard's count, size and
// checksum, which the webdataset reader checks (shard_manifest.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "datasets/shard_manifest.h"

namespace tessera::datasets {

struct DataOptions;
class TarWriter;

// One directory of shards: <directory>/<prefix>-000000.tar, ... and its manifest.
class ShardWriter {
 public:
  // Creates `directory` when missing; refuses one that already holds a manifest or .tar
  // files (shards of another write would be mixed with these).
  ShardWriter(std::string directory, std::string prefix, int64_t samplesPerShard);
  ~ShardWriter();  // without finish(): removes the shards it wrote
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // Appends a sample: `image` the encoded bytes, `extension` png or jpg, `label` its class.
  void add(const std::string& image, const std::string& extension, int64_t label);
  // Closes the last shard and writes the manifest; returns it.
  ShardManifest finish();
  // Removes what it wrote, finished or not (the manifest too): a write of several splits
  // that failed in a later one leaves none behind.
  void discard();

 private:
  void closeShard();
  std::string directory_, prefix_;
  int64_t samplesPerShard_;
  int64_t samples_ = 0, inShard_ = 0;
  std::unique_ptr<TarWriter> shard_;
  std::string shardName_;
  ShardManifest manifest_;
  bool finished_ = false;
};

// What writeImageShards wrote.
struct ShardWriteSummary {
  ShardManifest train, eval;  // eval: empty without data.eval_path
  std::string trainDirectory, evalDirectory;
};

// Writes the images of `data` (data.kind idx or image_folder: data.path with data.labels,
// and data.eval_path with data.eval_labels when set) as shards of `samplesPerShard`:
// <out>/train/ and <out>/eval/. IDX images are encoded as PNG; image files are copied as
// they are (their class from their folder). The inputs are read (IDX) or listed (folders)
// before a directory is created; a failure part-way removes the shards written.
// tessera::ConfigError for another kind.
ShardWriteSummary writeImageShards(const DataOptions& data, const std::string& out, int64_t samplesPerShard);

}  // namespace tessera::datasets
