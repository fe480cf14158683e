// The standard recipe's configuration (recipe_spec.h): the single model, trained on the data.
// Its training code is added by addBuiltinRecipes (recipes.cpp).
#include "common/config.h"
#include "common/errors.h"
#include "trainer/recipe_spec.h"
#include "recipes/recipes.h"
#include "trainer/train_config.h"

namespace tessera::recipes {
namespace {

void finishStandard(const config::ConfigSchema& schema, trainer::TrainConfig& config) {
  if (!config.singleModelForm) {
    throw ConfigError(schema.errorMessage("run.recipe", "standard trains the single model: section; a models: map "
                                                        "needs a recipe that trains several (dmd)"));
  }
}

int64_t oneUpdate(const std::string&) { return 1; }

}  // namespace

const trainer::RecipeSpec& standardRecipeSpec() {
  static const trainer::RecipeSpec spec{"standard", "the model on the data", finishStandard, oneUpdate, "model",
                                        nullptr, /*bindKeys=*/nullptr, /*judgesSamples=*/true};
  return spec;
}

}  // namespace tessera::recipes
