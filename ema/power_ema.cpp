// Power-function EMA math and post-hoc weights (see power_ema.h).
#include "ema/power_ema.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "common/errors.h"

namespace tessera::ema {

double powerEmaExponent(double sigmaRel) {
  TESSERA_CHECK_AS(ConfigError, validPowerEmaStd(sigmaRel), "power-function EMA: sigma_rel ", sigmaRel, " is not in [",
                   kMinPowerEmaStd, ", ", kMaxPowerEmaStd, ")");
  // f(g) = (g + 2)^2 (g + 3) - s (g + 1), s = sigma^-2, is the cubic of Algorithm 2. It is
  // convex for g > -7/3, and at g = sqrt(s) both f = 6s + 16 sqrt(s) + 12 and f' are
  // positive, so Newton's method from sqrt(s) descends monotonically onto the largest root.
  const double s = 1.0 / (sigmaRel * sigmaRel);
  double g = std::sqrt(s);
  for (int i = 0; i < 200; ++i) {
    const double f = (g + 2) * (g + 2) * (g + 3) - s * (g + 1);
    const double df = 3 * g * g + 14 * g + 16 - s;
    const double next = g - f / df;
    if (std::abs(next - g) <= 1e-15 * std::max(1.0, std::abs(g))) return next;
    g = next;
  }
  return g;
}

double powerEmaStd(double gamma) { return std::sqrt((gamma + 1) / ((gamma + 2) * (gamma + 2) * (gamma + 3))); }

double powerEmaBeta(double gamma, int64_t step) {
  TESSERA_CHECK(step >= 1, "power-function EMA: step ", step, " must be >= 1");
  return std::pow(1.0 - 1.0 / static_cast<double>(step), gamma + 1.0);
}

double powerProfileInnerProduct(double stepA, double gammaA, double stepB, double gammaB) {
  const double ratio = stepA / stepB;
  const double exponent = stepA < stepB ? gammaB : -gammaA;
  const double num = (gammaA + 1) * (gammaB + 1) * std::pow(ratio, exponent);
  const double den = (gammaA + gammaB + 1) * std::max(stepA, stepB);
  return num / den;
}

std::vector<double> posthocEmaWeights(const std::vector<PowerProfile>& stored, const PowerProfile& wanted) {
  const auto n = static_cast<int64_t>(stored.size());
  TESSERA_CHECK(n > 0, "post-hoc EMA: no stored profiles to combine");
  TESSERA_CHECK(wanted.step >= 1, "post-hoc EMA: wanted profile at step ", wanted.step);
  // Gram matrix of the stored profiles and their inner products with the wanted one, in
  // double precision (n = snapshots x profiles: tens to a few hundred).
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < i; ++j) {
      const auto& p = stored[static_cast<size_t>(i)];
      const auto& q = stored[static_cast<size_t>(j)];
      TESSERA_CHECK(p.step != q.step || p.gamma != q.gamma, "post-hoc EMA: the profile of gamma ", p.gamma,
                    " at step ", p.step, " is stored twice (the system would be singular)");
    }
  }
  at::Tensor gram = at::empty({n, n}, at::kDouble);
  at::Tensor rhs = at::empty({n, 1}, at::kDouble);
  auto g = gram.accessor<double, 2>();
  auto b = rhs.accessor<double, 2>();
  for (int64_t i = 0; i < n; ++i) {
    const auto& p = stored[static_cast<size_t>(i)];
    TESSERA_CHECK(p.step >= 1, "post-hoc EMA: stored profile at step ", p.step);
    for (int64_t j = 0; j < n; ++j) {
      const auto& q = stored[static_cast<size_t>(j)];
      g[i][j] = powerProfileInnerProduct(static_cast<double>(p.step), p.gamma, static_cast<double>(q.step), q.gamma);
    }
    b[i][0] = powerProfileInnerProduct(static_cast<double>(p.step), p.gamma, static_cast<double>(wanted.step),
                                       wanted.gamma);
  }
  at::Tensor solution;
  try {
    solution = at::linalg_solve(gram, rhs);
  } catch (const c10::Error& e) {
    throw Error(strCat("post-hoc EMA: the stored profiles are linearly dependent (a snapshot repeated?): ",
                       e.what_without_backtrace()));
  }
  std::vector<double> w(static_cast<size_t>(n));
  double sum = 0;
  const auto x = solution.accessor<double, 2>();
  for (int64_t i = 0; i < n; ++i) sum += (w[static_cast<size_t>(i)] = x[i][0]);
  TESSERA_CHECK(std::isfinite(sum) && sum != 0, "post-hoc EMA: the weights do not normalise (sum ", sum, ")");
  // How well the stored profiles express the wanted one: the least-squares residual
  // relative to the wanted profile's norm (0 when it is stored). Far outside the stored
  // sigma_rel values the fit degrades and the weights grow large and alternate.
  const double wanted2 = powerProfileInnerProduct(static_cast<double>(wanted.step), wanted.gamma,
                                                  static_cast<double>(wanted.step), wanted.gamma);
  const double residual2 = wanted2 - 2 * (solution.t().mm(rhs)).item<double>() +
                           (solution.t().mm(gram).mm(solution)).item<double>();
  const double fitError = std::sqrt(std::max(0.0, residual2) / wanted2);
  TESSERA_CHECK(std::isfinite(fitError) && fitError <= kMaxPosthocFitError, "post-hoc EMA: the stored profiles express "
                "the wanted one only to a relative error of ", fitError, " (more than ", kMaxPosthocFitError,
                "): ask for a sigma_rel nearer to the stored ones, or store profiles nearer to it");
  for (double& x : w) {
    x /= sum;
    TESSERA_CHECK(std::isfinite(x), "post-hoc EMA: a weight is not finite after normalising (sum ", sum, ")");
  }
  return w;
}

}  // namespace tessera::ema
