// Power-function EMA and its post-hoc reconstruction (EDM2: Karras et al., "Analyzing and
// Improving the Training Dynamics of Diffusion Models", 2024, Sec. 3 and App. C): the math
// only, no tensors. docs/ema.md explains the quantities.
//
// A power-function EMA profile of relative standard deviation sigma_rel (its width
// relative to the training time so far) averages the parameters of steps tau <= t with
// weights proportional to tau^gamma. It is tracked exactly like a classic EMA, with a
// blend that depends on the step: e = beta_t * e + (1 - beta_t) * p.
#pragma once

#include <cstdint>
#include <vector>

namespace tessera::ema {

// sigma_rel must lie in [kMinPowerEmaStd, kMaxPowerEmaStd): a larger one would need
// gamma <= 0; below the least, sigma^-2 overflows (1e-160: inf, then a NaN gamma and an
// all-NaN EMA), and long before that the profile is the current weights (1e-6: gamma
// about 1e6, so the blend keeps (1 - 1/t)^1e6 of the past: nothing, for t < 1e5).
constexpr double kMinPowerEmaStd = 1e-6;
constexpr double kMaxPowerEmaStd = 0.28;
// Whether sigmaRel is in that range (false for NaN); the one check every reader makes.
inline bool validPowerEmaStd(double sigmaRel) { return sigmaRel >= kMinPowerEmaStd && sigmaRel < kMaxPowerEmaStd; }
// The largest relative error (in profile space) of a post-hoc reconstruction's fit that
// posthocEmaWeights accepts: with two stored sigma_rel of 0.05 and 0.10 every 10 of 200
// steps, sigma_rel 0.02 fits to 0.087 and 0.01 to 0.30 (refused).
constexpr double kMaxPosthocFitError = 0.1;

// gamma for sigma_rel (Algorithm 2): the largest real root of
// gamma^3 + 7 gamma^2 + (16 - sigma^-2) gamma + (12 - sigma^-2). Throws ConfigError
// outside (0, kMaxPowerEmaStd). 0.05 -> 16.97, 0.10 -> 6.94.
double powerEmaExponent(double sigmaRel);
// sigma_rel of exponent gamma (Eq. 123): sqrt((gamma + 1) / ((gamma + 2)^2 (gamma + 3))).
double powerEmaStd(double gamma);
// The blend at optimizer step t (1-based; Eq. 127): (1 - 1/t)^(gamma + 1). Step 1 gives 0:
// the first update copies the parameters.
double powerEmaBeta(double gamma, int64_t step);

// Inner product of the normalised power-function profiles (stepA, gammaA) and (stepB,
// gammaB) (Eq. 151), the profiles ending at the given steps.
double powerProfileInnerProduct(double stepA, double gammaA, double stepB, double gammaB);

// One stored average: its step and exponent.
struct PowerProfile {
  int64_t step = 0;
  double gamma = 0;
};

// Algorithm 3: the weights w (one per stored profile) such that sum_i w_i * profile_i is
// the least-squares best approximation of the profile (step, gamma) — solve the Gram
// system (at::linalg_solve), then normalise the weights to sum 1. Throws Error when the
// stored profiles are linearly dependent (two identical), or none, or express the wanted
// one only to a relative error above kMaxPosthocFitError, or a weight is not finite.
std::vector<double> posthocEmaWeights(const std::vector<PowerProfile>& stored, const PowerProfile& wanted);

}  // namespace tessera::ema
