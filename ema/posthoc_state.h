// A post-hoc EMA snapshot's trainer_state.json (ema/posthoc.h): which sigma_rel each
// power-function profile has, and which run wrote it. Parsed here on its own, without
// the checkpoint readers, so that it is fuzzed (fuzz/trainer_state_fuzz.cpp) as any file
// someone may hand over.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace tessera::ema {

// The snapshot's two keys, as posthocSnapshotState (ema/posthoc.h) writes them.
inline constexpr const char* kPosthocProfilesKey = "posthoc_profiles";
inline constexpr const char* kPosthocRunKey = "run";

struct PosthocState {
  std::vector<std::pair<std::string, double>> profiles;  // profile name -> sigma_rel
  std::string run;  // the run's identity as canonical JSON; "(none recorded)" when absent
};

// Throws checkpoint::CheckpointError naming `where`: not a JSON object, no non-empty
// "posthoc_profiles" object, a sigma_rel that is not a number in (0, kMaxPowerEmaStd),
// one that its profile's name contradicts ("..._phema0.05"), or a "run" that is not an
// object.
PosthocState parsePosthocState(const std::string& text, const std::string& where);

}  // namespace tessera::ema
