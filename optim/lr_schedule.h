// Learning-rate schedules: constant; linear warmup then cosine or linear decay to
// min_lr; step decay. A schedule is a pure function of the step, so its checkpointable
// state is just its options and the step counter the trainer already saves.
#pragma once

#include <cstdint>
#include <string>

#include "common/enum_names.h"

namespace tessera::optim {

enum class ScheduleKind { kConstant, kCosine, kLinear, kStep };
inline constexpr std::array<EnumName<ScheduleKind>, 4> kScheduleKindNames = {{{"constant", ScheduleKind::kConstant},
                                                                              {"cosine", ScheduleKind::kCosine},
                                                                              {"linear", ScheduleKind::kLinear},
                                                                              {"step", ScheduleKind::kStep}}};

struct LrScheduleOptions {
  ScheduleKind kind = ScheduleKind::kConstant;
  double baseLr = 3e-4;
  int64_t warmupSteps = 0;        // linear ramp up to baseLr over these steps (see lrAt)
  int64_t totalSteps = 1;         // decay ends here (cosine, linear)
  double minLr = 0.0;             // floor of cosine and linear decay
  int64_t stepSize = 1;           // step decay: multiply by gamma every stepSize steps
  double gamma = 0.1;             // step decay factor
};

class LrSchedule {
 public:
  // Throws tessera::ConfigError for inconsistent options.
  explicit LrSchedule(LrScheduleOptions options);

  // Learning rate for optimizer step `step` (0-based: the lr the step-th update uses).
  // Warmup: lr = baseLr * (step + 1) / warmupSteps for step < warmupSteps, so the
  // first update already moves and step warmupSteps-1 reaches baseLr.
  // Cosine: minLr + (baseLr - minLr) * (1 + cos(pi * t)) / 2, t = progress after warmup
  // in [0, 1] over totalSteps - warmupSteps; linear: baseLr + (minLr - baseLr) * t.
  // Step: baseLr * gamma^floor((step - warmupSteps) / stepSize).
  double lrAt(int64_t step) const;


 private:
  LrScheduleOptions options_;
};

}  // namespace tessera::optim
