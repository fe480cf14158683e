// addBuiltinRecipes: each built-in recipe's configuration part with its training code.
#include "recipes/recipes.h"

namespace tessera::recipes {
namespace {

trainer::RecipeSpec withCode(const trainer::RecipeSpec& spec, std::unique_ptr<trainer::Recipe> (*make)(trainer::RunParts&)) {
  trainer::RecipeSpec full = spec;
  full.make = make;
  return full;
}

}  // namespace

void addBuiltinRecipes() {
  static const trainer::RecipeSpec standard = withCode(standardRecipeSpec(), makeStandardRecipe);
  static const trainer::RecipeSpec dmd = withCode(dmdRecipeSpec(), makeDmdRecipe);
  trainer::addRecipe(standard);
  trainer::addRecipe(dmd);
}

}  // namespace tessera::recipes
