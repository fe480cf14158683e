// run.recipe dmd's own keys (recipe.*): bound by the dmd recipe's spec (dmd_recipe_spec.cpp)
// into this struct, which the run's config keeps for it (trainer::recipeOptions).
#pragma once

#include <cstdint>
#include <vector>

namespace tessera::recipes {

struct DmdOptions {
  static constexpr int64_t kMaxCriticSteps = 1000;
  int64_t critic_steps = 1;  // critic updates per generator update, at most kMaxCriticSteps
  double min_t = 0.02;       // the generator's samples are noised at t in [min_t, max_t] x T
  double max_t = 0.98;
  double regression_weight = 0.25;  // weight of DMD's regression loss to the teacher's samples (0: off)
  int64_t regression_pairs = 1024;  // noise -> teacher sample pairs it regresses on
  int64_t pair_steps = 50;          // DDIM steps the teacher takes for each pair
  double guidance = 1.0;            // class-conditional models: the teacher's CFG scale (real score, pairs)
  std::vector<int64_t> guidance_interval;  // [first, last] timesteps where it applies (empty: all)
  // DMD2's GAN term: a head on the critic's features (its model.gan_head_block) tells real
  // images from the generator's, both noised to the same timesteps.
  double gan_weight = 0;            // the generator's non-saturating GAN loss weight (0: no GAN term)
  double gan_critic_weight = 0.01;  // the critic's classification loss weight (with gan_weight > 0)
  int64_t gan_block = -1;           // the critic block the head reads (-1: the middle, (layers - 1) / 2)
  double gan_min_t = 0.02;          // the head's real and generated samples are noised at t in
  double gan_max_t = 0.98;          // [gan_min_t, gan_max_t] x T (low t: it sees fine detail)
  bool gan() const { return gan_weight > 0; }
};

// The recipe's name, under which the config keeps its DmdOptions.
inline constexpr char kDmdRecipe[] = "dmd";

}  // namespace tessera::recipes
