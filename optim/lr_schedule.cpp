// Learning-rate schedules (see lr_schedule.h).
#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "common/errors.h"

namespace tessera::optim {

LrSchedule::LrSchedule(LrScheduleOptions o) : options_(std::move(o)) {
  const ScheduleKind k = options_.kind;
  TESSERA_CHECK_AS(ConfigError, options_.baseLr > 0, "LrSchedule: base lr must be > 0, got ", options_.baseLr);
  TESSERA_CHECK_AS(ConfigError, options_.warmupSteps >= 0, "LrSchedule: warmup steps must be >= 0");
  TESSERA_CHECK_AS(ConfigError, options_.minLr >= 0 && options_.minLr <= options_.baseLr,
                   "LrSchedule: min lr ", options_.minLr, " must be in [0, base lr ", options_.baseLr, "]");
  if (k == ScheduleKind::kCosine || k == ScheduleKind::kLinear) {
    TESSERA_CHECK_AS(ConfigError, options_.totalSteps > options_.warmupSteps, "LrSchedule: ",
                     enumName(kScheduleKindNames, k),
                     " decay needs total steps (", options_.totalSteps, ") > warmup steps (", options_.warmupSteps, ")");
  }
  if (k == ScheduleKind::kStep) {
    TESSERA_CHECK_AS(ConfigError, options_.stepSize >= 1, "LrSchedule: step size must be >= 1");
    TESSERA_CHECK_AS(ConfigError, options_.gamma > 0 && options_.gamma <= 1, "LrSchedule: gamma must be in (0, 1]");
  }
}

double LrSchedule::lrAt(int64_t step) const {
  const auto& o = options_;
  TESSERA_CHECK(step >= 0, "LrSchedule::lrAt: negative step ", step);
  if (step < o.warmupSteps) {
    return o.baseLr * static_cast<double>(step + 1) / static_cast<double>(o.warmupSteps);
  }
  const int64_t after = step - o.warmupSteps;
  if (o.kind == ScheduleKind::kConstant) return o.baseLr;
  if (o.kind == ScheduleKind::kStep) {
    return o.baseLr * std::pow(o.gamma, static_cast<double>(after / o.stepSize));
  }
  const double span = static_cast<double>(o.totalSteps - o.warmupSteps);
  const double t = std::min(1.0, static_cast<double>(after) / span);
  if (o.kind == ScheduleKind::kCosine) return o.minLr + (o.baseLr - o.minLr) * 0.5 * (1.0 + std::cos(M_PI * t));
  return o.baseLr + (o.minLr - o.baseLr) * t;  // linear
}

}  // namespace tessera::optim
