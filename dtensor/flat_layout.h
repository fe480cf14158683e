// FlatLayout: several parameters' shards packed into one flat communication buffer, so a
// whole group (a gradient bucket here, an FSDP unit in zero3) moves in one collective.
//
// Sharded layout (all specs Shard(0) over the same N ranks) is rank-major:
//
//   flat = [ chunk 0 | chunk 1 | ... | chunk N-1 ],   chunk r = [ p0 shard r | p1 shard r | ... ]
//
// where "pi shard r" is rank r's padded ShardSpec buffer of parameter i (chunkRows x
// rowNumel elements, real rows first, padding rows zero). So one reduceScatter of the
// flat gradients leaves on rank r exactly chunk r: every parameter's gradient shard, in
// its ShardSpec layout, at a fixed offset; and one allGatherInto of the chunks rebuilds
// every full parameter. Replicated layout (all specs Replicate) is one chunk holding the
// full tensors back to back (the all-reduce buffer of no_shard).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "dtensor/shard_spec.h"

namespace tessera::dtensor {

class FlatLayout {
 public:
  // Throws tessera::Error when `specs` mix placements, worlds or ranks.
  explicit FlatLayout(std::vector<ShardSpec> specs);

  size_t size() const { return specs_.size(); }
  // Chunks in the flat buffer: the world size when sharded, 1 when replicated.
  int chunks() const { return chunks_; }
  int64_t chunkNumel() const { return chunkNumel_; }
  int64_t flatNumel() const { return chunkNumel_ * chunks_; }
  // Element offset of parameter i's slot inside every chunk.
  int64_t offset(size_t i) const { return offsets_.at(i); }

  // Chunk r of a flat buffer (a view; contiguous).
  at::Tensor chunk(const at::Tensor& flat, int r) const;
  // Parameter i's slot of a chunk, as a view shaped like its local buffer
  // (spec.localShape(); the global shape when replicated).
  at::Tensor slot(const at::Tensor& chunk, size_t i) const;

  // Scatters full tensor i (global shape, any dtype; cast on copy) into every chunk of
  // `flat`: rank r's rows into slot i of chunk r, padding rows zeroed. An undefined
  // `full` writes zeros (a parameter without a gradient on this rank).
  void packFull(const at::Tensor& flat, size_t i, const at::Tensor& full) const;
  // Copies the real rows of tensor i from every chunk of `flat` into `full` (contiguous,
  // global shape, any dtype; cast on copy). Runs without autograd recording.
  void unpackFull(const at::Tensor& flat, size_t i, const at::Tensor& full) const;

  // The whole group in one operation each way (FSDP2's split_with_sizes_copy and
  // chunk_cat): a unit's gather copied out, its gradients packed, without a chain of views
  // and a copy per tensor (on a GPU, the host's launches are what a step waits for).
  // Elements of tensor i's padded full tensor: chunks() x chunkRows rows, real rows first,
  // so that rank r's shard is rows [r * chunkRows, (r + 1) * chunkRows).
  int64_t paddedFullNumel(size_t i) const { return chunks_ * specs_.at(i).paddedNumel(); }
  // Copies every chunk of `flat` into `paddedFulls[i]` (contiguous, paddedFullNumel(i)
  // elements, one dtype): the full tensor i is then its first globalNumel() elements. A
  // flat of another dtype is cast on the way (one cast per tensor).
  void unpackAll(const at::Tensor& flat, at::TensorList paddedFulls) const;
  // packFull for every tensor at once (`fulls[i]` of global shape, or undefined for
  // zeros), cast to flat's dtype. A tensor whose rows do not fill its padded rows is
  // padded in a copy of its own first.
  void packAll(const at::Tensor& flat, at::TensorList fulls) const;

 private:
  void checkFlat(const at::Tensor& flat, const char* where) const;

  std::vector<ShardSpec> specs_;
  std::vector<int64_t> offsets_;
  bool sharded_ = true;
  int chunks_ = 1;
  int64_t chunkNumel_ = 0;
};

// Splits items (in order) into consecutive buckets of at most `bucketBytes` each; an
// item larger than `bucketBytes` gets a bucket of its own. Returns the item indices of
// each bucket. bucketBytes must be > 0 (tessera::ConfigError otherwise).
std::vector<std::vector<size_t>> planBuckets(const std::vector<int64_t>& itemBytes, int64_t bucketBytes);

}  // namespace tessera::dtensor
