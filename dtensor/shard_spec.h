// ShardSpec: the one layout every piece of sharded state uses (docs/design.md, "The one idea").
//
// A global tensor of shape [d0, d1, ...] is split along dim 0 over the N ranks of a
// mesh dimension in chunks of c = ceil(d0 / N) rows: rank r owns the global rows
// [r*c, min((r+1)*c, d0)), which may be empty. Every rank stores a local buffer padded
// to c rows, so all ranks hold equal-size buffers (what all-gather needs); the padding
// rows are zero and never read back. The global shape is stored, never inferred from
// local size x N. A 0-d tensor is treated as one row of one element.
//
// The same spec describes a parameter shard (zero3), a rank's slice of a replicated
// parameter (zero1/2 optimizer view), its gradient shard, every optimizer state and
// every EMA tensor of that parameter, and the chunks of a sharded checkpoint.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tessera::distributed {
class Communicator;
}

namespace tessera::dtensor {

enum class Placement { kShard0, kReplicate };

class ShardSpec {
 public:
  ShardSpec() = default;
  // Throws tessera::Error when rank is outside [0, worldSize) or a dim is negative.
  ShardSpec(std::vector<int64_t> globalShape, at::ScalarType dtype, int worldSize, int rank,
            Placement placement = Placement::kShard0);

  const std::vector<int64_t>& globalShape() const { return globalShape_; }
  at::ScalarType dtype() const { return dtype_; }
  int worldSize() const { return worldSize_; }
  int rank() const { return rank_; }
  Placement placement() const { return placement_; }

  int64_t globalRows() const { return rows_; }          // d0 (1 for a 0-d tensor)
  int64_t rowNumel() const { return rowNumel_; }        // d1 * d2 * ...
  int64_t globalNumel() const { return rows_ * rowNumel_; }
  int64_t chunkRows() const { return chunkRows_; }      // padded rows per rank
  int64_t paddedNumel() const { return chunkRows_ * rowNumel_; }  // local buffer elements

  // Global rows [begin, end) owned by rank r (empty when begin == end).
  std::pair<int64_t, int64_t> rowRange(int r) const;
  std::pair<int64_t, int64_t> localRowRange() const { return rowRange(rank_); }
  int64_t localRows() const;  // real (unpadded) rows of this rank

  // Shape of the padded local buffer: [chunkRows, d1, ...] ([1] for 0-d tensors
  // sharded over one rank). Replicate: the global shape.
  std::vector<int64_t> localShape() const;

  // This rank's padded shard of a full tensor (a new tensor; padding rows zero).
  at::Tensor shardOf(const at::Tensor& full) const;
  // The real (unpadded) rows of a local buffer, as a view.
  at::Tensor realRows(const at::Tensor& local) const;
  // All-gathers the local shards into the full global tensor (every rank gets it).
  at::Tensor fullTensor(const at::Tensor& local, distributed::Communicator& comm) const;

  std::string str() const;  // e.g. "Shard(0) [10, 3] float over 4 ranks, rank 1 rows [3, 6)"
  bool operator==(const ShardSpec& other) const;

 private:
  void checkLocal(const at::Tensor& local, const char* where) const;

  std::vector<int64_t> globalShape_;
  at::ScalarType dtype_ = at::kFloat;
  int worldSize_ = 1;
  int rank_ = 0;
  Placement placement_ = Placement::kShard0;
  int64_t rows_ = 0, rowNumel_ = 1, chunkRows_ = 0;
};

}  // namespace tessera::dtensor
