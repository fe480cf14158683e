// libFuzzer target: the run config reader — YAML text through the trainer's schema, then
// `--set` overrides, the required-key check and the cross-field validation, as
// tessera-train does (models: entries included). Input: the YAML document, then optionally a NUL byte and one
// override per line; the input's length picks the world size (1-4).
// Only tessera::Error (ConfigError) may come out. What is accepted must resolve to YAML
// that loads back to the same resolved YAML (the run's config.resolved.yaml and the
// checkpoint's resolved_config are that text).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>

#include "common/config.h"
#include "common/errors.h"
#include "recipes/recipes.h"
#include "trainer/recipe_spec.h"
#include "trainer/train_config.h"

namespace {

std::string resolve(const std::string& yaml, const std::vector<std::string>& overrides, int world) {
  // The recipes' configuration parts alone: this build has no training code.
  static const bool recipesAdded = [] {
    tessera::trainer::addRecipe(tessera::recipes::standardRecipeSpec());
    tessera::trainer::addRecipe(tessera::recipes::dmdRecipeSpec());
    return true;
  }();
  (void)recipesAdded;
  tessera::trainer::TrainConfig config;
  tessera::config::ConfigSchema schema;
  tessera::trainer::bindTrainConfig(schema, config);
  schema.loadString(yaml, "fuzz.yaml");
  for (const auto& o : overrides) schema.applyOverride(o);
  tessera::trainer::finishTrainConfig(schema, config, world);
  return schema.toYaml();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string yaml = input.substr(0, nul);
  std::vector<std::string> overrides;
  if (nul != std::string::npos) {
    std::istringstream lines(input.substr(nul + 1));
    for (std::string line; std::getline(lines, line);) overrides.push_back(line);
  }
  const int world = 1 + static_cast<int>(size % 4);
  std::string resolved;
  try {
    resolved = resolve(yaml, overrides, world);
  } catch (const tessera::Error&) {
    return 0;  // refused with a message: the expected outcome for most inputs
  }
  try {
    if (resolve(resolved, {}, world) != resolved) std::abort();  // the resolved config does not round-trip
  } catch (const tessera::Error&) {
    std::abort();  // what was accepted no longer loads once written out
  }
  return 0;
}
