// Parsing a post-hoc snapshot's trainer state (see posthoc_state.h).
#include "ema/posthoc_state.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <optional>

#include "checkpoint/format.h"
#include "common/errors.h"
#include "ema/power_ema.h"

namespace tessera::ema {
namespace {

// The sigma_rel a profile's name says ("generator_ema_phema0.05" -> 0.05), if it says one.
std::optional<double> sigmaInName(const std::string& name) {
  const size_t at = name.rfind("_phema");
  if (at == std::string::npos) return std::nullopt;
  const std::string digits = name.substr(at + 6);
  char* end = nullptr;
  const double value = std::strtod(digits.c_str(), &end);
  if (digits.empty() || end != digits.c_str() + digits.size()) return std::nullopt;
  return value;
}

}  // namespace

PosthocState parsePosthocState(const std::string& text, const std::string& where) {
  using checkpoint::CheckpointError;
  const nlohmann::json state = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!state.is_object() || !state.contains(kPosthocProfilesKey) || !state[kPosthocProfilesKey].is_object() ||
      state[kPosthocProfilesKey].empty()) {
    throw CheckpointError(strCat(where, ": not a post-hoc EMA snapshot (no '", kPosthocProfilesKey, "' object)"));
  }
  PosthocState out;
  for (const auto& [name, sigma] : state[kPosthocProfilesKey].items()) {
    if (!sigma.is_number() || !validPowerEmaStd(sigma.get<double>())) {
      throw CheckpointError(strCat(where, ": profile '", name, "' has sigma_rel ", sigma.dump(), ", not a number in [",
                                   kMinPowerEmaStd, ", ", kMaxPowerEmaStd, ")"));
    }
    const double value = sigma.get<double>();
    const std::optional<double> named = sigmaInName(name);
    if (named && !(std::abs(*named - value) <= 1e-5 * value)) {
      throw CheckpointError(strCat(where, ": profile '", name, "' has sigma_rel ", value, ", its name says ", *named));
    }
    out.profiles.emplace_back(name, value);
  }
  if (state.contains(kPosthocRunKey)) {
    if (!state[kPosthocRunKey].is_object()) throw CheckpointError(strCat(where, ": '", kPosthocRunKey, "' must be an object"));
    out.run = state[kPosthocRunKey].dump();
  } else {
    out.run = "(none recorded)";
  }
  return out;
}

}  // namespace tessera::ema
