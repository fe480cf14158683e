// Power-function EMA math against hand-computed references (EDM2's Algorithm 2 and Eq.
// 127), and the post-hoc weights of Algorithm 3: reconstructing a stored profile gives it
// back, and an intermediate sigma_rel reconstructed from stored snapshots matches a
// profile tracked directly, on a random-walk parameter trajectory.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "common/errors.h"
#include "ema/power_ema.h"

namespace tessera::ema {
namespace {

TEST(PowerEmaTest, ExponentForSigmaRelMatchesTheCubicsLargestRoot) {
  // The values EDM2 quotes (gamma = 16.97 and 6.94, to two decimals); the root itself
  // (16.9722, 6.9372) is checked against the cubic below.
  EXPECT_NEAR(powerEmaExponent(0.05), 16.97, 0.005);
  EXPECT_NEAR(powerEmaExponent(0.10), 6.94, 0.005);
  for (double sigma : {0.01, 0.05, 0.075, 0.10, 0.2, 0.27}) {
    const double g = powerEmaExponent(sigma);
    const double s = 1 / (sigma * sigma);
    EXPECT_NEAR(g * g * g + 7 * g * g + (16 - s) * g + (12 - s), 0.0, 1e-6 * s * g) << sigma;
    EXPECT_NEAR(powerEmaStd(g), sigma, 1e-12) << sigma;  // Eq. 123 inverts it
  }
  EXPECT_THROW(powerEmaExponent(0.0), ConfigError);
  EXPECT_THROW(powerEmaExponent(0.3), ConfigError);
  EXPECT_THROW(powerEmaExponent(std::nan("")), ConfigError);
}

TEST(PowerEmaTest, BetaOfTheFirstSteps) {
  const double g = powerEmaExponent(0.10);
  EXPECT_EQ(powerEmaBeta(g, 1), 0.0);  // the first update copies
  EXPECT_NEAR(powerEmaBeta(g, 2), std::pow(0.5, g + 1), 1e-15);
  EXPECT_NEAR(powerEmaBeta(g, 3), std::pow(2.0 / 3.0, g + 1), 1e-15);
  EXPECT_NEAR(powerEmaBeta(g, 10), std::pow(0.9, g + 1), 1e-15);
  EXPECT_NEAR(powerEmaBeta(16.97, 2), 3.8949e-6, 1e-9);  // (1/2)^17.97
  EXPECT_THROW(powerEmaBeta(g, 0), Error);
}

TEST(PowerEmaTest, InnerProductOfAProfileWithItself) {
  // <p, p> for p(tau) = (g + 1) tau^g / t^(g + 1) on [0, t]: (g + 1)^2 / ((2g + 1) t).
  for (double g : {6.94, 16.97}) {
    EXPECT_NEAR(powerProfileInnerProduct(100, g, 100, g), (g + 1) * (g + 1) / ((2 * g + 1) * 100), 1e-12);
  }
  // Symmetric.
  EXPECT_NEAR(powerProfileInnerProduct(50, 6.94, 80, 16.97), powerProfileInnerProduct(80, 16.97, 50, 6.94), 1e-15);
}

// A scalar-per-coordinate random walk: the "parameters" of steps 1..T.
std::vector<std::vector<double>> randomWalk(int steps, int dims) {
  std::mt19937 rng(3);
  std::normal_distribution<double> noise(0.0, 1.0);
  std::vector<std::vector<double>> p(static_cast<size_t>(steps) + 1, std::vector<double>(static_cast<size_t>(dims)));
  for (int t = 1; t <= steps; ++t) {
    for (int d = 0; d < dims; ++d) {
      p[t][d] = p[t - 1][d] + noise(rng) + 0.05 * std::sin(0.01 * t * (d + 1));
    }
  }
  return p;
}

// The tracked power EMA of sigma at every step (index t), as the manager computes it.
std::vector<std::vector<double>> tracked(const std::vector<std::vector<double>>& p, double sigma) {
  const double g = powerEmaExponent(sigma);
  std::vector<std::vector<double>> e(p.size(), std::vector<double>(p[0].size()));
  for (size_t t = 1; t < p.size(); ++t) {
    const double beta = powerEmaBeta(g, static_cast<int64_t>(t));
    for (size_t d = 0; d < p[t].size(); ++d) e[t][d] = beta * e[t - 1][d] + (1 - beta) * p[t][d];
  }
  return e;
}

double relativeError(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

TEST(PosthocEmaWeightsTest, AStoredProfileComesBackExactly) {
  std::vector<PowerProfile> stored;
  for (int64_t s = 100; s <= 1000; s += 100) {
    stored.push_back({s, powerEmaExponent(0.05)});
    stored.push_back({s, powerEmaExponent(0.10)});
  }
  const std::vector<double> w = posthocEmaWeights(stored, {1000, powerEmaExponent(0.10)});
  for (size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(w[i], i + 1 == w.size() ? 1.0 : 0.0, 1e-6) << i;
  EXPECT_THROW(posthocEmaWeights({}, {10, 5.0}), Error);
  EXPECT_THROW(posthocEmaWeights({{10, 5.0}, {10, 5.0}}, {10, 5.0}), Error);  // repeated snapshot
}

// Issue 36, class 1: a sigma_rel the stored profiles cannot express (the fit's relative
// error above kMaxPosthocFitError) is refused rather than combined with huge alternating
// weights; one they express well is not.
TEST(PosthocEmaWeightsTest, ASigmaTheSnapshotsCannotExpressIsRefused) {
  std::vector<PowerProfile> stored;
  for (int64_t s = 10; s <= 200; s += 10) {
    stored.push_back({s, powerEmaExponent(0.05)});
    stored.push_back({s, powerEmaExponent(0.10)});
  }
  EXPECT_NO_THROW(posthocEmaWeights(stored, {200, powerEmaExponent(0.02)}));  // fits to 0.087
  EXPECT_NO_THROW(posthocEmaWeights(stored, {200, powerEmaExponent(0.25)}));  // 0.059
  try {
    posthocEmaWeights(stored, {200, powerEmaExponent(0.01)});  // 0.30
    ADD_FAILURE() << "sigma_rel 0.01 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("relative error"), std::string::npos) << e.what();
  }
  EXPECT_THROW(posthocEmaWeights(stored, {200, powerEmaExponent(0.27)}), Error);  // 0.118
}

// The tolerance the issue asks to measure: 20 snapshots (every 100 of 2000 steps) of
// sigma_rel 0.05 and 0.10; sigma_rel 0.075 reconstructed at the last step against the
// profile tracked directly: relative L2 error 4.8e-5 on this trajectory (printed), bound
// at 1e-3. Reconstructing 0.05 at the last step returns the stored one (1e-6).
TEST(PosthocEmaWeightsTest, IntermediateSigmaMatchesADirectlyTrackedProfile) {
  const int steps = 2000, dims = 64;
  const auto p = randomWalk(steps, dims);
  const auto e05 = tracked(p, 0.05), e10 = tracked(p, 0.10), e075 = tracked(p, 0.075);
  std::vector<PowerProfile> stored;
  std::vector<const std::vector<double>*> values;
  for (int s = 100; s <= steps; s += 100) {
    stored.push_back({s, powerEmaExponent(0.05)});
    values.push_back(&e05[static_cast<size_t>(s)]);
    stored.push_back({s, powerEmaExponent(0.10)});
    values.push_back(&e10[static_cast<size_t>(s)]);
  }
  auto combine = [&](const std::vector<double>& w) {
    std::vector<double> out(dims, 0.0);
    for (size_t i = 0; i < w.size(); ++i) {
      for (int d = 0; d < dims; ++d) out[d] += w[i] * (*values[i])[d];
    }
    return out;
  };
  const double mid = relativeError(combine(posthocEmaWeights(stored, {steps, powerEmaExponent(0.075)})), e075[steps]);
  std::printf("post-hoc sigma_rel 0.075 from 20 snapshots of 0.05 and 0.10: relative L2 error %.4g\n", mid);
  EXPECT_LT(mid, 1e-3);
  EXPECT_LT(relativeError(combine(posthocEmaWeights(stored, {steps, powerEmaExponent(0.05)})), e05[steps]), 1e-6);
}

}  // namespace
}  // namespace tessera::ema
