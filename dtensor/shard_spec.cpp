// ShardSpec row arithmetic and shard/gather operations (see shard_spec.h).
#include "dtensor/shard_spec.h"

#include <algorithm>
#include <sstream>

#include "common/errors.h"
#include "distributed/communicator.h"

namespace tessera::dtensor {

ShardSpec::ShardSpec(std::vector<int64_t> globalShape, at::ScalarType dtype, int worldSize, int rank, Placement placement)
    : globalShape_(std::move(globalShape)), dtype_(dtype), worldSize_(worldSize), rank_(rank), placement_(placement) {
  TESSERA_CHECK(worldSize >= 1 && rank >= 0 && rank < worldSize, "ShardSpec: rank ", rank, " of world size ", worldSize);
  for (int64_t d : globalShape_) TESSERA_CHECK(d >= 0, "ShardSpec: negative dimension in shape ", at::IntArrayRef(globalShape_));
  rows_ = globalShape_.empty() ? 1 : globalShape_[0];
  rowNumel_ = 1;
  for (size_t i = 1; i < globalShape_.size(); ++i) rowNumel_ *= globalShape_[i];
  chunkRows_ = placement_ == Placement::kReplicate ? rows_ : (rows_ + worldSize_ - 1) / worldSize_;
}

std::pair<int64_t, int64_t> ShardSpec::rowRange(int r) const {
  TESSERA_CHECK(r >= 0 && r < worldSize_, "ShardSpec::rowRange: rank ", r, " of world size ", worldSize_);
  if (placement_ == Placement::kReplicate) return {0, rows_};
  const int64_t begin = std::min(rows_, static_cast<int64_t>(r) * chunkRows_);
  const int64_t end = std::min(rows_, begin + chunkRows_);
  return {begin, end};
}

int64_t ShardSpec::localRows() const {
  auto [b, e] = localRowRange();
  return e - b;
}

std::vector<int64_t> ShardSpec::localShape() const {
  if (placement_ == Placement::kReplicate) return globalShape_;
  std::vector<int64_t> shape = globalShape_.empty() ? std::vector<int64_t>{1} : globalShape_;
  shape[0] = chunkRows_;
  return shape;
}

at::Tensor ShardSpec::shardOf(const at::Tensor& full) const {
  TESSERA_CHECK(full.sizes().vec() == globalShape_, "ShardSpec::shardOf: tensor of shape ", full.sizes(),
                " does not match the spec's global shape ", at::IntArrayRef(globalShape_));
  if (placement_ == Placement::kReplicate) return full.to(dtype_).clone();
  at::Tensor rows = full.reshape({rows_, rowNumel_});
  at::Tensor local = at::zeros({chunkRows_, rowNumel_}, full.options().dtype(dtype_));
  auto [b, e] = localRowRange();
  if (e > b) local.narrow(0, 0, e - b).copy_(rows.narrow(0, b, e - b));
  return local.view(localShape());
}

void ShardSpec::checkLocal(const at::Tensor& local, const char* where) const {
  TESSERA_CHECK(local.numel() == (placement_ == Placement::kReplicate ? globalNumel() : paddedNumel()), "ShardSpec::",
                where, ": local buffer has ", local.numel(), " elements, spec ", str(), " needs ",
                placement_ == Placement::kReplicate ? globalNumel() : paddedNumel());
}

at::Tensor ShardSpec::realRows(const at::Tensor& local) const {
  checkLocal(local, "realRows");
  if (placement_ == Placement::kReplicate) return local;
  return local.reshape({chunkRows_, rowNumel_}).narrow(0, 0, localRows());
}

at::Tensor ShardSpec::fullTensor(const at::Tensor& local, distributed::Communicator& comm) const {
  checkLocal(local, "fullTensor");
  if (placement_ == Placement::kReplicate) return local.clone().view(globalShape_);
  TESSERA_CHECK(comm.worldSize() == worldSize_ && comm.rank() == rank_, "ShardSpec::fullTensor: spec ", str(),
                " used with a communicator of rank ", comm.rank(), " / ", comm.worldSize());
  at::Tensor flat = at::empty({paddedNumel() * worldSize_}, local.options());
  comm.allGatherInto(flat, local.contiguous().view({-1}));
  return flat.narrow(0, 0, globalNumel()).view(globalShape_);
}

std::string ShardSpec::str() const {
  std::ostringstream s;
  auto [b, e] = localRowRange();
  s << (placement_ == Placement::kShard0 ? "Shard(0) " : "Replicate ") << at::IntArrayRef(globalShape_) << " "
    << c10::toString(dtype_) << " over " << worldSize_ << " ranks, rank " << rank_ << " rows [" << b << ", " << e << ")";
  return s.str();
}

bool ShardSpec::operator==(const ShardSpec& o) const {
  return globalShape_ == o.globalShape_ && dtype_ == o.dtype_ && worldSize_ == o.worldSize_ && rank_ == o.rank_ &&
         placement_ == o.placement_;
}

}  // namespace tessera::dtensor
