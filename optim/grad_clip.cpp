// Global-norm gradient clipping over sharded gradients (see grad_clip.h).
#include "optim/grad_clip.h"

#include <c10/core/GradMode.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "common/errors.h"
#include "distributed/communicator.h"
#include "optim/cpu_kernels.h"

namespace tessera::optim {

bool GradNorm::finite() const { return std::isfinite(norm); }

namespace {

// The real rows of a gradient, flat (empty when there are none).
at::Tensor realRowsOf(const at::Tensor& grad, const dtensor::ShardSpec& spec) {
  if (!grad.defined() || spec.localRows() == 0 || spec.rowNumel() == 0) return at::Tensor();
  return spec.realRows(grad.detach().reshape({-1}));
}

namespace {

// The sum of squares of realRowsOf's result (undefined: 0).
double squaredNormOfRows(const at::Tensor& real) {
  if (!real.defined()) return 0.0;
  if (real.device().is_cpu() && real.scalar_type() == at::kFloat && real.is_contiguous()) {
    return squaredNorm(real.data_ptr<float>(), real.numel());  // one pass, no temporaries
  }
  return real.to(at::kDouble).square().sum().item<double>();
}

}  // namespace

// A sum of squares kept where the gradients are: a double on the host for CPU gradients
// (one pass each); for accelerator gradients, their norms in one multi-tensor operation
// (_foreach_norm: a few launches for all of them instead of three per gradient), summed on
// the device, so that a step reads the device back once.
struct SquareSum {
  double host = 0.0;
  std::vector<at::Tensor> deviceGrads;  // fp32 or fp64, flat real rows

  void add(const at::Tensor& grad, const dtensor::ShardSpec& spec) {
    const at::Tensor real = realRowsOf(grad, spec);
    if (!real.defined()) return;
    if (real.device().is_cpu()) {
      host += squaredNormOfRows(real);
      return;
    }
    const bool wide = real.scalar_type() == at::kDouble || real.scalar_type() == at::kFloat;
    deviceGrads.push_back(wide ? real : real.to(at::kFloat));
  }
  // The device part as a double scalar tensor (undefined when there is none).
  at::Tensor deviceSum() const {
    if (deviceGrads.empty()) return at::Tensor();
    return at::stack(at::_foreach_norm(deviceGrads, 2)).to(at::kDouble).square().sum();
  }
  // The sum as a [1] double tensor on `where`.
  at::Tensor on(c10::Device where) const {
    at::Tensor out = at::full({1}, host, at::TensorOptions().dtype(at::kDouble).device(where));
    const at::Tensor device = deviceSum();
    if (device.defined()) out.add_(device.reshape({1}).to(where));
    return out;
  }
  double value() const {
    const at::Tensor device = deviceSum();
    return device.defined() ? host + device.item<double>() : host;
  }
};

}  // namespace

double localSquaredNorm(const at::Tensor& grad, const dtensor::ShardSpec& spec) {
  c10::NoGradGuard noGrad;
  return squaredNormOfRows(realRowsOf(grad, spec));
}

namespace {

constexpr int kDigitBits = 16;
constexpr int kDigits = 44;        // 704 bits: 2^80 squares of up to 2^256, times 2^298
constexpr int kSmallestShift = 298;  // the smallest square is 2^-298 (a subnormal's)

}  // namespace

void ExactSquareSum::add(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits = 0;
    std::memcpy(&bits, x + i, sizeof(bits));
    const uint32_t exponent = (bits >> 23) & 0xffu, fraction = bits & 0x7fffffu;
    if (exponent == 0xffu) {
      nonFinite_ += 1;
      continue;
    }
    const uint64_t m = exponent == 0 ? fraction : (fraction | 0x800000u);
    byExponent_[exponent] += static_cast<unsigned __int128>(m * m);  // m^2 < 2^48
  }
  byExponentUsed_ = true;
}

void ExactSquareSum::add(const at::Tensor& values) {
  if (!values.defined() || values.numel() == 0) return;
  const at::Tensor f = values.detach().to(at::kCPU).to(at::kFloat).contiguous();
  add(f.data_ptr<float>(), f.numel());
}

void ExactSquareSum::carry() {
  if (digits_.empty()) digits_.assign(kDigits, 0);
  if (byExponentUsed_) {
    for (int e = 0; e < 255; ++e) {
      unsigned __int128 v = byExponent_[e];
      if (v == 0) continue;
      // m^2 * 2^(2 * (e - 150)) (e = 0: 2^(2 * -149)), times 2^298.
      const int shift = 2 * (e == 0 ? -149 : e - 150) + kSmallestShift;
      size_t digit = static_cast<size_t>(shift / kDigitBits);
      v <<= shift % kDigitBits;  // < 2^(48 + 80 + 15): fits
      for (; v != 0; ++digit, v >>= kDigitBits) digits_[digit] += static_cast<uint64_t>(v & 0xffffu);
      byExponent_[e] = 0;
    }
    byExponentUsed_ = false;
  }
  uint64_t c = 0;
  for (uint64_t& d : digits_) {
    d += c;
    c = d >> kDigitBits;
    d &= 0xffffu;
  }
  TESSERA_CHECK(c == 0, "ExactSquareSum: the sum outgrew ", kDigits * kDigitBits, " bits");
}

at::Tensor ExactSquareSum::digits() const {
  ExactSquareSum copy = *this;
  copy.carry();
  at::Tensor out = at::empty({kDigits + 1}, at::kDouble);
  double* o = out.data_ptr<double>();
  for (int i = 0; i < kDigits; ++i) o[i] = static_cast<double>(copy.digits_[static_cast<size_t>(i)]);
  o[kDigits] = nonFinite_;
  return out;
}

void ExactSquareSum::addDigits(const at::Tensor& digits) {
  carry();
  const at::Tensor d = digits.to(at::kDouble).contiguous();
  TESSERA_CHECK(d.numel() == kDigits + 1, "ExactSquareSum::addDigits: ", d.numel(), " digits, not ", kDigits + 1);
  const double* v = d.data_ptr<double>();
  for (int i = 0; i < kDigits; ++i) digits_[static_cast<size_t>(i)] += static_cast<uint64_t>(v[i]);
  nonFinite_ += v[kDigits];
  carry();
}

double ExactSquareSum::value() const {
  if (nonFinite_ > 0) return std::numeric_limits<double>::infinity();
  ExactSquareSum copy = *this;
  copy.carry();
  double sum = 0;
  for (int i = kDigits - 1; i >= 0; --i) sum = sum * 65536.0 + static_cast<double>(copy.digits_[static_cast<size_t>(i)]);
  return std::ldexp(sum, -kSmallestShift);
}

namespace {

// globalGradNorm's exact form: the same elements, every square added as an integer.
double exactGlobalGradNorm(const std::vector<dtensor::ShardedParam>& params, distributed::Communicator& comm,
                           const at::Tensor& sumAlongside) {
  const bool alongside = sumAlongside.defined() && sumAlongside.numel() > 0;
  c10::NoGradGuard noGrad;
  ExactSquareSum sharded, replicated;
  bool communicate = false;
  for (const dtensor::ShardedParam& p : params) {
    const at::Tensor real = realRowsOf(p.grad, p.spec);
    if (p.spec.placement() == dtensor::Placement::kShard0 && p.spec.worldSize() > 1) {
      communicate = true;
      if (real.defined()) sharded.add(real);
    } else if (real.defined()) {
      replicated.add(real);
    }
  }
  at::Tensor all = sharded.digits();
  const int64_t digits = all.numel();
  if (alongside) all = at::cat({all, sumAlongside.reshape({-1})});
  if (communicate || alongside) distributed::allReduceHostTensor(comm, all, distributed::ReduceOp::kSum);
  if (alongside) sumAlongside.view({-1}).copy_(all.narrow(0, digits, sumAlongside.numel()));
  ExactSquareSum total = replicated;
  total.addDigits(all.narrow(0, 0, digits));
  return std::sqrt(total.value());
}

}  // namespace

double globalGradNorm(const std::vector<dtensor::ShardedParam>& params, distributed::Communicator& comm,
                      const at::Tensor& sumAlongside, bool exact) {
  if (exact) return exactGlobalGradNorm(params, comm, sumAlongside);
  const bool alongside = sumAlongside.defined() && sumAlongside.numel() > 0;
  TESSERA_CHECK_AS(UsageError, !alongside || (sumAlongside.scalar_type() == at::kDouble &&
                                              sumAlongside.device().is_cpu() && sumAlongside.is_contiguous()),
                   "globalGradNorm: the values summed alongside must be a contiguous CPU double tensor, got ",
                   sumAlongside.toString());
  c10::NoGradGuard noGrad;
  SquareSum sharded, replicated;
  bool communicate = false;
  for (const dtensor::ShardedParam& p : params) {
    const dtensor::ShardSpec& spec = p.spec;
    if (spec.placement() == dtensor::Placement::kShard0 && spec.worldSize() > 1) {
      TESSERA_CHECK(spec.worldSize() == comm.worldSize() && spec.rank() == comm.rank(), "globalGradNorm: spec ",
                    spec.str(), " is not over ", comm.describe());
      sharded.add(p.grad, spec);
      communicate = true;
    } else {
      replicated.add(p.grad, spec);
    }
  }
  double shardedTotal = 0.0;
  if (communicate) {
    // One all-reduce on the communicator's device (the GPU for nccl), one read back.
    const c10::Device where = comm.tensorDevice();
    at::Tensor sum = sharded.on(where);
    if (alongside) sum = at::cat({sum, sumAlongside.reshape({-1}).to(where)});
    comm.allReduce(sum, distributed::ReduceOp::kSum);
    const at::Tensor back = sum.cpu();
    shardedTotal = back[0].item<double>();
    if (alongside) sumAlongside.view({-1}).copy_(back.narrow(0, 1, sumAlongside.numel()));
  } else {
    shardedTotal = sharded.value();
    if (alongside) distributed::allReduceHostTensor(comm, sumAlongside, distributed::ReduceOp::kSum);
  }
  return std::sqrt(shardedTotal + replicated.value());
}

double clipCoefficient(double norm, double maxNorm) {
  if (maxNorm <= 0 || !std::isfinite(norm)) return 1.0;
  return std::min(1.0, maxNorm / (norm + 1e-6));
}

GradNorm clipGradNorm(const std::vector<dtensor::ShardedParam>& params, double maxNorm, distributed::Communicator& comm,
                      const at::Tensor& sumAlongside, bool exact) {
  GradNorm result;
  result.norm = globalGradNorm(params, comm, sumAlongside, exact);
  result.clipCoef = clipCoefficient(result.norm, maxNorm);
  if (result.clipCoef < 1.0) {
    c10::NoGradGuard noGrad;
    for (const dtensor::ShardedParam& p : params) {
      if (p.grad.defined()) p.grad.mul_(result.clipCoef);
    }
  }
  return result;
}

}  // namespace tessera::optim
