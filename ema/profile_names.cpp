// Names of EMA profiles (see profile_names.h).
#include "ema/profile_names.h"

#include <cstdio>

namespace tessera::ema {
namespace {

std::string percentG(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

}  // namespace

std::vector<EmaProfileName> emaProfileNames(const std::string& prefix, const std::vector<double>& decays,
                                            const std::vector<double>& powerStds) {
  std::vector<EmaProfileName> names;
  for (size_t d = 0; d < decays.size(); ++d) {
    const std::string alias = prefix + "_" + percentG(decays[d]);
    names.push_back({d == 0 ? prefix : alias, alias});
  }
  for (double sigma : powerStds) {
    const std::string alias = prefix + "_phema" + percentG(sigma);
    names.push_back({alias, alias});
  }
  return names;
}

}  // namespace tessera::ema
