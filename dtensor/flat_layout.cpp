// Rank-major flat buffers and bucket planning (see flat_layout.h).
#include "dtensor/flat_layout.h"

#include <c10/core/GradMode.h>

#include "common/errors.h"

namespace tessera::dtensor {

FlatLayout::FlatLayout(std::vector<ShardSpec> specs) : specs_(std::move(specs)) {
  if (!specs_.empty()) {
    const ShardSpec& first = specs_.front();
    sharded_ = first.placement() == Placement::kShard0;
    chunks_ = sharded_ ? first.worldSize() : 1;
  }
  offsets_.reserve(specs_.size());
  for (const ShardSpec& s : specs_) {
    const ShardSpec& first = specs_.front();
    TESSERA_CHECK(s.placement() == first.placement() && s.worldSize() == first.worldSize() && s.rank() == first.rank(),
                  "FlatLayout: spec ", s.str(), " does not match the group's first spec ", first.str());
    offsets_.push_back(chunkNumel_);
    chunkNumel_ += s.paddedNumel();  // Replicate: chunkRows == rows, so this is the full numel
  }
}

void FlatLayout::checkFlat(const at::Tensor& flat, const char* where) const {
  TESSERA_CHECK(flat.defined() && flat.is_contiguous() && flat.numel() == flatNumel(), "FlatLayout::", where,
                ": flat buffer must be contiguous with ", flatNumel(), " elements, got ",
                flat.defined() ? flat.numel() : -1);
}

at::Tensor FlatLayout::chunk(const at::Tensor& flat, int r) const {
  checkFlat(flat, "chunk");
  TESSERA_CHECK(r >= 0 && r < chunks_, "FlatLayout::chunk: chunk ", r, " of ", chunks_);
  return flat.view({-1}).narrow(0, r * chunkNumel_, chunkNumel_);
}

at::Tensor FlatLayout::slot(const at::Tensor& chunk, size_t i) const {
  TESSERA_CHECK(chunk.numel() == chunkNumel_, "FlatLayout::slot: chunk has ", chunk.numel(), " elements, layout needs ",
                chunkNumel_);
  const ShardSpec& s = specs_.at(i);
  return chunk.view({-1}).narrow(0, offsets_[i], s.paddedNumel()).view(s.localShape());
}

// Both directions view parameter i's slots across all chunks as one [chunks, c, rowNumel]
// tensor, so a full tensor of rows = q*c + rem moves in at most two copies (q whole
// chunks, then the ragged one) instead of one per rank.
void FlatLayout::packFull(const at::Tensor& flat, size_t i, const at::Tensor& full) const {
  checkFlat(flat, "packFull");
  const ShardSpec& s = specs_.at(i);
  const int64_t c = s.chunkRows(), rn = s.rowNumel(), rows = s.globalRows();
  if (c == 0 || rn == 0) return;  // no elements
  c10::NoGradGuard noGrad;
  at::Tensor dst = flat.view({chunks_, chunkNumel_}).narrow(1, offsets_[i], c * rn).view({chunks_, c, rn});
  if (!full.defined()) {
    dst.zero_();
    return;
  }
  TESSERA_CHECK(full.sizes().vec() == s.globalShape(), "FlatLayout::packFull: tensor ", i, " has shape ", full.sizes(),
                ", its spec says ", at::IntArrayRef(s.globalShape()));
  const at::Tensor src = full.detach().contiguous().view({rows, rn});
  const int64_t q = rows / c, rem = rows % c;
  if (q > 0) dst.narrow(0, 0, q).copy_(src.narrow(0, 0, q * c).view({q, c, rn}));
  if (rem > 0) {
    at::Tensor ragged = dst.select(0, q);
    ragged.narrow(0, 0, rem).copy_(src.narrow(0, q * c, rem));
    ragged.narrow(0, rem, c - rem).zero_();
  }
  const int64_t filled = q + (rem > 0 ? 1 : 0);
  if (filled < chunks_) dst.narrow(0, filled, chunks_ - filled).zero_();
}

void FlatLayout::unpackFull(const at::Tensor& flat, size_t i, const at::Tensor& full) const {
  checkFlat(flat, "unpackFull");
  const ShardSpec& s = specs_.at(i);
  TESSERA_CHECK(full.defined() && full.is_contiguous() && full.sizes().vec() == s.globalShape(),
                "FlatLayout::unpackFull: tensor ", i, " must be contiguous with shape ",
                at::IntArrayRef(s.globalShape()));
  const int64_t c = s.chunkRows(), rn = s.rowNumel(), rows = s.globalRows();
  if (c == 0 || rn == 0) return;
  c10::NoGradGuard noGrad;
  const at::Tensor src = flat.view({chunks_, chunkNumel_}).narrow(1, offsets_[i], c * rn).view({chunks_, c, rn});
  at::Tensor dst = full.detach().view({rows, rn});
  const int64_t q = rows / c, rem = rows % c;
  if (q > 0) dst.narrow(0, 0, q * c).view({q, c, rn}).copy_(src.narrow(0, 0, q));
  if (rem > 0) dst.narrow(0, q * c, rem).copy_(src.select(0, q).narrow(0, 0, rem));
}

void FlatLayout::unpackAll(const at::Tensor& flat, at::TensorList paddedFulls) const {
  checkFlat(flat, "unpackAll");
  TESSERA_CHECK(paddedFulls.size() == specs_.size(), "FlatLayout::unpackAll: ", paddedFulls.size(),
                " tensors for a layout of ", specs_.size());
  if (specs_.empty()) return;
  std::vector<at::Tensor> outs;
  std::vector<int64_t> widths;
  outs.reserve(specs_.size());
  widths.reserve(specs_.size());
  for (size_t i = 0; i < specs_.size(); ++i) {
    const at::Tensor& out = paddedFulls[i];
    TESSERA_CHECK(out.defined() && out.is_contiguous() && out.numel() == paddedFullNumel(i) &&
                      out.scalar_type() == paddedFulls[0].scalar_type(),
                  "FlatLayout::unpackAll: tensor ", i, " must be contiguous ", paddedFulls[0].scalar_type(), " with ",
                  paddedFullNumel(i), " elements");
    outs.push_back(out.detach().view({chunks_, specs_[i].paddedNumel()}));
    widths.push_back(specs_[i].paddedNumel());
  }
  c10::NoGradGuard noGrad;
  const at::Tensor chunks = flat.view({chunks_, chunkNumel_});
  if (flat.scalar_type() != paddedFulls[0].scalar_type()) {
    const std::vector<at::Tensor> pieces = chunks.split_with_sizes(widths, 1);
    for (size_t i = 0; i < outs.size(); ++i) outs[i].copy_(pieces[i]);
    return;
  }
  at::split_with_sizes_copy_out(outs, chunks, widths, 1);
}

void FlatLayout::packAll(const at::Tensor& flat, at::TensorList fulls) const {
  checkFlat(flat, "packAll");
  TESSERA_CHECK(fulls.size() == specs_.size(), "FlatLayout::packAll: ", fulls.size(), " tensors for a layout of ",
                specs_.size());
  if (flat.numel() == 0) return;
  c10::NoGradGuard noGrad;
  std::vector<at::Tensor> pieces;
  pieces.reserve(specs_.size());
  for (size_t i = 0; i < specs_.size(); ++i) {
    const ShardSpec& s = specs_[i];
    const int64_t c = s.chunkRows(), rn = s.rowNumel(), rows = s.globalRows();
    if (c == 0 || rn == 0) continue;  // no elements
    const at::Tensor& full = fulls[i];
    if (!full.defined()) {
      pieces.push_back(at::zeros({chunks_, c * rn}, flat.options()));
      continue;
    }
    TESSERA_CHECK(full.sizes().vec() == s.globalShape(), "FlatLayout::packAll: tensor ", i, " has shape ",
                  full.sizes(), ", its spec says ", at::IntArrayRef(s.globalShape()));
    at::Tensor src = full.detach().contiguous().view({rows, rn});
    if (rows != chunks_ * c) {  // ragged: padding rows of zeros after the real ones
      at::Tensor padded = at::zeros({chunks_ * c, rn}, src.options());
      padded.narrow(0, 0, rows).copy_(src);
      src = padded;
    }
    pieces.push_back(src.view({chunks_, c * rn}));
  }
  at::Tensor out = flat.view({chunks_, chunkNumel_});
  at::cat_out(out, pieces, 1);
}

std::vector<std::vector<size_t>> planBuckets(const std::vector<int64_t>& itemBytes, int64_t bucketBytes) {
  TESSERA_CHECK_AS(ConfigError, bucketBytes > 0, "planBuckets: bucket size must be > 0 bytes, got ", bucketBytes);
  std::vector<std::vector<size_t>> buckets;
  int64_t filled = 0;
  for (size_t i = 0; i < itemBytes.size(); ++i) {
    if (buckets.empty() || (filled > 0 && filled + itemBytes[i] > bucketBytes)) {
      buckets.emplace_back();
      filled = 0;
    }
    buckets.back().push_back(i);
    filled += itemBytes[i];
  }
  return buckets;
}

}  // namespace tessera::dtensor
