// Distribution-matching distillation (run.recipe dmd): a frozen teacher denoiser is
// distilled into a generator that maps noise to a sample in one step (DMD: Yin et al.,
// "One-step Diffusion with Distribution Matching Distillation", CVPR 2024; the critic
// updated several times per generator update as in DMD2, Yin et al., NeurIPS 2024).
//
// Three models of the run (models: generator, critic, teacher), all diffusion denoisers
// (trainer/diffusion.h) of one architecture, each sharded by its own strategy:
//   generator  G(z) = the denoiser's estimate of the clean sample from pure noise z at the
//              last timestep: (z - sqrt(1 - abar) eps_G(z, T-1)) / sqrt(abar). Started from
//              the teacher's weights (init_from), so G begins as the teacher's one-step guess.
//   critic     a denoiser of the generator's samples ("fake score"): trained with the
//              diffusion loss on G(z), detached, recipe.critic_steps times per step.
//   teacher    the denoiser of the data ("real score"), frozen.
// The generator's update: noise its samples, x_t = sqrt(abar_t) x + sqrt(1 - abar_t) eps
// with t in [recipe.min_t, recipe.max_t] x T, and move each sample x along
//   g = (x0_critic(x_t) - x0_teacher(x_t)) / mean|x - x0_teacher(x_t)|
// (the difference of the two clean-sample estimates — the score difference in data space
// — normalised per sample as DMD does), through the surrogate loss 0.5 |x - sg(x - g)|^2
// whose gradient in x is g. Critic and teacher run without gradients there.
//
// Every draw (z, t, eps) is a function of (run.seed, step, sample index, purpose), so a
// sharded run draws what one process draws, and a resumed run what an uninterrupted one
// does. Metrics: loss (the surrogate), critic_loss; evaluations: eval_loss /
// eval_loss_ema, the teacher's noise-prediction loss on 1024 one-step samples of the live
// / EMA generator; model.samples one-step samples of generator_ema at the end.
#pragma once

#include <ATen/ATen.h>

#include <memory>

#include "trainer/recipe.h"

namespace tessera::trainer {

class DiffusionDenoiser;

std::unique_ptr<Recipe> makeDmdRecipe(RunParts& run);

// G(z) of a denoiser (see above): z [n, sample shape...] -> samples of the same shape.
// Enters the model's root unit (zero3 gathers there).
at::Tensor generateOneStep(DiffusionDenoiser& model, const at::Tensor& noise);

}  // namespace tessera::trainer
