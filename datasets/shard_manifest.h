// The manifest of a directory of WebDataset shards (manifest.json next to the .tar files):
// for each shard its sample count, size and XXH3-64 checksum, and the number of classes.
// tessera-shards writes it; the webdataset reader uses it to know each shard's samples
// without scanning it, to name a truncated shard at start (its size is not the manifest's)
// and to check each shard's checksum when it first reads it.
//
//   {"format": "tessera-webdataset-1", "classes": 10,
//    "shards": [{"name": "train-000000.tar", "samples": 5000, "bytes": 10250240,
//                "xxh3": "9b1f0e6a3c2d4e5f"}, ...]}
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace tessera::datasets {

constexpr const char* kShardManifestName = "manifest.json";

struct ShardEntry {
  std::string name;     // the shard's file name in the manifest's directory
  int64_t samples = 0;  // samples (image + label) it holds
  int64_t bytes = 0;    // its file size
  uint64_t xxh3 = 0;    // XXH3-64 of its bytes
};

struct ShardManifest {
  int64_t classes = 0;  // largest label + 1 over the shards
  std::vector<ShardEntry> shards;  // in order; entries come in through add()
  // Appends `entry`; false (and nothing added) when a shard of its name is listed already.
  bool add(ShardEntry entry);
  const ShardEntry* find(const std::string& name) const;  // nullptr when not listed

 private:
  std::unordered_map<std::string, size_t> byName_;
};

// The manifest in `directory`, or nullopt when it has none. Throws tessera::Error naming
// the file when one is there but is not a manifest (malformed JSON, a missing or wrong-typed
// field, a name with a '/', a shard listed twice, a negative count, more samples than its
// bytes can hold, more than 2^20 classes).
std::optional<ShardManifest> readShardManifest(const std::string& directory);

// Writes `manifest` as `directory`/manifest.json (replaced by a rename).
void writeShardManifest(const std::string& directory, const ShardManifest& manifest);

// XXH3-64 of the bytes of regular file `path`; tessera::Error naming it when unreadable.
uint64_t fileXxh3(const std::string& path);

// 16 lower-case hex digits, as the manifest writes a checksum.
std::string hex64(uint64_t value);

}  // namespace tessera::datasets
