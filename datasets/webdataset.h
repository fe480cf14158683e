// data.kind webdataset: images streamed from tar shards in the WebDataset layout (each
// sample a run of consecutive members sharing a key: KEY.png or KEY.jpg with KEY.cls, a
// decimal class id, or KEY.json holding {"label": id} or {"cls": id}).
//
// The order is a stream defined on the global batch, so that it does not depend on the
// world size: epoch e lists the shards in an order shuffled from (run.seed, e), reads their
// samples in turn into a shuffle buffer of data.shuffle_buffer samples, and emits a random
// one of the buffer for each position (the buffer drained at the epoch's end, so every
// sample comes once an epoch). Optimizer step s takes stream positions [s G, (s + 1) G)
// (G = data.global_batch) and rank r of W the rows [r G/W, (r + 1) G/W) of them, as the
// map-style datasets do (DistributedSampler, SampleOrder::kStream).
//
// The stream's state at any position is a pure function of the seed, the shard list and
// the position: the buffer holds (shard, sample) references, not bytes, and is rebuilt on
// resume by replaying the current epoch's draws (integer work only, no reading). So the
// checkpoint's step is the data position, a run resumed on any world size or strategy sees
// the global batches of the uninterrupted run, and memory is O(buffer + shards), whatever
// the data set's size. Each rank reads and decodes only its own rows, on the batch loader's
// thread (batch_loader.h).
//
// Shard sample counts come from the directory's manifest.json (shard_manifest.h, written by
// tessera-shards), else from scanning the shards' headers at start. A shard whose size is
// not its manifest's is named at start as truncated; its checksum is checked when a rank
// first reads it. Under data.on_error fail (the default) every damaged shard or sample is
// an error naming the shard, the key and the byte offset; under skip, a shard found
// truncated at start is left out (or, without a manifest, kept up to the sample before the
// damage) and a sample that cannot be read or decoded gives its row to the next readable
// position of the stream (a held-out one to the next held-out one), each position passed
// over counted once (Dataset::skipped()).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "datasets/dataset.h"

namespace tessera::datasets {

struct DataOptions;

// The shard files `spec` names, in order: a directory (its *.tar files, sorted), a glob
// ("shards/train-*.tar", sorted), or a brace list as WebDataset writes them
// ("train-{000000..000099}.tar": zero-padded numeric ranges; "{a,b}"), a glob after
// expansion. tessera::ConfigError naming `spec` when nothing matches or a brace is malformed.
std::vector<std::string> expandShardPaths(const std::string& spec);

// Which (shard, sample) each stream position holds: the deterministic shuffle described
// above. Positions are read in increasing order in a run (a step's rows, then the next
// step's); going back further than the last 4096 positions, or to another epoch, replays
// that epoch from its start.
class StreamOrder {
 public:
  struct Ref {
    int64_t shard = 0;   // index into the shard list
    int64_t sample = 0;  // the sample's number within its shard
    bool operator==(const Ref& o) const { return shard == o.shard && sample == o.sample; }
  };
  // `shardSamples[i]`: the samples of shard i (some may be 0). `shuffle` false: shards in
  // list order, samples in file order (no buffer).
  StreamOrder(std::vector<int64_t> shardSamples, int64_t bufferSize, int64_t seed, bool shuffle);

  int64_t samplesPerEpoch() const { return total_; }
  Ref at(int64_t position);

 private:
  void startEpoch(int64_t epoch);
  Ref emitNext();

  std::vector<int64_t> counts_;
  int64_t total_ = 0, bufferSize_;
  uint64_t seed_;
  bool shuffle_;
  // The current epoch: its shard order, how far its samples have been read into the buffer
  // and how many positions it has emitted; the last ones emitted, for rows read out of order.
  int64_t epoch_ = -1, emitted_ = 0;
  std::vector<int64_t> shardOrder_;
  size_t orderCursor_ = 0;
  int64_t sampleCursor_ = 0;
  std::vector<Ref> buffer_;
  std::deque<Ref> recent_;
};

// data.kind webdataset: data.path the train shards, data.eval_path the held-out shards
// (none: no held-out set), images at data.image_size (0: the first image's, square) with
// data.channels (0: the first image's).
std::unique_ptr<Dataset> makeWebDataset(const DataOptions& data, int64_t seed);

}  // namespace tessera::datasets
