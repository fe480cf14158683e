// The recipes a run can name (see recipe_spec.h).
#include "trainer/recipe_spec.h"

#include <mutex>

#include "common/errors.h"

namespace tessera::trainer {
namespace {

struct Registry {
  std::mutex mutex;
  std::vector<const RecipeSpec*> specs;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void addRecipe(const RecipeSpec& spec) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const RecipeSpec*& known : r.specs) {
    if (std::string(known->name) == spec.name) {
      known = &spec;
      return;
    }
  }
  r.specs.push_back(&spec);
}

std::vector<const RecipeSpec*> recipeSpecs() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.specs;
}

const RecipeSpec& recipeSpec(const std::string& name) {
  const std::vector<const RecipeSpec*> specs = recipeSpecs();
  if (specs.empty()) {
    throw UsageError(strCat("run.recipe '", name, "': this program added no recipes (call "
                            "tessera::recipes::addBuiltinRecipes() or trainer::addRecipe() before loading a config)"));
  }
  std::string names;
  for (const RecipeSpec* spec : specs) {
    if (name == spec->name) return *spec;
    names += std::string(names.empty() ? "" : ", ") + spec->name;
  }
  throw ConfigError(strCat("run.recipe: unknown '", name, "' (", names, ")"));
}

}  // namespace tessera::trainer
