// Distribution-matching distillation (run.recipe dmd; docs/distill.md): a frozen teacher
// denoiser is distilled into a generator that maps noise to a sample in one step or a few
// (DMD, Yin et al., CVPR 2024; DMD2, Yin et al., NeurIPS 2024: the critic updated several
// times per generator update, the few-step generator trained by backward simulation).
// Three models of the run (models: generator, critic, teacher), diffusion denoisers of one
// architecture, each sharded by its own strategy:
//   generator  G(z): deterministic DDIM over its model.sample_timesteps (default: the last
//              timestep alone: the clean-sample estimate from pure noise z). Each update
//              trains one step of that chain per sample, from the chain's own iterate
//              there (backward simulation). Started from the teacher's weights (init_from).
//   critic     a denoiser of the generator's samples ("fake score"), trained with the
//              diffusion loss on G(z), detached, recipe.critic_steps times per step.
//   teacher    the denoiser of the data ("real score"), frozen.
// The generator's update moves each sample x along the difference of the critic's and the
// teacher's clean-sample estimates of a noised x, normalised per sample, through the
// surrogate loss 0.5 |x - sg(x - g)|^2. Class-conditional denoisers (dit) distil per
// class: each sample gets a class drawn from its seed, the generator and the critic are
// asked for it, and the teacher's real score is classifier-free guided at
// recipe.guidance (DMD's real-score CFG). Every draw is a function of (run.seed, step,
// sample index, purpose): a sharded run draws what one process draws, a resumed run what
// an uninterrupted one does. The recipe's config (roles, checks): dmd_recipe_spec.cpp.
#pragma once

#include <ATen/ATen.h>

#include <memory>

#include "trainer/recipe.h"

namespace tessera::models {
class Denoiser;
}  // namespace tessera::models

namespace tessera::recipes {

// G(z, y) of a generator denoiser: deterministic DDIM over its `timesteps` (one step:
// the clean-sample estimate from pure noise), z [n, sample shape...] -> samples of the
// same shape, of classes `labels` [n] (undefined: unconditional). Collective under zero3.
at::Tensor generate(models::Denoiser& model, const std::vector<int64_t>& timesteps, const at::Tensor& noise,
                    const at::Tensor& labels = {});

}  // namespace tessera::recipes
