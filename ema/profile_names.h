// The names an EMA profile answers to, from the options alone (no tensors): the
// manager names its state with them, and a config is checked against them before a run
// starts (checkpoint.export: [generator_ema_0.9] with decays [0.99] is a config error,
// not a failure after training).
#pragma once

#include <string>
#include <vector>

namespace tessera::ema {

// The name of an EMA when its program picks none (EmaOptions::prefix): timm's and
// AveragedModel users' "model_ema". The trainer names each EMA after its model
// (trainer/train_config.h, ModelStateNames).
inline constexpr char kDefaultEmaPrefix[] = "model_ema";

struct EmaProfileName {
  std::string state;  // where its tensors live in checkpoints: "<prefix>" for the first decay
  std::string alias;  // "<prefix>_<decay>" (%g) or "<prefix>_phema<sigma_rel>" (%g)
};

// One entry per profile: the decays in order, then the power-function profiles.
std::vector<EmaProfileName> emaProfileNames(const std::string& prefix, const std::vector<double>& decays,
                                            const std::vector<double>& powerStds);

}  // namespace tessera::ema
