// The fused tanh-approximated GELU (kernels/gelu.h) equals at::gelu(x, "tanh") forward and
// backward within float rounding, over the range where it matters and at its edges (large
// magnitudes, zero, NaN and infinities), on shapes that fill no vector evenly and on views.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/gelu.h"

namespace {

// Both against the double-precision formula: the fused kernel's error is of the order of
// LibTorch's own float computation (a few ulps of the largest values).
TEST(GeluTanhTest, ForwardAndBackwardEqualLibTorch) {
  at::manual_seed(9);
  for (const int64_t n : {1, 7, 8, 33, 100003, 100004}) {
    // The last: many inputs below -10, where the sigmoid is near the smallest normal float.
    const at::Tensor x0 = at::randn({n}) * (n == 100004 ? 20 : 4);
    const at::Tensor upstream = at::randn({n});
    at::Tensor x = x0.clone().requires_grad_(true), xRef = x0.clone().requires_grad_(true);
    at::Tensor xExact = x0.to(at::kDouble).requires_grad_(true);
    const at::Tensor y = tessera::kernels::geluTanh(x), yRef = at::gelu(xRef, "tanh"), yExact = at::gelu(xExact, "tanh");
    y.backward(upstream);
    yRef.backward(upstream);
    yExact.backward(upstream.to(at::kDouble));
    const auto error = [](const at::Tensor& got, const at::Tensor& exact) {
      return (got.to(at::kDouble) - exact).abs().max().item<double>();
    };
    const double scaleY = 1 + yExact.abs().max().item<double>(), scaleG = 1 + xExact.grad().abs().max().item<double>();
    EXPECT_LT(error(y, yExact), 1e-6 * scaleY) << n << ", LibTorch's: " << error(yRef, yExact);
    EXPECT_LT(error(x.grad(), xExact.grad()), 1e-6 * scaleG) << n << ", LibTorch's: " << error(xRef.grad(), xExact.grad());
    EXPECT_TRUE(at::allclose(y, yRef, 0, 2e-6 * scaleY)) << n;
    EXPECT_TRUE(at::allclose(x.grad(), xRef.grad(), 0, 2e-6 * scaleG)) << n;
  }
}

TEST(GeluTanhTest, EdgesAndNonFiniteValues) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const at::Tensor x = at::tensor({0.0f, -0.0f, 1e-30f, 30.0f, -30.0f, 1e4f, -1e4f, 3e38f, inf, nan});
  const at::Tensor y = tessera::kernels::geluTanh(x);
  const auto v = y.accessor<float, 1>();
  EXPECT_EQ(v[0], 0.0f);
  EXPECT_EQ(v[1], 0.0f);
  EXPECT_NEAR(v[2], 0.5e-30f, 1e-36f);
  EXPECT_FLOAT_EQ(v[3], 30.0f);
  EXPECT_NEAR(v[4], 0.0f, 1e-30f);
  EXPECT_FLOAT_EQ(v[5], 1e4f);
  EXPECT_NEAR(v[6], 0.0f, 1e-30f);
  EXPECT_FLOAT_EQ(v[7], 3e38f);
  EXPECT_EQ(v[8], inf);
  EXPECT_TRUE(std::isnan(v[9])) << "a NaN must reach the loss, where the trainer names it";
}

TEST(GeluTanhTest, ViewsAndOtherDtypesTakeTheirPath) {
  const at::Tensor x = at::randn({6, 10});
  const at::Tensor strided = x.t();  // not contiguous: copied, then fused
  EXPECT_TRUE(at::allclose(tessera::kernels::geluTanh(strided), at::gelu(strided, "tanh"), 2e-6, 1e-6));
  EXPECT_EQ(tessera::kernels::geluTanh(strided).sizes(), strided.sizes());
  const at::Tensor wide = x.to(at::kDouble);
  EXPECT_TRUE(at::equal(tessera::kernels::geluTanh(wide), at::gelu(wide, "tanh")));
}

// bf16 (sharding.param_dtype bf16's activations): the fused loop computes in fp32 and rounds
// once: against LibTorch's fp32 GELU of the widened input rounded to bf16, and no further
// from the exact result than LibTorch's own bf16 GELU, forward and backward, on lengths that
// fill no vector evenly; NaN stays the quiet NaN and +infinity is kept.
TEST(GeluTanhTest, Bf16IsTheFp32FunctionRoundedOnce) {
  at::manual_seed(10);
  for (const int64_t n : {1, 7, 8, 33, 100003}) {
    const at::Tensor x0 = (at::randn({n}) * 4).to(at::kBFloat16);
    const at::Tensor upstream = at::randn({n}).to(at::kBFloat16);
    const at::Tensor x = x0.clone().requires_grad_(true), xRef = x0.to(at::kFloat).requires_grad_(true);
    const at::Tensor y = tessera::kernels::geluTanh(x), yRef = at::gelu(xRef, "tanh");
    y.backward(upstream);
    yRef.backward(upstream.to(at::kFloat));
    ASSERT_EQ(y.scalar_type(), at::kBFloat16);
    ASSERT_EQ(x.grad().scalar_type(), at::kBFloat16);
    // Rounding to bf16 is off by half a bf16 step (2^-8 of the value) at most, and the two fp32
    // computations by 2e-6 of the largest value (the fp32 test's bound): together the most
    // the result may differ from LibTorch's fp32 one. Away from tiny values (where the fp32
    // difference is a sizeable part of the value) nearly all are the rounded reference itself.
    const auto check = [n](const at::Tensor& got, const at::Tensor& reference, const char* what) {
      const at::Tensor gotF = got.to(at::kFloat), bound = reference.abs() * (1.0 / 256) + 2e-6 * (1 + reference.abs().max());
      EXPECT_TRUE(((gotF - reference).abs() <= bound).all().item<bool>()) << what << " " << n;
      const at::Tensor sizeable = reference.abs() > 1e-2;
      const int64_t off = (got.ne(reference.to(at::kBFloat16)) & sizeable).sum().item<int64_t>();
      EXPECT_LE(off, std::max<int64_t>(1, sizeable.sum().item<int64_t>() / 100)) << what << " " << n;
    };
    check(y, yRef, "forward");
    check(x.grad(), xRef.grad(), "backward");
    // LibTorch's own bf16 GELU rounds its intermediates too (gelu(-3.06) comes out -0, not
    // -0.0030): the fused loop is never further from the exact (fp64) result than it.
    const at::Tensor exact = at::gelu(x0.to(at::kDouble), "tanh");
    const double ours = (y.to(at::kDouble) - exact).abs().max().item<double>();
    const double libtorch = (at::gelu(x0, "tanh").to(at::kDouble) - exact).abs().max().item<double>();
    EXPECT_LE(ours, libtorch) << n;
  }
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const at::Tensor edges = at::tensor({0.0f, 30.0f, -30.0f, 3e38f, inf, nan, 1.0f, -1.0f, 0.5f}).to(at::kBFloat16);
  const at::Tensor y = tessera::kernels::geluTanh(edges).to(at::kFloat);
  const auto v = y.accessor<float, 1>();
  EXPECT_EQ(v[0], 0.0f);
  EXPECT_EQ(v[1], 30.0f);
  EXPECT_NEAR(v[2], 0.0f, 1e-30f);
  EXPECT_EQ(v[3], at::tensor({3e38f}).to(at::kBFloat16).item<float>());
  EXPECT_EQ(v[4], inf);
  EXPECT_TRUE(std::isnan(v[5]));
  // NaN as c10::BFloat16 writes it: the quiet NaN 0x7FC0.
  const at::Tensor bits = tessera::kernels::geluTanh(edges).view(at::kShort);
  EXPECT_EQ(bits[5].item<int16_t>(), 0x7FC0);
  // The same rounding as c10::BFloat16 (round to nearest, ties to even) on ordinary values.
  const at::Tensor ordinary = edges.slice(/*dim=*/0, /*start=*/6);
  EXPECT_TRUE(at::equal(tessera::kernels::geluTanh(ordinary), at::gelu(ordinary.to(at::kFloat), "tanh").to(at::kBFloat16)));
}

}  // namespace
