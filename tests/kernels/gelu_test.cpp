// The fused tanh-approximated GELU (kernels/gelu.h) equals at::gelu(x, "tanh") forward and
// backward within float rounding, over the range where it matters and at its edges (large
// magnitudes, zero, NaN and infinities), on shapes that fill no vector evenly and on views.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

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
  const at::Tensor half = x.to(at::kBFloat16), wide = x.to(at::kDouble);
  EXPECT_TRUE(at::equal(tessera::kernels::geluTanh(half), at::gelu(half, "tanh")));
  EXPECT_TRUE(at::equal(tessera::kernels::geluTanh(wide), at::gelu(wide, "tanh")));
}

}  // namespace
