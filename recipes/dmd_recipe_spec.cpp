// The dmd recipe's configuration (recipe_spec.h, dmd_recipe.h): a generator and a critic
// trained against a frozen teacher, all denoisers on one noise schedule.
#include <algorithm>

#include "common/config.h"
#include "common/errors.h"
#include "trainer/recipe_spec.h"
#include "recipes/recipes.h"
#include "trainer/train_config.h"

namespace tessera::recipes {
namespace {

constexpr const char* kRoles[] = {"generator", "critic", "teacher"};

// The schema of models: entry i (where its keys were set).
const config::ConfigSchema& entrySchema(const config::ConfigSchema& schema, size_t i) {
  return *schema.entries("models").at(i).second;
}

void checkRoles(const config::ConfigSchema& schema, const trainer::TrainConfig& c) {
  std::string have;
  for (const trainer::ModelEntry& m : c.models) have += (have.empty() ? "" : ", ") + m.name;
  for (const char* role : kRoles) {
    auto m = std::find_if(c.models.begin(), c.models.end(), [&](const trainer::ModelEntry& e) { return e.name == role; });
    if (c.singleModelForm || m == c.models.end()) {
      throw ConfigError(schema.errorMessage("run.recipe", strCat("dmd needs a model named '", role, "' under models: (the "
                                                                 "config has: ", c.singleModelForm ? "none" : have, ")")));
    }
    const config::ConfigSchema& entry = entrySchema(schema, static_cast<size_t>(m - c.models.begin()));
    const std::string p = strCat("models.", role, ".");
    if (!m->model.isDenoiser()) {
      throw ConfigError(entry.errorMessage(p + "arch", strCat("dmd's ", role, " is a denoiser: arch diffusion or dit, not ",
                                                              m->model.arch)));
    }
    if (m->model.arch != c.models.front().model.arch) {
      throw ConfigError(entry.errorMessage(p + "arch", strCat("dmd's models share one architecture: ", m->model.arch,
                                                              " here, ", c.models.front().model.arch, " for ",
                                                              c.models.front().name)));
    }
    const bool teacher = std::string(role) == "teacher";
    if (m->trainable == teacher) {
      throw ConfigError(entry.errorMessage(p + "trainable", teacher ? "dmd's teacher is frozen: trainable false"
                                                                    : strCat("dmd trains its ", role, ": trainable true")));
    }
  }
  for (size_t i = 0; i < c.models.size(); ++i) {
    const std::string& name = c.models[i].name;
    if (std::none_of(std::begin(kRoles), std::end(kRoles), [&](const char* r) { return name == r; })) {
      throw ConfigError(entrySchema(schema, i).errorMessage(
          "models." + name + ".trainable",
          strCat("dmd trains generator, critic and teacher; '", name, "' would never be used: remove it")));
    }
  }
}

void finishDmd(const config::ConfigSchema& schema, trainer::TrainConfig& c) {
  checkRoles(schema, c);
  trainer::ModelEntry& generator =
      *std::find_if(c.models.begin(), c.models.end(), [](const trainer::ModelEntry& e) { return e.name == "generator"; });
  // The generator's steps (DMD2's few-step generator): one step from pure noise unless the
  // config says otherwise. Its exports carry them, so tessera-sample samples as it trained.
  if (generator.model.sample_timesteps.empty()) generator.model.sample_timesteps = {generator.model.timesteps - 1};
  // One noise schedule: the critic's and the teacher's estimates are compared at the
  // generator's timesteps.
  for (size_t i = 0; i < c.models.size(); ++i) {
    const models::ModelOptions& m = c.models[i].model;
    if (m.timesteps != generator.model.timesteps || m.beta_start != generator.model.beta_start ||
        m.beta_end != generator.model.beta_end) {
      throw ConfigError(entrySchema(schema, i).errorMessage(
          "models." + c.models[i].name + ".timesteps",
          "timesteps, beta_start and beta_end must be the generator's (dmd compares the models' estimates at the "
          "same noise levels)"));
    }
  }
  if (c.recipe.min_t >= c.recipe.max_t) {
    throw ConfigError(schema.errorMessage("recipe.min_t", strCat(c.recipe.min_t, " is not below recipe.max_t (",
                                                                 c.recipe.max_t, ")")));
  }
  if (c.recipe.regression_weight > 0 && c.recipe.pair_steps > generator.model.timesteps) {
    throw ConfigError(schema.errorMessage("recipe.pair_steps", strCat(c.recipe.pair_steps, " is more than the teacher's ",
                                                                      generator.model.timesteps, " timesteps")));
  }
}

// The critic takes recipe.critic_steps updates per run step, and the run that saved a
// checkpoint may have had more than this one.
int64_t maxUpdates(const std::string& model) { return model == "critic" ? trainer::RecipeOptions::kMaxCriticSteps : 1; }

}  // namespace

const trainer::RecipeSpec& dmdRecipeSpec() {
  static const trainer::RecipeSpec spec{"dmd", "distribution-matching distillation of the models generator, critic and teacher",
                               finishDmd, maxUpdates, "generator", nullptr};
  return spec;
}

}  // namespace tessera::recipes
