// The oneDNN matrix products (kernels/cpu_matmul.h) equal LibTorch's, forward and backward,
// for the shapes the models use and shapes that fit no kernel's blocking: inputs of 2 to 4
// dimensions, no bias, frozen weights, inputs without gradients, transposed (strided) views;
// in bf16 (setCpuLinearDtype) they equal fp32 products of the bf16-rounded operands.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <string>
#include <tuple>

#include "common/errors.h"
#include "kernels/cpu_matmul.h"

namespace {

using tessera::kernels::CpuMatmulPath;

// Equal to float rounding: sums of the same products in another order differ by a few
// ulps of the largest terms, so the tolerance scales with the result's magnitude.
void expectClose(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double scale = 1.0 + want.abs().max().item<double>();
  EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-5 * scale))
      << what << ": max difference " << (got - want).abs().max().item<double>() << " at scale " << scale;
}

TEST(CpuMatmulTest, OnednnIsThePathWhenBuiltWithIt) {
  if (!tessera::kernels::haveOnednn()) GTEST_SKIP() << "built without libdnnl-dev";
  EXPECT_EQ(tessera::kernels::cpuMatmulPath(), CpuMatmulPath::kOnednn);
  EXPECT_EQ(tessera::kernels::cpuMatmulPathName(CpuMatmulPath::kOnednn), "oneDNN sgemm");
}

class LinearShapes : public ::testing::TestWithParam<std::tuple<std::vector<int64_t>, int64_t, bool>> {};

TEST_P(LinearShapes, ForwardAndBackwardEqualLibTorch) {
  const auto& [inputShape, out, withBias] = GetParam();
  at::manual_seed(3);
  const int64_t in = inputShape.back();
  const at::Tensor x0 = at::randn(inputShape), w0 = at::randn({out, in}), b0 = at::randn({out});
  const at::Tensor upstream = at::randn(at::linear(x0, w0).sizes());
  auto run = [&](bool ours) {
    at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    at::Tensor b = withBias ? b0.clone().requires_grad_(true) : at::Tensor();
    const at::Tensor y = ours ? tessera::kernels::linear(x, w, b) : at::linear(x, w, b);
    y.backward(upstream);
    return std::make_tuple(y.detach(), x.grad(), w.grad(), withBias ? b.grad() : at::Tensor());
  };
  const auto [y, gx, gw, gb] = run(true);
  const auto [yRef, gxRef, gwRef, gbRef] = run(false);
  expectClose(y, yRef, "y");
  expectClose(gx, gxRef, "dx");
  expectClose(gw, gwRef, "dW");
  if (withBias) expectClose(gb, gbRef, "db");
}

INSTANTIATE_TEST_SUITE_P(Shapes, LinearShapes,
                         ::testing::Values(std::make_tuple(std::vector<int64_t>{7, 13}, int64_t{5}, true),
                                           std::make_tuple(std::vector<int64_t>{3, 49, 64}, int64_t{192}, true),
                                           std::make_tuple(std::vector<int64_t>{2, 3, 5, 17}, int64_t{33}, false),
                                           std::make_tuple(std::vector<int64_t>{1, 1}, int64_t{1}, true),
                                           std::make_tuple(std::vector<int64_t>{129, 257}, int64_t{65}, true)));

TEST(CpuMatmulTest, FrozenWeightsAndInputsWithoutGradients) {
  at::manual_seed(4);
  const at::Tensor x = at::randn({6, 10}), w = at::randn({4, 10}), b = at::randn({4});
  // A frozen layer (a distillation's teacher): the gradient reaches the input only.
  at::Tensor xg = x.clone().requires_grad_(true);
  tessera::kernels::linear(xg, w, b).sum().backward();
  expectClose(xg.grad(), at::ones({6, 4}).mm(w), "dx through a frozen layer");
  // Data that needs no gradient: the weights get theirs.
  at::Tensor wg = w.clone().requires_grad_(true);
  tessera::kernels::linear(x, wg, {}).sum().backward();
  expectClose(wg.grad(), at::ones({4, 6}).mm(x), "dW from data without gradients");
  // No gradient mode: a plain product.
  at::NoGradGuard noGrad;
  expectClose(tessera::kernels::linear(x, w, b), at::linear(x, w, b), "y without gradients");
}

TEST(CpuMatmulTest, BatchedProductsOfTransposedViewsEqualLibTorch) {
  at::manual_seed(5);
  // Attention's shapes: [batch, heads, tokens, head dim] and the keys' transposed view.
  const at::Tensor q0 = at::randn({3, 4, 49, 16}), k0 = at::randn({3, 4, 49, 16}), v0 = at::randn({3, 4, 49, 16});
  auto run = [&](bool ours) {
    at::Tensor q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true), v = v0.clone().requires_grad_(true);
    const auto mm = [&](const at::Tensor& a, const at::Tensor& b) {
      return ours ? tessera::kernels::batchedMatmul(a, b) : at::matmul(a, b);
    };
    const at::Tensor out = mm(at::softmax(mm(q, k.transpose(-2, -1)), -1), v);
    (out * out).sum().backward();
    return std::make_tuple(out.detach(), q.grad(), k.grad(), v.grad());
  };
  const auto [out, gq, gk, gv] = run(true);
  const auto [outRef, gqRef, gkRef, gvRef] = run(false);
  expectClose(out, outRef, "attention output");
  expectClose(gq, gqRef, "dq");
  expectClose(gk, gkRef, "dk");
  expectClose(gv, gvRef, "dv");
}

TEST(CpuMatmulTest, OtherTensorsTakeLibTorchsProduct) {
  // bf16 (LibTorch sends it to oneDNN itself) and double: LibTorch's own products, bit for bit.
  const at::Tensor x = at::randn({5, 8}), w = at::randn({3, 8});
  for (const auto dtype : {at::kBFloat16, at::kDouble}) {
    const at::Tensor xd = x.to(dtype), wd = w.to(dtype);
    EXPECT_TRUE(at::equal(tessera::kernels::linear(xd, wd, {}), at::linear(xd, wd))) << dtype;
  }
  // Mismatched shapes: LibTorch's error, naming the shapes.
  EXPECT_THROW(tessera::kernels::linear(x, at::randn({3, 7}), {}), c10::Error);
  EXPECT_THROW(tessera::kernels::batchedMatmul(at::randn({2, 3, 4}), at::randn({2, 5, 6})), c10::Error);
}

// The Linear products in bf16 for the scope of one test; fp32 again after it.
struct Bf16Linears {
  Bf16Linears() { tessera::kernels::setCpuLinearDtype(at::kBFloat16); }
  ~Bf16Linears() { tessera::kernels::setCpuLinearDtype(at::kFloat); }
};

at::Tensor roundedToBf16(const at::Tensor& t) { return t.to(at::kBFloat16).to(at::kDouble); }

// In bf16 the products are those of the operands rounded to bf16, accumulated in fp32 and
// returned in fp32: forward, dx (the output gradient rounded too), dW; the bias and its
// gradient stay fp32. The reference is the same rounded operands multiplied in double.
TEST_P(LinearShapes, InBf16EqualTheProductsOfBf16RoundedOperands) {
  const auto& [inputShape, out, withBias] = GetParam();
  at::manual_seed(6);
  const int64_t in = inputShape.back();
  const at::Tensor x0 = at::randn(inputShape), w0 = at::randn({out, in}), b0 = at::randn({out});
  const at::Tensor upstream = at::randn(at::linear(x0, w0).sizes());
  at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
  at::Tensor b = withBias ? b0.clone().requires_grad_(true) : at::Tensor();
  at::Tensor y;
  {
    Bf16Linears bf16;
    EXPECT_EQ(tessera::kernels::cpuLinearDtype(), at::kBFloat16);
    y = tessera::kernels::linear(x, w, b);
    y.backward(upstream);
  }
  EXPECT_EQ(y.scalar_type(), at::kFloat);
  EXPECT_EQ(w.grad().scalar_type(), at::kFloat);
  const at::Tensor xr = roundedToBf16(x0), wr = roundedToBf16(w0), gr = roundedToBf16(upstream);
  const at::Tensor yRef = at::linear(xr, wr, withBias ? b0.to(at::kDouble) : at::Tensor());
  // Where oneDNN has no bf16 kernel (below AVX-512) the product is LibTorch's bf16 one, whose
  // output is rounded to bf16 too.
  const double tolerance = tessera::kernels::haveOnednnBf16() ? 1e-5 : 1e-2;
  const auto close = [&](const at::Tensor& got, const at::Tensor& want, const std::string& what) {
    const double scale = 1.0 + want.abs().max().item<double>();
    EXPECT_TRUE(at::allclose(got.to(at::kDouble), want, tolerance, tolerance * scale))
        << what << ": max difference " << (got.to(at::kDouble) - want).abs().max().item<double>();
  };
  close(y, yRef, "y");
  const at::Tensor g2 = gr.reshape({-1, out});
  close(x.grad(), g2.mm(wr).view(x0.sizes()), "dx");
  close(w.grad(), g2.t().mm(xr.reshape({-1, in})), "dW");
  if (withBias) close(b.grad(), upstream.reshape({-1, out}).sum(0).to(at::kDouble), "db (fp32)");
  // And it is not the fp32 product: the rounding shows (so the path was taken).
  if (x0.numel() > 100) {
    EXPECT_GT((y - at::linear(x0, w0, withBias ? b0 : at::Tensor())).abs().max().item<double>(), 1e-4);
  }
}

TEST(CpuMatmulTest, Bf16LinearsLeaveOtherProductsAsTheyWere) {
  at::manual_seed(7);
  const at::Tensor x = at::randn({5, 8}), w = at::randn({3, 8});
  const at::Tensor q = at::randn({2, 4, 6}), k = at::randn({2, 6, 4});
  const at::Tensor fp32Attention = tessera::kernels::batchedMatmul(q, k);
  Bf16Linears bf16;
  // bf16 and double tensors: LibTorch's own products, bit for bit.
  for (const auto dtype : {at::kBFloat16, at::kDouble}) {
    const at::Tensor xd = x.to(dtype), wd = w.to(dtype);
    EXPECT_TRUE(at::equal(tessera::kernels::linear(xd, wd, {}), at::linear(xd, wd))) << dtype;
  }
  // Attention's products stay fp32.
  EXPECT_TRUE(at::equal(tessera::kernels::batchedMatmul(q, k), fp32Attention));
  // A shape mismatch is still LibTorch's error naming the shapes.
  EXPECT_THROW(tessera::kernels::linear(x, at::randn({3, 7}), {}), c10::Error);
  EXPECT_THROW(tessera::kernels::linear(x, w, at::randn({4})), c10::Error);
}

TEST(CpuMatmulTest, OnlyFp32AndBf16AreLinearDtypes) {
  EXPECT_THROW(tessera::kernels::setCpuLinearDtype(at::kHalf), tessera::ConfigError);
  EXPECT_EQ(tessera::kernels::cpuLinearDtype(), at::kFloat);
}

TEST(CpuMatmulTest, TheProbeMeasuresBothPaths) {
  EXPECT_GT(tessera::kernels::measureCpuBf16Flops(64, 64, 64, 0.01), 1e6);
  EXPECT_NE(tessera::kernels::bf16MatmulKernel(), "");
  if (tessera::kernels::haveOnednn()) {
    EXPECT_GT(tessera::kernels::measureCpuSgemmFlops(CpuMatmulPath::kOnednn, 64, 0.01), 1e6);
  }
  EXPECT_GT(tessera::kernels::measureCpuSgemmFlops(CpuMatmulPath::kAten, 64, 0.01), 1e6);
}

// The kernel bf16 products run on follows the core: oneDNN's AMX kernel where the core has AMX
// tiles (the Xeons of issue 45), its AVX512-BF16 one where the core has that; skipped where
// it has neither.
TEST(CpuMatmulTest, Bf16ProductsTakeTheCoresBf16Instructions) {
  if (!tessera::kernels::haveOnednnBf16()) GTEST_SKIP() << "oneDNN has no bf16 kernel for this core";
  const std::string kernel = tessera::kernels::bf16MatmulKernel();
  if (!tessera::kernels::coreHasBf16Instructions()) GTEST_SKIP() << "no bf16 instructions; bf16 products run on " << kernel;
  if (__builtin_cpu_supports("amx-bf16")) {
    // A kernel without AMX here means the OS did not grant the tiles (Linux >= 5.16 does).
    EXPECT_NE(kernel.find("amx"), std::string::npos) << kernel;
  } else {
    EXPECT_NE(kernel.find("avx512_core_bf16"), std::string::npos) << kernel;
  }
}

}  // namespace
