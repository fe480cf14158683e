// What a recipe (run.recipe) asks of a run's configuration, apart from its training code
// (recipe.h): the models it trains, checked with the recipe's own keys when the config is
// loaded, and how many optimizer updates each model takes per run step. Each recipe owns
// its spec (standard_recipe_spec.cpp, dmd_recipe_spec.cpp); recipeSpec() finds one by name.
// Free of LibTorch models, so the config reader builds (and is fuzzed) without them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tessera::config {
class ConfigSchema;
}

namespace tessera::trainer {

struct TrainConfig;

struct RecipeSpec {
  const char* name;         // run.recipe
  const char* description;  // for the key's doc
  // ConfigError naming the key when the models (config.models, names set) or the recipe's
  // keys do not fit the recipe; then fills in the defaults that depend on the recipe (dmd:
  // the generator's sample_timesteps), so that exports record them.
  void (*finish)(const config::ConfigSchema& schema, TrainConfig& config);
  // The most optimizer updates `model` takes per run step in any run of the recipe: a
  // resumed checkpoint's step counts are checked against it.
  int64_t (*maxUpdatesPerRunStep)(const std::string& model);
};

const RecipeSpec& standardRecipeSpec();
const RecipeSpec& dmdRecipeSpec();

// Every recipe, run.recipe's choices.
const std::vector<const RecipeSpec*>& recipeSpecs();
// The recipe named `name` (tessera::ConfigError listing the recipes otherwise).
const RecipeSpec& recipeSpec(const std::string& name);

}  // namespace tessera::trainer
