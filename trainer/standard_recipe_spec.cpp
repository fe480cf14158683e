// The standard recipe's configuration (recipe_spec.h): the single model, trained on the data.
#include "common/config.h"
#include "common/errors.h"
#include "trainer/recipe_spec.h"
#include "trainer/train_config.h"

namespace tessera::trainer {
namespace {

void finishStandard(const config::ConfigSchema& schema, TrainConfig& config) {
  if (!config.singleModelForm) {
    throw ConfigError(schema.errorMessage("run.recipe", "standard trains the single model: section; a models: map "
                                                        "needs a recipe that trains several (dmd)"));
  }
}

int64_t oneUpdate(const std::string&) { return 1; }

}  // namespace

const RecipeSpec& standardRecipeSpec() {
  static const RecipeSpec spec{"standard", "the model on the data", finishStandard, oneUpdate};
  return spec;
}

}  // namespace tessera::trainer
