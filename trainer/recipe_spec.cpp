// The recipes a run can name (see recipe_spec.h).
#include "trainer/recipe_spec.h"

#include "common/errors.h"

namespace tessera::trainer {

const std::vector<const RecipeSpec*>& recipeSpecs() {
  static const std::vector<const RecipeSpec*> specs = {&standardRecipeSpec(), &dmdRecipeSpec()};
  return specs;
}

const RecipeSpec& recipeSpec(const std::string& name) {
  std::string names;
  for (const RecipeSpec* spec : recipeSpecs()) {
    if (name == spec->name) return *spec;
    names += std::string(names.empty() ? "" : ", ") + spec->name;
  }
  throw ConfigError(strCat("run.recipe: unknown '", name, "' (", names, ")"));
}

}  // namespace tessera::trainer
