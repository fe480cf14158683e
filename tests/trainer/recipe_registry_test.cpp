// run.recipe's choices: the trainer names no recipe, a program adds the ones it offers
// (recipe_spec.h). Every test of this suite runs with the built-in recipes added, as
// tessera-train does before it loads a config.
#include <gtest/gtest.h>

#include <string>

#include "common/errors.h"
#include "recipes/recipes.h"
#include "trainer/recipe_spec.h"

namespace tessera::trainer {
namespace {

class BuiltinRecipes : public ::testing::Environment {
 public:
  void SetUp() override { recipes::addBuiltinRecipes(); }
};
[[maybe_unused]] ::testing::Environment* const kBuiltinRecipes =
    ::testing::AddGlobalTestEnvironment(new BuiltinRecipes);

TEST(RecipeRegistryTest, BuiltinRecipesComeWithTheirTrainingCode) {
  for (const char* name : {"standard", "dmd"}) {
    const RecipeSpec& spec = recipeSpec(name);
    EXPECT_EQ(std::string(spec.name), name);
    EXPECT_NE(spec.make, nullptr) << name;
    EXPECT_NE(spec.finish, nullptr) << name;
  }
  // The configuration parts alone carry no code (what the fuzzers' build adds).
  EXPECT_EQ(recipes::standardRecipeSpec().make, nullptr);
}

TEST(RecipeRegistryTest, AddingANameAgainReplacesItsSpec) {
  const size_t before = recipeSpecs().size();
  recipes::addBuiltinRecipes();
  EXPECT_EQ(recipeSpecs().size(), before);
  // A program's own spec under a built-in name takes its place (and gives it back).
  static const RecipeSpec mine{"standard", "a user's standard recipe", recipes::standardRecipeSpec().finish,
                               recipes::standardRecipeSpec().maxUpdatesPerRunStep, "model", recipes::makeStandardRecipe};
  addRecipe(mine);
  EXPECT_EQ(&recipeSpec("standard"), &mine);
  EXPECT_EQ(recipeSpecs().size(), before);
  recipes::addBuiltinRecipes();
  EXPECT_NE(&recipeSpec("standard"), &mine);
  try {
    recipeSpec("gan");
    FAIL() << "an unknown recipe was found";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown 'gan' (standard, dmd)"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera::trainer
