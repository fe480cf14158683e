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
// DMD2's GAN term (recipe.gan_weight > 0): the critic carries a classification head on
// the output of one of its blocks (model.gan_head_block, from recipe.gan_block), trained
// in the critic's updates to tell the data's images from the generator's, both noised to
// the same drawn timesteps; the generator's loss adds the non-saturating GAN loss through
// that head. recipe.regression_weight 0 drops the regression pairs (DMD2 has none).
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <utility>

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

// The timesteps [first, last] that the fractions [minFraction, maxFraction] of a schedule of
// `timesteps` steps span (recipe.min_t/max_t, recipe.gan_min_t/gan_max_t): first =
// floor(min T), last = ceil(max T) - 1, clamped so that first <= last < T.
std::pair<int64_t, int64_t> timestepRange(double minFraction, double maxFraction, int64_t timesteps);

// DMD2's GAN term (recipe.gan_weight), its two sides. Samples are noised as
// signal x + spread eps, signal and spread [n, 1, ...] broadcasting over x [n, ...].
//
// The critic's: per sample, softplus(-D(real)) + softplus(D(fake)) with D the critic's
// head (Denoiser::discriminate) at `timesteps`, the real and the generated samples in one
// forward. `fake` is taken detached: this loss trains the critic and its head only.
at::Tensor ganCriticLosses(models::Denoiser& critic, const at::Tensor& real, const at::Tensor& realLabels,
                           const at::Tensor& fake, const at::Tensor& fakeLabels, const at::Tensor& timesteps,
                           const at::Tensor& signal, const at::Tensor& spread, const at::Tensor& realEps,
                           const at::Tensor& fakeEps);

// The generator's: per sample, a surrogate of the non-saturating loss softplus(-D(x
// noised)) whose gradient in the generator's samples `x` (with their graph) is that loss's,
// taken through the critic by autograd::grad in x alone, so that no gradient reaches the
// critic's parameters (nor its strategy's hooks). `ganLoss` [n] receives the loss itself.
at::Tensor ganGeneratorSurrogate(models::Denoiser& critic, const at::Tensor& x, const at::Tensor& labels,
                                 const at::Tensor& timesteps, const at::Tensor& signal, const at::Tensor& spread,
                                 const at::Tensor& eps, at::Tensor& ganLoss);

}  // namespace tessera::recipes
