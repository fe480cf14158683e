// The built-in recipes (run.recipe): standard (standard_recipe.cpp) and dmd
// (dmd_recipe.h). A program that trains calls addBuiltinRecipes() once before it loads a
// config; the specs alone (no training code: RecipeSpec::make null) serve builds of the
// config reader, such as the fuzzers'.
#pragma once

#include <memory>

#include "trainer/recipe.h"
#include "trainer/recipe_spec.h"

namespace tessera::recipes {

// Adds standard and dmd, with their training code, to run.recipe's choices (addRecipe).
void addBuiltinRecipes();

// The recipes' configuration parts (make: null).
const trainer::RecipeSpec& standardRecipeSpec();
const trainer::RecipeSpec& dmdRecipeSpec();

// Their training code over a run's parts.
std::unique_ptr<trainer::Recipe> makeStandardRecipe(trainer::RunParts& run);
std::unique_ptr<trainer::Recipe> makeDmdRecipe(trainer::RunParts& run);

}  // namespace tessera::recipes
