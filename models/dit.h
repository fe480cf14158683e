// The DiT of Peebles & Xie (2023), "Scalable Diffusion Models with Transformers": a
// class-conditional diffusion transformer with adaLN-Zero blocks, predicting the noise or
// the velocity (model.prediction, diffusion.h) without a variance (the reference's
// learn_sigma=False). Structure, parameter names and initialisation are
// those of facebookresearch/DiT models.py, so an export loads with strict=True into that
// model definition (python/tessera_models.py has a copy):
//
//   x_embedder.proj         Conv2d(C, D, p, stride p): patches -> tokens [N, T, D]
//   pos_embed               [1, T, D] fixed 2-D sin-cos (a buffer here, a frozen parameter
//                           there: saved, never trained)
//   t_embedder.mlp.{0,2}    Linear(256, D), SiLU, Linear(D, D) over [cos, sin] of t
//   y_embedder.embedding_table  [classes + 1, D]; row `classes` is "no class"
//   blocks.<i>              x += gate * attn(modulate(LN(x))), x += gate * mlp(modulate(LN(x))),
//                           the shifts, scales and gates from adaLN_modulation.1(silu(c));
//                           attn.qkv, attn.proj, mlp.fc1, mlp.fc2 (tanh GELU). Each block is a
//                           unit (sharding::Unit) called with (x, c).
//   final_layer             modulate(LN(x)) -> linear -> [N, T, p*p*C] -> unpatchified; with
//                           model.patch_overlap m the linear predicts a (p+2m)^2 window per
//                           patch, and overlapping windows are blended (see blendWindows)
//   final_conv              (model.final_conv) y + conv3x3(y) over the unpatchified y, zero at
//                           first: U-ViT's (Bao et al. 2023) remedy for patch seams
// with c = t_embedder(t) + y_embedder(y). LayerNorms have no affine parameters (eps 1e-6).
// Initialisation: linears xavier-uniform with zero biases, the patch projection as a
// linear over [D, C p p], the label table and timestep MLP weights N(0, 0.02), every
// adaLN modulation and the final linear zero (a fresh DiT outputs zero).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <vector>

#include "sharding/unit.h"
#include "models/diffusion.h"
#include "models/layers.h"

namespace tessera::models {

// The Conv2d patch embedding with stride = kernel = p, computed as a linear over
// non-overlapping patches: weight [D, C, p, p], bias [D].
class PatchEmbedImpl : public layers::DeferredModule {
 public:
  PatchEmbedImpl(int64_t channels, int64_t width, int64_t patch, at::Device device);
  at::Tensor forward(const at::Tensor& images);  // [N, C, H, W] -> [N, (H/p)(W/p), D]
  at::Tensor weight, bias;

 private:
  int64_t patch_;
};
TORCH_MODULE(PatchEmbed);

// A 3x3 convolution, stride 1, padding 1, from C channels to C, weight [C, C, 3, 3] and
// bias [C] starting at zero.
class SeamConvImpl : public layers::DeferredModule {
 public:
  SeamConvImpl(int64_t channels, at::Device device);
  at::Tensor forward(const at::Tensor& images);  // [N, C, H, W] -> the same plus its convolution
  at::Tensor weight, bias;
};
TORCH_MODULE(SeamConv);

class DiTBlock : public torch::nn::Module {
 public:
  DiTBlock(int64_t width, int64_t heads, int64_t mlpWidth, at::Device device);
  // x [N, T, D], conditioning c [N, D] -> [N, T, D].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& c);
  // Forward FLOPs over `tokens` patches: qkv, proj, fc1, fc2 per token, attention's
  // q k^T and weights x v (2 x 2 x tokens^2 x width), the adaLN modulation once.
  double forwardFlops(int64_t tokens) const;

 private:
  int64_t heads_;
  layers::Linear qkv_{nullptr}, proj_{nullptr}, fc1_{nullptr}, fc2_{nullptr}, modulation_{nullptr};
};

class DiT : public Denoiser {
 public:
  // sampleShape [C, H, W] with H == W divisible by model.patch_size.
  DiT(const ModelOptions& options, std::vector<int64_t> sampleShape, int64_t classes, at::Device device = at::kCPU);

  // x_t [N, C, H, W], t [N] int64, labels [N] int64 in [0, classes] -> the output [N, C, H, W]
  // (the noise or the velocity: model.prediction).
  at::Tensor forward(const at::Tensor& noisy, const at::Tensor& timesteps, const at::Tensor& labels);
  at::Tensor predict(const at::Tensor& noisy, const at::Tensor& timesteps, const at::Tensor& labels) override {
    return forward(noisy, timesteps, labels);
  }
  double forwardFlopsPerSample() const override;

 protected:
  at::Tensor blockOutput(const at::Tensor& noisy, const at::Tensor& timesteps, const at::Tensor& labels,
                         int64_t block) override;

 private:
  // The patch tokens with the position table, and the conditioning c: what every block reads.
  std::pair<at::Tensor, at::Tensor> embed(const at::Tensor& noisy, const at::Tensor& timesteps, const at::Tensor& labels);
  // Sums each patch's (p + 2m)^2 output window [N, T, k*k*C] into the image [N, C, H, W],
  // weighted by blendWeights_ (1 in the middle, falling linearly over the 2m pixels a window
  // shares with its neighbour) and divided by blendNorm_ (the weights' sum at each pixel):
  // each pixel is a weighted mean of the windows over it, so no window ends at a hard edge.
  at::Tensor blendWindows(const at::Tensor& windows) const;

  int64_t patch_, grid_, overlap_, window_;  // window_ = patch_ + 2 overlap_
  PatchEmbed xEmbedder_{nullptr};
  at::Tensor posEmbed_;
  layers::Linear timeIn_{nullptr}, timeOut_{nullptr};
  layers::Embedding labelTable_{nullptr};
  sharding::UnitList<DiTBlock> blocks_{nullptr};
  layers::Linear finalLinear_{nullptr}, finalModulation_{nullptr};
  SeamConv finalConv_{nullptr};  // model.final_conv
  at::Tensor blendWeights_, blendNorm_;  // model.patch_overlap > 0: [C k k, 1] and [1, C, H, W]
};

}  // namespace tessera::models
