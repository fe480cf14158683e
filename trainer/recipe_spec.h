// A recipe (run.recipe) as the trainer finds it by name: its own keys (bound into a
// struct of its own), what it asks of a run's configuration (the models it trains, checked
// with those keys when the config is loaded), how many optimizer updates each model takes per run step, and how to build
// its training code (recipe.h) over a run's parts. The trainer names no recipe but the
// default of run.recipe ("standard"): each recipe owns its spec (recipes/), and a program
// adds the ones it offers with addRecipe()
// before it loads a config (recipes::addBuiltinRecipes() adds standard and dmd), as
// torchtitan registers its train specs. Free of LibTorch models, so the config reader
// builds (and is fuzzed) without them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tessera::config {
class ConfigSchema;
}

namespace tessera::trainer {

struct TrainConfig;
struct RunParts;
class Recipe;

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
  // The model whose EMA draws model.samples at the end of a run (a denoiser with an EMA).
  const char* samplingModel;
  // The recipe's training code over the parts of a run set up for it (null in builds of
  // the config reader alone, such as the fuzzers').
  std::unique_ptr<Recipe> (*make)(RunParts& run);
  // Registers the recipe's own keys (recipe.*) with the schema, bound into a struct of its
  // own that `config` keeps for it (trainer::recipeOptions); null: it has none.
  void (*bindKeys)(config::ConfigSchema& schema, TrainConfig& config) = nullptr;
  // Whether its samplingModel's samples can be judged at the end (eval.judge: its
  // Recipe::judgeSamples does so).
  bool judgesSamples = false;
};

// Adds `spec` to run.recipe's choices; adding a name again replaces its spec. Thread-safe;
// the spec must outlive its use (a function-local static).
void addRecipe(const RecipeSpec& spec);

// Every recipe added, run.recipe's choices, in the order they were added.
std::vector<const RecipeSpec*> recipeSpecs();
// The recipe named `name` (tessera::ConfigError listing the recipes otherwise, or saying
// that the program added none).
const RecipeSpec& recipeSpec(const std::string& name);

}  // namespace tessera::trainer
