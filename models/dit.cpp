// The DiT denoiser (see dit.h).
#include "models/dit.h"

#include <ATen/ATen.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>

#include "common/errors.h"
#include "kernels/cpu_matmul.h"
#include "kernels/gelu.h"
#include "kernels/layer_norm.h"

namespace tessera::models {
namespace {

// The width of the sinusoidal timestep embedding the reference feeds its timestep MLP.
constexpr int64_t kTimeFrequencies = 256;
constexpr double kLabelStd = 0.02;

// xavier_uniform_ over a [out, in] weight: U(-b, b), b = sqrt(6 / (in + out)).
dtensor::ParamInit xavierUniform(int64_t in, int64_t out) {
  const double bound = std::sqrt(6.0 / static_cast<double>(in + out));
  return dtensor::ParamInit::uniform(-bound, bound);
}

// The reference's _basic_init of an nn.Linear: xavier-uniform weight, zero bias.
layers::Linear xavierLinear(int64_t in, int64_t out, at::Device device) {
  layers::Linear linear(in, out, /*bias=*/true, device);
  linear->setInit("weight", xavierUniform(in, out));
  linear->setInit("bias", dtensor::ParamInit::constant(0.0));
  return linear;
}

// A linear whose weight and bias start at zero (adaLN-Zero's modulations, the final layer).
layers::Linear zeroLinear(int64_t in, int64_t out, at::Device device) {
  layers::Linear linear(in, out, /*bias=*/true, device);
  linear->setInit("weight", dtensor::ParamInit::constant(0.0));
  linear->setInit("bias", dtensor::ParamInit::constant(0.0));
  return linear;
}

// A plain module registered as `name` under `parent`, to hold children under the
// reference's names (nn.Sequential's numbered ones: "adaLN_modulation.1", "mlp.0").
std::shared_ptr<torch::nn::Module> container(torch::nn::Module& parent, const std::string& name) {
  return parent.register_module(name, std::make_shared<torch::nn::Module>());
}

at::Tensor modulate(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale) {
  return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1);
}

at::Tensor plainLayerNorm(const at::Tensor& x) { return kernels::layerNorm(x, at::Tensor(), at::Tensor(), 1e-6); }

// The reference's timestep_embedding: [cos(t f), sin(t f)], f_k = exp(-ln(10000) k / half),
// in float32 in its order of operations.
at::Tensor timestepEmbedding(const at::Tensor& timesteps) {
  constexpr int64_t half = kTimeFrequencies / 2;
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(timesteps.device());
  const at::Tensor freqs = at::exp(-std::log(10000.0) * at::arange(half, opts) / half);
  const at::Tensor args = timesteps.to(at::kFloat).unsqueeze(1) * freqs.unsqueeze(0);
  return at::cat({at::cos(args), at::sin(args)}, -1);
}

}  // namespace

PatchEmbedImpl::PatchEmbedImpl(int64_t channels, int64_t width, int64_t patch, at::Device device) : patch_(patch) {
  // The reference initialises the convolution as a linear over [D, C p p], bias zero.
  weight = registerDeferred("weight", {width, channels, patch, patch}, xavierUniform(channels * patch * patch, width),
                            device);
  bias = registerDeferred("bias", {width}, dtensor::ParamInit::constant(0.0), device);
}

at::Tensor PatchEmbedImpl::forward(const at::Tensor& images) {
  const int64_t n = images.size(0), c = images.size(1), h = images.size(2) / patch_, w = images.size(3) / patch_;
  // [N, C, h, p, w, p] -> [N, h, w, C, p, p]: token i * w + j holds patch (i, j), its
  // pixels in the kernel's (C, p, p) order.
  const at::Tensor patches = images.reshape({n, c, h, patch_, w, patch_})
                                 .permute({0, 2, 4, 1, 3, 5})
                                 .reshape({n, h * w, c * patch_ * patch_});
  return kernels::linear(patches, weight.reshape({weight.size(0), -1}), bias);
}

SeamConvImpl::SeamConvImpl(int64_t channels, at::Device device) {
  weight = registerDeferred("weight", {channels, channels, 3, 3}, dtensor::ParamInit::constant(0.0), device);
  bias = registerDeferred("bias", {channels}, dtensor::ParamInit::constant(0.0), device);
}

at::Tensor SeamConvImpl::forward(const at::Tensor& images) {
  return images + layers::conv3x3(images, weight, bias);  // the convnet's 3x3 convolution
}

DiTBlock::DiTBlock(int64_t width, int64_t heads, int64_t mlpWidth, at::Device device) : heads_(heads) {
  auto attn = container(*this, "attn");
  qkv_ = attn->register_module("qkv", xavierLinear(width, 3 * width, device));
  proj_ = attn->register_module("proj", xavierLinear(width, width, device));
  auto mlp = container(*this, "mlp");
  fc1_ = mlp->register_module("fc1", xavierLinear(width, mlpWidth, device));
  fc2_ = mlp->register_module("fc2", xavierLinear(mlpWidth, width, device));
  modulation_ = container(*this, "adaLN_modulation")->register_module("1", zeroLinear(width, 6 * width, device));
}

at::Tensor DiTBlock::forward(const at::Tensor& x, const at::Tensor& c) {
  const auto mod = modulation_->forward(at::silu(c)).chunk(6, /*dim=*/1);
  const int64_t batch = x.size(0), tokens = x.size(1), width = x.size(2), headDim = width / heads_;
  // timm's Attention: softmax((q / sqrt(d)) k^T) v, heads split from qkv's [3, heads, d]
  // feature order; on PyTorch 2 through its fused kernel (timm's fused_attn), as
  // python/tessera_models.py does there.
  const at::Tensor qkv = qkv_->forward(modulate(plainLayerNorm(x), mod[0], mod[1]))
                             .reshape({batch, tokens, 3, heads_, headDim})
                             .permute({2, 0, 3, 1, 4});
#if TORCH_VERSION_MAJOR >= 2
  const at::Tensor attended =
      at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2]).transpose(1, 2).reshape({batch, tokens, width});
#else
  const at::Tensor q = qkv[0] * (1.0 / std::sqrt(static_cast<double>(headDim))), k = qkv[1], v = qkv[2];
  const at::Tensor attended =
      kernels::batchedMatmul(at::softmax(kernels::batchedMatmul(q, k.transpose(-2, -1)), -1), v).transpose(1, 2).reshape({batch, tokens, width});
#endif
  const at::Tensor h = x + mod[2].unsqueeze(1) * proj_->forward(attended);
  const at::Tensor hidden = kernels::geluTanh(fc1_->forward(modulate(plainLayerNorm(h), mod[3], mod[4])));
  return h + mod[5].unsqueeze(1) * fc2_->forward(hidden);
}

DiT::DiT(const ModelOptions& options, std::vector<int64_t> sampleShape, int64_t classes, at::Device device)
    : Denoiser(options, std::move(sampleShape), classes), patch_(options.patch_size) {
  TESSERA_CHECK_AS(ConfigError, sampleShape_.size() == 3 && sampleShape_[1] == sampleShape_[2],
                   "dit: needs square images [C, H, H], got samples of ", at::IntArrayRef(sampleShape_));
  const int64_t channels = sampleShape_[0], side = sampleShape_[1], width = options.embed_dim;
  TESSERA_CHECK_AS(ConfigError, side % patch_ == 0, "dit: model.patch_size ", patch_, " does not divide the image size ",
                   side);
  TESSERA_CHECK_AS(ConfigError, width % 4 == 0 && width % options.heads == 0, "dit: model.embed_dim ", width,
                   " must be a multiple of 4 and of model.heads (", options.heads, ")");
  grid_ = side / patch_;
  overlap_ = options.patch_overlap;
  TESSERA_CHECK_AS(ConfigError, overlap_ >= 0 && 2 * overlap_ <= patch_, "dit: model.patch_overlap ", overlap_,
                   " must be between 0 and half of model.patch_size ", patch_);
  window_ = patch_ + 2 * overlap_;
  xEmbedder_ = container(*this, "x_embedder")->register_module("proj", PatchEmbed(channels, width, patch_, device));
  // A buffer: fixed, the same on every rank, saved with the weights (and with each EMA,
  // which copies buffers), never trained — the reference's frozen parameter.
  at::Tensor table = at::empty({1, grid_ * grid_, width}, at::kFloat);
  dtensor::fillRows(dtensor::ParamInit::sinCos2d(grid_, width), /*seed=*/0, "pos_embed", 0, table);
  posEmbed_ = register_buffer("pos_embed", table.to(device));
  auto timeMlp = container(*container(*this, "t_embedder"), "mlp");
  timeIn_ = timeMlp->register_module("0", layers::Linear(kTimeFrequencies, width, /*bias=*/true, device));
  timeOut_ = timeMlp->register_module("2", layers::Linear(width, width, /*bias=*/true, device));
  for (auto* linear : {&timeIn_, &timeOut_}) {
    (*linear)->setInit("weight", dtensor::ParamInit::normal(0.0, kLabelStd));
    (*linear)->setInit("bias", dtensor::ParamInit::constant(0.0));
  }
  labelTable_ = container(*this, "y_embedder")->register_module("embedding_table", layers::Embedding(classes + 1, width, device));
  labelTable_->setInit("weight", dtensor::ParamInit::normal(0.0, kLabelStd));
  blocks_ = register_module("blocks", sharding::UnitList<DiTBlock>());
  const auto mlpWidth = static_cast<int64_t>(static_cast<double>(width) * options.mlp_ratio);  // int() as the reference
  for (int64_t i = 0; i < options.layers; ++i) blocks_->emplace_back(width, options.heads, mlpWidth, device);
  auto final = container(*this, "final_layer");
  finalLinear_ = final->register_module("linear", zeroLinear(width, window_ * window_ * channels, device));
  if (overlap_ > 0) {
    // Not buffers: derived from the options, so neither saved nor averaged by the EMA.
    const double ramp = static_cast<double>(2 * overlap_);
    at::Tensor edge = at::empty({window_}, at::kFloat);
    for (int64_t i = 0; i < window_; ++i) {
      const double fromEdge = static_cast<double>(std::min(i, window_ - 1 - i)) + 0.5;
      edge[i] = std::min(1.0, fromEdge / ramp);
    }
    blendWeights_ = at::outer(edge, edge).reshape({1, window_ * window_}).expand({channels, -1}).reshape({-1, 1});
    blendNorm_ = at::col2im(blendWeights_.expand({-1, grid_ * grid_}).unsqueeze(0), {side, side}, {window_, window_},
                            {1, 1}, {overlap_, overlap_}, {patch_, patch_});
    blendWeights_ = blendWeights_.to(device);
    blendNorm_ = blendNorm_.to(device);
  }
  finalModulation_ = container(*final, "adaLN_modulation")->register_module("1", zeroLinear(width, 2 * width, device));
  if (options.final_conv) finalConv_ = register_module("final_conv", SeamConv(channels, device));
  addGanHead(width, device);
}

std::pair<at::Tensor, at::Tensor> DiT::embed(const at::Tensor& noisy, const at::Tensor& timesteps,
                                             const at::Tensor& labels) {
  const int64_t n = noisy.size(0);
  TESSERA_CHECK(noisy.dim() == 4 && noisy.sizes().slice(1).equals(sampleShape_) && timesteps.dim() == 1 &&
                    timesteps.size(0) == n && labels.dim() == 1 && labels.size(0) == n,
                "DiT: expected x_t [N, ", at::IntArrayRef(sampleShape_), "], t [N] and labels [N], got ", noisy.sizes(),
                ", ", timesteps.sizes(), " and ", labels.sizes());
  const auto dtype = xEmbedder_->weight.scalar_type();  // the compute dtype (sharding.param_dtype)
  at::Tensor x = xEmbedder_->forward(noisy.to(dtype)) + posEmbed_.to(dtype);
  const at::Tensor t = timeOut_->forward(at::silu(timeIn_->forward(timestepEmbedding(timesteps).to(dtype))));
  return {x, t + labelTable_->forward(labels)};
}

at::Tensor DiT::blockOutput(const at::Tensor& noisy, const at::Tensor& timesteps, const at::Tensor& labels,
                            int64_t block) {
  auto [x, c] = embed(noisy, timesteps, labels);
  for (int64_t i = 0; i <= block; ++i) x = (*blocks_)[static_cast<size_t>(i)]->forward(x, c);
  return x;
}

at::Tensor DiT::forward(const at::Tensor& noisy, const at::Tensor& timesteps, const at::Tensor& labels) {
  const int64_t n = noisy.size(0);
  auto [x, c] = embed(noisy, timesteps, labels);
  for (auto& block : *blocks_) x = block->forward(x, c);
  const auto mod = finalModulation_->forward(at::silu(c)).chunk(2, /*dim=*/1);
  x = finalLinear_->forward(modulate(plainLayerNorm(x), mod[0], mod[1]));
  // Unpatchify: [N, h, w, p, p, C] -> [N, C, h p, w p].
  const int64_t channels = sampleShape_[0];
  const at::Tensor images = overlap_ > 0 ? blendWindows(x)
                                         : x.reshape({n, grid_, grid_, patch_, patch_, channels})
                                               .permute({0, 5, 1, 3, 2, 4})
                                               .reshape({n, channels, grid_ * patch_, grid_ * patch_});
  return finalConv_ ? finalConv_->forward(images) : images;
}

at::Tensor DiT::blendWindows(const at::Tensor& windows) const {
  const int64_t n = windows.size(0), channels = sampleShape_[0], side = grid_ * patch_;
  // [N, T, k, k, C] -> [N, C k k, T]: col2im's columns, one window per patch in row-major
  // order, which is the order of the windows' top-left corners (stride p, padding m).
  const at::Tensor columns = windows.reshape({n, grid_ * grid_, window_, window_, channels})
                                 .permute({0, 4, 2, 3, 1})
                                 .reshape({n, channels * window_ * window_, grid_ * grid_});
  const auto like = [&](const at::Tensor& t) { return t.to(windows.device(), windows.scalar_type()); };
  return at::col2im(columns * like(blendWeights_), {side, side}, {window_, window_}, {1, 1}, {overlap_, overlap_},
                    {patch_, patch_}) /
         like(blendNorm_);
}

double DiTBlock::forwardFlops(int64_t tokens) const {
  const double t = static_cast<double>(tokens), width = static_cast<double>(proj_->weight.size(0));
  const double perToken = layers::matmulFlops(*qkv_) + layers::matmulFlops(*proj_) + layers::matmulFlops(*fc1_) +
                          layers::matmulFlops(*fc2_);
  return t * perToken + 2.0 * 2.0 * t * t * width + layers::matmulFlops(*modulation_);
}

double DiT::forwardFlopsPerSample() const {
  const int64_t tokens = grid_ * grid_;
  const double t = static_cast<double>(tokens);
  // The patch embedding is a linear of C p p inputs per patch; the timestep MLP and the
  // final modulation run once per sample, the final linear once per patch.
  double total = t * 2.0 * static_cast<double>(xEmbedder_->weight.numel()) + layers::matmulFlops(*timeIn_) +
                 layers::matmulFlops(*timeOut_) + layers::matmulFlops(*finalModulation_) +
                 t * layers::matmulFlops(*finalLinear_);
  if (finalConv_) total += 2.0 * static_cast<double>(finalConv_->weight.numel() * grid_ * grid_ * patch_ * patch_);
  for (const auto& module : modules(/*include_self=*/false)) {
    if (const auto* block = dynamic_cast<const DiTBlock*>(module.get())) total += block->forwardFlops(tokens);
  }
  return total;
}

std::shared_ptr<TrainModel> makeDit(const ModelOptions& options, const datasets::DataSpec& data, c10::Device device) {
  TESSERA_CHECK_AS(ConfigError, !data.tokens && data.inputShape.size() == 3,
                   "model.arch dit needs images (data.kind idx, image_folder or webdataset)");
  return std::make_shared<DiT>(options, data.inputShape, conditioningClasses(options, data), device);
}

}  // namespace tessera::models
