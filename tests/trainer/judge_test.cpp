// The sample judge's Frechet distance against closed forms: identical feature sets score
// 0, a shift by v scores |v|^2, isotropic spreads a and b in d dimensions score
// d (a - b)^2; inputs it cannot judge are refused. The per-class line's form.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

#include "common/errors.h"
#include "trainer/judge.h"

namespace tessera::trainer {
namespace {

TEST(FrechetDistanceTest, IdenticalSetsScoreZeroAndAShiftScoresItsSquaredLength) {
  const at::Tensor a = at::randn({400, 5}, at::kDouble);
  EXPECT_NEAR(frechetDistance(a, a), 0.0, 1e-9);
  const at::Tensor shift = at::tensor({1.0, -2.0, 0.5, 0.0, 3.0}, at::kDouble);
  EXPECT_NEAR(frechetDistance(a, a + shift), 1 + 4 + 0.25 + 9, 1e-9);
}

TEST(FrechetDistanceTest, IsotropicSpreadsScoreTheDimensionTimesTheirSquaredDifference) {
  // Whitened samples (covariance exactly I), then scaled: covariances a^2 I and b^2 I.
  at::Tensor x = at::randn({1000, 4}, at::kDouble);
  x = x - x.mean(0);
  const at::Tensor whitening = at::linalg_cholesky(at::cov(x.t())).inverse().t();
  x = x.matmul(whitening);
  EXPECT_NEAR(frechetDistance(2.0 * x, 0.5 * x), 4 * (2.0 - 0.5) * (2.0 - 0.5), 1e-6);
}

TEST(FrechetDistanceTest, RefusesTooFewSamplesOrDifferentWidths) {
  EXPECT_THROW(frechetDistance(at::randn({1, 3}), at::randn({5, 3})), Error);
  EXPECT_THROW(frechetDistance(at::randn({5, 3}), at::randn({5, 4})), Error);
}

// Samples gone to NaN (or inf) give a NaN distance, which the post-hoc sweep never keeps,
// not an exception from the eigendecomposition that would end the sweep.
TEST(FrechetDistanceTest, NonFiniteFeaturesScoreNaN) {
  const at::Tensor real = at::randn({50, 3}, at::kDouble);
  at::Tensor samples = at::randn({50, 3}, at::kDouble);
  samples[7][1] = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(std::isnan(frechetDistance(samples, real)));
  samples = at::full({50, 3}, std::numeric_limits<double>::infinity(), at::kDouble);
  EXPECT_TRUE(std::isnan(frechetDistance(real, samples)));
}

// The per-class line a user reads to find the class a model draws badly: every class asked
// for with its accuracy, and the classifier's own on real images where any were held out.
TEST(JudgementTest, PerClassTextNamesEveryClassWithItsScale) {
  Judgement j;
  j.perClass = {{0, 100, 0.97, 0.861}, {5, 100, 0.4, 0.97}, {9, 3, 1.0 / 3, -1}};
  EXPECT_EQ(perClassText(j), "per class asked for, accuracy (the classifier on real ones): 0 0.97 (0.86), 5 0.40 (0.97), 9 0.33");
}

}  // namespace
}  // namespace tessera::trainer
