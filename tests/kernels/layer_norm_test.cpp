// kernels::layerNorm (kernels/layer_norm.h): in bf16 on the CPU it equals LibTorch's fp32
// layer_norm of the widened input rounded to bf16, forward and backward, with and without the
// affine part, on rows that fill no vector evenly, on a transposed input and a transposed
// upstream gradient, and is no further from the exact result than LibTorch's own bf16 kernel;
// fp32 and other dtypes are at::layer_norm itself.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "kernels/layer_norm.h"

namespace {

struct Result {
  at::Tensor y, dx, dw, db;
};

// y, and the gradients of sum(y * upstream), of a layer norm `norm` over x (and weight, bias).
template <typename Norm>
Result run(const Norm& norm, const at::Tensor& x0, const at::Tensor& w0, const at::Tensor& b0, const at::Tensor& upstream) {
  const at::Tensor x = x0.detach().clone().requires_grad_(true);
  const at::Tensor w = w0.defined() ? w0.detach().clone().requires_grad_(true) : at::Tensor();
  const at::Tensor b = b0.defined() ? b0.detach().clone().requires_grad_(true) : at::Tensor();
  const at::Tensor y = norm(x, w, b);
  y.backward(upstream.to(y.scalar_type()));
  return {y.detach(), x.grad(), w.defined() ? w.grad() : at::Tensor(), b.defined() ? b.grad() : at::Tensor()};
}

// The largest difference between two bf16 results, in bf16 steps of the larger of the value
// and 1 (a normalised row's values are of order 1: near zero, a step of 1's binade).
double bf16Steps(const at::Tensor& got, const at::Tensor& reference) {
  const at::Tensor ref = reference.to(at::kDouble), diff = (got.to(at::kDouble) - ref).abs();
  return (diff / (ref.abs().clamp_min(1.0) * (1.0 / 128))).max().item<double>();
}

TEST(LayerNormTest, Bf16IsTheFp32KernelRoundedOnce) {
  at::manual_seed(3);
  for (const bool affine : {false, true}) {
    for (const int64_t width : {1, 7, 64, 129}) {
      const at::Tensor x = (at::randn({5, 3, width}) * 3 + 1).to(at::kBFloat16);
      const at::Tensor w = affine ? (at::randn({width}) + 1).to(at::kBFloat16) : at::Tensor();
      const at::Tensor b = affine ? at::randn({width}).to(at::kBFloat16) : at::Tensor();
      const at::Tensor upstream = at::randn({5, 3, width}).to(at::kBFloat16);
      const auto ours = [](auto x, auto w, auto b) { return tessera::kernels::layerNorm(x, w, b, 1e-6); };
      const Result got = run(ours, x, w, b, upstream);
      // The reference: the same input widened, LibTorch's fp32 kernels, each result rounded once.
      const auto widen = [](const at::Tensor& t) { return t.defined() ? t.to(at::kFloat) : t; };
      const Result fp32 = run([](auto x, auto w, auto b) { return at::layer_norm(x, {x.size(-1)}, w, b, 1e-6); },
                              widen(x), widen(w), widen(b), upstream.to(at::kFloat));
      ASSERT_EQ(got.y.scalar_type(), at::kBFloat16);
      ASSERT_EQ(got.dx.scalar_type(), at::kBFloat16);
      EXPECT_TRUE(at::equal(got.y, fp32.y.to(at::kBFloat16))) << width << (affine ? " affine" : "");
      EXPECT_TRUE(at::equal(got.dx, fp32.dx.to(at::kBFloat16))) << width << (affine ? " affine" : "");
      if (affine) {
        ASSERT_EQ(got.dw.scalar_type(), at::kBFloat16);
        EXPECT_TRUE(at::equal(got.dw, fp32.dw.to(at::kBFloat16))) << width;
        EXPECT_TRUE(at::equal(got.db, fp32.db.to(at::kBFloat16))) << width;
      }
      // Against the exact result (fp64): half a bf16 step at most (the one rounding), and no
      // further than LibTorch's own bf16 kernel, which rounds more often (up to 3.5 steps off
      // here, in the affine case).
      const auto exactOf = [](const at::Tensor& t) { return t.defined() ? t.to(at::kDouble) : t; };
      const at::Tensor exact = at::layer_norm(exactOf(x), {width}, exactOf(w), exactOf(b), 1e-6);
      const at::Tensor own = at::layer_norm(x, {width}, w, b, 1e-6);
      EXPECT_LE(bf16Steps(got.y, exact), 0.5 + 1e-3) << width << (affine ? " affine" : "");
      EXPECT_LE(bf16Steps(got.y, exact), bf16Steps(own, exact) + 1e-3) << width << (affine ? " affine" : "");
    }
  }
}

TEST(LayerNormTest, ViewsAndOtherDtypesTakeTheirPath) {
  at::manual_seed(4);
  const at::Tensor base = at::randn({9, 12});
  // A transposed bf16 view: normalised over its own last dimension.
  const at::Tensor view = base.to(at::kBFloat16).t();
  EXPECT_TRUE(at::equal(tessera::kernels::layerNorm(view, at::Tensor(), at::Tensor(), 1e-5),
                        at::layer_norm(view.to(at::kFloat), {9}, {}, {}, 1e-5).to(at::kBFloat16)));
  // An upstream gradient that is a transposed view (as a permute after the norm gives): the
  // same gradients as a contiguous copy of it.
  {
    const at::Tensor square = at::randn({16, 16}).to(at::kBFloat16);
    const at::Tensor w = (at::randn({16}) + 1).to(at::kBFloat16), b = at::randn({16}).to(at::kBFloat16);
    const at::Tensor upstream = at::randn({16, 16}).to(at::kBFloat16).t();
    ASSERT_FALSE(upstream.is_contiguous());
    const auto ours = [](auto x, auto w, auto b) { return tessera::kernels::layerNorm(x, w, b, 1e-5); };
    const Result viewed = run(ours, square, w, b, upstream), copied = run(ours, square, w, b, upstream.contiguous());
    EXPECT_TRUE(at::equal(viewed.dx, copied.dx));
    EXPECT_TRUE(at::equal(viewed.dw, copied.dw));
    EXPECT_TRUE(at::equal(viewed.db, copied.db));
  }
  // fp32 and fp64 are LibTorch's kernels, bit for bit.
  const at::Tensor w = at::randn({12}), b = at::randn({12});
  EXPECT_TRUE(at::equal(tessera::kernels::layerNorm(base, w, b, 1e-5), at::layer_norm(base, {12}, w, b, 1e-5)));
  const at::Tensor wide = base.to(at::kDouble);
  EXPECT_TRUE(at::equal(tessera::kernels::layerNorm(wide, {}, {}, 1e-5), at::layer_norm(wide, {12}, {}, {}, 1e-5)));
  // A weight of the wrong width is LibTorch's error, naming the shapes.
  try {
    const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
    (void)tessera::kernels::layerNorm(base.to(at::kBFloat16), at::ones({5}, bf16), at::zeros({5}, bf16), 1e-5);
    FAIL() << "a weight of 5 over rows of 12 was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("12"), std::string::npos) << e.what();
  }
}

}  // namespace
