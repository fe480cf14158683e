// Gradient clipping by global L2 norm over sharded and replicated gradients.
//
// The norm must be the one a single process would compute on the full, averaged
// gradients, whatever the layout: each element is counted once. A Shard(0) gradient
// contributes the squares of its real rows (padding excluded) and the partial sums are
// added across the ranks in one all-reduce (of one double, plus the few values a caller
// sends along: sumAlongside); a Replicate gradient is the same on every rank, so it
// contributes its full square sum locally, uncommunicated.
// `exact` (run.deterministic): every square is added exactly, as an integer (each fp32
// square is exact in 48 bits), so the norm's bits do not depend on how the elements are
// split over ranks or the order they are added in; the partial sums cross ranks as integer
// digits in doubles (an all-reduce of ~40 values), exact in any order.
// Clipping follows torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6),
// gradients scaled by coef when coef < 1. A non-finite norm is reported, not clipped:
// the caller skips the step (every rank sees the same norm, so all skip together).
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "dtensor/sharded_param.h"

namespace tessera::distributed {
class Communicator;
}

namespace tessera::optim {

struct GradNorm {
  double norm = 0.0;      // global L2 norm before clipping (NaN or inf when non-finite)
  double clipCoef = 1.0;  // factor the gradients were scaled by (1 = untouched)
  bool finite() const;
};

// Sum of squares (in double) of the real rows of `grad`, laid out by `spec`.
double localSquaredNorm(const at::Tensor& grad, const dtensor::ShardSpec& spec);

// Global L2 norm of the parameters' `grad` (undefined = no gradient, contributes 0),
// each laid out by its `spec`. Collective over `comm` (the group the Shard(0) specs
// shard over) when any spec is Shard(0) over more than one rank: every rank must call
// it, in the same order.
// `sumAlongside` (optional, a CPU double tensor of a few values) is summed over `comm` in
// that same all-reduce, or in one of its own when the norm needs none: the caller's
// per-step sums (a loss) without a collective more.
double globalGradNorm(const std::vector<dtensor::ShardedParam>& params, distributed::Communicator& comm,
                      const at::Tensor& sumAlongside = {}, bool exact = false);

// torch's clip coefficient: min(1, maxNorm / (norm + 1e-6)); 1 when maxNorm <= 0
// (clipping off) or the norm is not finite.
double clipCoefficient(double norm, double maxNorm);

// globalGradNorm, then scales every `grad` in place by clipCoefficient(norm, maxNorm)
// when it is below 1. Collective like globalGradNorm.
GradNorm clipGradNorm(const std::vector<dtensor::ShardedParam>& params, double maxNorm, distributed::Communicator& comm,
                      const at::Tensor& sumAlongside = {}, bool exact = false);

// The exact sum of squares of fp32 values (see globalGradNorm's `exact`): an integer in
// 16-bit digits, so that partial sums add exactly wherever they are added.
class ExactSquareSum {
 public:
  void add(const float* x, int64_t n);
  void add(const at::Tensor& values);  // any floating dtype, rounded to fp32 first
  // The digits as doubles (each < 2^16 before adding), for an all-reduce sum; and back.
  at::Tensor digits() const;
  void addDigits(const at::Tensor& digits);
  // The sum, rounded to a double; infinity when a value was not finite.
  double value() const;

 private:
  void carry();
  // Squares by the exponent field of their fp32 value: each square is m^2 * 2^(2e) with
  // m < 2^24, so m^2 < 2^48 and 2^79 of them fit.
  unsigned __int128 byExponent_[255] = {};
  bool byExponentUsed_ = false;
  std::vector<uint64_t> digits_;  // little-endian base 2^16 of sum * 2^298
  double nonFinite_ = 0;
};

}  // namespace tessera::optim
