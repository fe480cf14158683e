// The single-pass CPU loops against what they replace: fusedAdamStep bitwise equal to
// torch's single-tensor Adam / AdamW tensor operations (on this CPU), over sizes with an
// odd tail and split at an odd offset (an element's update must not depend on where it
// sits in a shard); squaredNorm against a double sum, the same on any thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>

#include "optim/cpu_kernels.h"

namespace tessera::optim {
namespace {

struct AdamState {
  at::Tensor p, g, m, v;
  AdamState clone() const { return {p.clone(), g.clone(), m.clone(), v.clone()}; }
};

AdamState randomState(int64_t n) {
  at::manual_seed(3);
  return {at::randn({n}), at::randn({n}) * 1e-3, at::randn({n}) * 1e-4, at::rand({n}) * 1e-6};
}

// torch 1.13's _single_tensor_adam(w) on one tensor, as its tensor operations.
void torchAdamStep(AdamState& s, bool decoupled, double lr, double wd, double b1, double b2, double eps, int64_t t) {
  at::Tensor grad = s.g;
  if (decoupled) {
    s.p.mul_(1.0 - lr * wd);
  } else {
    grad = grad.add(s.p, wd);
  }
  s.m.mul_(b1).add_(grad, 1.0 - b1);
  s.v.mul_(b2).addcmul_(grad, grad, 1.0 - b2);
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(t));
  const at::Tensor denom = (s.v.sqrt() / std::sqrt(bc2)).add_(eps);
  s.p.addcdiv_(s.m, denom, -lr / bc1);
}

AdamScalars scalarsOf(bool decoupled, double lr, double wd, double b1, double b2, double eps, int64_t t) {
  AdamScalars s;
  s.paramScale = static_cast<float>(decoupled ? 1.0 - lr * wd : 1.0);
  s.gradDecay = static_cast<float>(decoupled ? 0.0 : wd);
  s.beta1 = static_cast<float>(b1);
  s.oneMinusBeta1 = static_cast<float>(1.0 - b1);
  s.beta2 = static_cast<float>(b2);
  s.oneMinusBeta2 = static_cast<float>(1.0 - b2);
  s.sqrtBiasCorrection2 = static_cast<float>(std::sqrt(1.0 - std::pow(b2, static_cast<double>(t))));
  s.eps = static_cast<float>(eps);
  s.negStepSize = static_cast<float>(-lr / (1.0 - std::pow(b1, static_cast<double>(t))));
  return s;
}

void fusedOn(AdamState& s, int64_t begin, int64_t end, const AdamScalars& scalars) {
  fusedAdamStep(s.p.data_ptr<float>() + begin, s.g.data_ptr<float>() + begin, s.m.data_ptr<float>() + begin,
                s.v.data_ptr<float>() + begin, end - begin, scalars);
}

TEST(CpuKernelsTest, FusedAdamIsBitwiseTorchsTensorOperations) {
  constexpr int64_t kN = 2 * 65536 + 13;  // several parallel_for grains and an odd tail
  for (bool decoupled : {true, false}) {
    const double lr = 3e-3, wd = decoupled ? 0.1 : 0.01, b1 = 0.9, b2 = 0.99, eps = 1e-8;
    AdamState expected = randomState(kN);
    AdamState whole = expected.clone(), split = expected.clone();
    for (int64_t t = 1; t <= 3; ++t) {
      torchAdamStep(expected, decoupled, lr, wd, b1, b2, eps, t);
      const AdamScalars scalars = scalarsOf(decoupled, lr, wd, b1, b2, eps, t);
      fusedOn(whole, 0, kN, scalars);
      fusedOn(split, 0, 12345, scalars);  // as two shards split at an odd offset
      fusedOn(split, 12345, kN, scalars);
    }
    const char* name = decoupled ? "AdamW" : "Adam";
    EXPECT_TRUE(whole.p.equal(expected.p)) << name << ": max diff " << (whole.p - expected.p).abs().max().item<float>();
    EXPECT_TRUE(whole.m.equal(expected.m)) << name;
    EXPECT_TRUE(whole.v.equal(expected.v)) << name;
    EXPECT_TRUE(split.p.equal(whole.p) && split.m.equal(whole.m) && split.v.equal(whole.v)) << name;
  }
}

TEST(CpuKernelsTest, SquaredNormIsADoubleSumOnAnyThreadCount) {
  at::manual_seed(4);
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{65536}, int64_t{3 * 65536 + 5}}) {
    const at::Tensor x = at::randn({n});
    const double expected = n == 0 ? 0.0 : x.to(at::kDouble).square().sum().item<double>();
    const int threads = at::get_num_threads();
    at::set_num_threads(1);
    const double one = squaredNorm(x.data_ptr<float>(), n);
    at::set_num_threads(2);
    const double two = squaredNorm(x.data_ptr<float>(), n);
    at::set_num_threads(threads);
    EXPECT_NEAR(one, expected, 1e-12 * (1.0 + expected)) << n;
    EXPECT_EQ(one, two) << n << ": not the same on 1 and 2 threads";
  }
}

}  // namespace
}  // namespace tessera::optim
