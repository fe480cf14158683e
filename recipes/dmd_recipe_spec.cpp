// The dmd recipe's configuration (recipe_spec.h, dmd_recipe.h): a generator and a critic
// trained against a frozen teacher, all denoisers on one noise schedule.
#include <algorithm>
#include <utility>

#include "common/config.h"
#include "common/errors.h"
#include "common/limits.h"
#include "models/model_options.h"
#include "recipes/dmd_options.h"
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
  const DmdOptions& dmd = trainer::recipeOptions<DmdOptions>(std::as_const(c), kDmdRecipe);
  trainer::ModelEntry& generator =
      *std::find_if(c.models.begin(), c.models.end(), [](const trainer::ModelEntry& e) { return e.name == "generator"; });
  // The generator's steps (DMD2's few-step generator): one step from pure noise unless the
  // config says otherwise. Its exports carry them, so tessera-sample samples as it trained.
  if (generator.model.sample_timesteps.empty()) generator.model.sample_timesteps = {generator.model.timesteps - 1};
  // One noise schedule: the critic's and the teacher's estimates are compared at the
  // generator's timesteps.
  for (size_t i = 0; i < c.models.size(); ++i) {
    const models::ModelOptions& m = c.models[i].model;
    const models::ModelOptions& g = generator.model;
    const char* differs = m.timesteps != g.timesteps             ? "timesteps"
                          : m.beta_start != g.beta_start         ? "beta_start"
                          : m.beta_end != g.beta_end             ? "beta_end"
                          : m.noise_schedule != g.noise_schedule ? "noise_schedule"
                          : m.zero_terminal_snr != g.zero_terminal_snr ? "zero_terminal_snr"
                                                                       : nullptr;
    if (differs != nullptr) {
      throw ConfigError(entrySchema(schema, i).errorMessage(
          "models." + c.models[i].name + "." + differs,
          "timesteps, beta_start, beta_end, noise_schedule and zero_terminal_snr must be the generator's (dmd "
          "compares the models' estimates at the same noise levels)"));
    }
  }
  // DMD2's GAN term: the head is part of the critic, made with it (sharded, checkpointed
  // and exported with its other weights).
  trainer::ModelEntry& critic =
      *std::find_if(c.models.begin(), c.models.end(), [](const trainer::ModelEntry& e) { return e.name == "critic"; });
  if (dmd.gan()) {
    if (dmd.gan_block >= critic.model.layers) {
      throw ConfigError(schema.errorMessage("recipe.gan_block", strCat(dmd.gan_block, " is not a block of the critic (",
                                                                       critic.model.layers,
                                                                       " layers, counted from 0; -1: the middle)")));
    }
    if (dmd.gan_critic_weight <= 0) {
      throw ConfigError(schema.errorMessage("recipe.gan_critic_weight",
                                            "must be > 0 with recipe.gan_weight > 0: the head that judges the "
                                            "generator's samples learns only from it"));
    }
    critic.model.gan_head_block = dmd.gan_block >= 0 ? dmd.gan_block : (critic.model.layers - 1) / 2;
  } else {
    critic.model.gan_head_block = -1;
  }
  if (dmd.gan() && dmd.gan_min_t >= dmd.gan_max_t) {
    throw ConfigError(schema.errorMessage("recipe.gan_min_t", strCat(dmd.gan_min_t, " is not below recipe.gan_max_t (",
                                                                     dmd.gan_max_t, ")")));
  }
  if (dmd.min_t >= dmd.max_t) {
    throw ConfigError(schema.errorMessage("recipe.min_t", strCat(dmd.min_t, " is not below recipe.max_t (",
                                                                 dmd.max_t, ")")));
  }
  const std::string interval = models::guidanceIntervalProblem(dmd.guidance_interval, generator.model.timesteps);
  if (!interval.empty()) throw ConfigError(schema.errorMessage("recipe.guidance_interval", interval));
  if (dmd.regression_weight > 0 && dmd.pair_steps > generator.model.timesteps) {
    throw ConfigError(schema.errorMessage("recipe.pair_steps", strCat(dmd.pair_steps, " is more than the teacher's ",
                                                                      generator.model.timesteps, " timesteps")));
  }
}

// The critic takes recipe.critic_steps updates per run step, and the run that saved a
// checkpoint may have had more than this one.
int64_t maxUpdates(const std::string& model) { return model == "critic" ? DmdOptions::kMaxCriticSteps : 1; }

// recipe.*: bound into the DmdOptions the config keeps for dmd.
void bindDmdKeys(config::ConfigSchema& s, trainer::TrainConfig& c) {
  DmdOptions& recipe = trainer::recipeOptions<DmdOptions>(c, kDmdRecipe);
  s.describeSection("recipe", "run.recipe dmd: distribution-matching distillation");
  s.add("recipe.critic_steps", &recipe.critic_steps, "Critic updates per generator update")
      .min(1)
      .max(DmdOptions::kMaxCriticSteps);
  s.add("recipe.min_t", &recipe.min_t,
        "The generator's samples are noised at a timestep drawn in [min_t, max_t] x model.timesteps")
      .min(0.0).lessThan(1.0);
  s.add("recipe.max_t", &recipe.max_t, "Upper end of that range").greaterThan(0.0).max(1.0);
  s.add("recipe.regression_weight", &recipe.regression_weight,
        "Weight of DMD's regression loss: the generator's sample of a fixed noise against the teacher's "
        "deterministic (DDIM) sample of it, which keeps every mode covered (0: off)")
      .min(0.0).max(1000.0);
  s.add("recipe.regression_pairs", &recipe.regression_pairs,
        "Noise -> teacher sample pairs the regression loss uses (made once when the run starts)")
      .min(1).max(1 << 20);
  s.add("recipe.pair_steps", &recipe.pair_steps, "DDIM steps the teacher takes for each pair (at most model.timesteps)")
      .min(1).max(kMaxWidth);
  s.add("recipe.guidance", &recipe.guidance,
        "Class-conditional models (dit): the teacher's classifier-free guidance scale, in the real score and the "
        "regression pairs (DMD's real-score CFG; 1: none)")
      .min(0.0).max(100.0);
  s.add("recipe.gan_weight", &recipe.gan_weight,
        "DMD2's GAN term: weight of the generator's non-saturating GAN loss, through a classification head on the "
        "critic's features that learns to tell real images (the data, noised) from the generator's (0: off)")
      .min(0.0).max(1000.0);
  s.add("recipe.gan_critic_weight", &recipe.gan_critic_weight,
        "Weight of the head's classification loss in the critic's updates (with recipe.gan_weight > 0)")
      .min(0.0).max(1000.0);
  s.add("recipe.gan_block", &recipe.gan_block,
        "The critic block whose output the GAN head reads (counted from 0; -1: the middle one, (layers - 1) / 2)")
      .min(-1).max(kMaxWidth);
  s.add("recipe.gan_min_t", &recipe.gan_min_t,
        "The GAN head's real and generated samples are noised at a timestep drawn in [gan_min_t, gan_max_t] x "
        "model.timesteps (low timesteps: the head sees fine detail, high: the overall shape)")
      .min(0.0).lessThan(1.0);
  s.add("recipe.gan_max_t", &recipe.gan_max_t, "Upper end of the GAN head's range").greaterThan(0.0).max(1.0);
  s.add("recipe.guidance_interval", &recipe.guidance_interval,
        "[FIRST, LAST]: the teacher is guided only at the timesteps in that range, its conditional output alone "
        "elsewhere (as tessera-sample --cfg-interval; the teacher's sampler setting). Empty: every timestep");
}

}  // namespace

const trainer::RecipeSpec& dmdRecipeSpec() {
  static const trainer::RecipeSpec spec{"dmd", "distribution-matching distillation of the models generator, critic and teacher",
                               finishDmd, maxUpdates, "generator", nullptr, bindDmdKeys};
  return spec;
}

}  // namespace tessera::recipes
