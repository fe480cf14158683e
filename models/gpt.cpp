// model.arch gpt: GptBlock and Gpt (see gpt.h).
#include "models/gpt.h"

#include <ATen/ATen.h>
#include <torch/version.h>

#include <cmath>
#include <limits>

#include "common/errors.h"
#include "kernels/cpu_matmul.h"

namespace tessera::models {
namespace {

// GPT-2's initial distributions (nanoGPT's _init_weights): weights N(0, 0.02), biases 0.
void gpt2Init(layers::LinearImpl& linear, double std) {
  linear.setInit("weight", dtensor::ParamInit::normal(0.0, std));
  if (linear.bias.defined()) linear.setInit("bias", dtensor::ParamInit::constant(0.0));
}

constexpr double kGpt2Std = 0.02;

}  // namespace

GptBlock::GptBlock(int64_t width, int64_t heads, int64_t layers, at::Device device) : heads_(heads) {
  ln1_ = register_module("ln_1", layers::LayerNorm(width, device));
  auto attn = register_module("attn", std::make_shared<torch::nn::Module>());
  attnIn_ = attn->register_module("c_attn", layers::Linear(width, 3 * width, /*bias=*/true, device));
  attnOut_ = attn->register_module("c_proj", layers::Linear(width, width, /*bias=*/true, device));
  ln2_ = register_module("ln_2", layers::LayerNorm(width, device));
  auto mlp = register_module("mlp", std::make_shared<torch::nn::Module>());
  mlpIn_ = mlp->register_module("c_fc", layers::Linear(width, 4 * width, /*bias=*/true, device));
  mlpOut_ = mlp->register_module("c_proj", layers::Linear(4 * width, width, /*bias=*/true, device));
  // The residual projections are scaled down by the depth (GPT-2).
  const double residualStd = kGpt2Std / std::sqrt(2.0 * static_cast<double>(std::max<int64_t>(layers, 1)));
  gpt2Init(*attnIn_, kGpt2Std);
  gpt2Init(*attnOut_, residualStd);
  gpt2Init(*mlpIn_, kGpt2Std);
  gpt2Init(*mlpOut_, residualStd);
}

at::Tensor GptBlock::forward(const at::Tensor& x) {
  const int64_t batch = x.size(0), time = x.size(1), width = x.size(2), headDim = width / heads_;
  // Causal self-attention: [batch, heads, time, headDim] queries, keys and values.
  const auto qkv = attnIn_->forward(ln1_->forward(x)).chunk(3, /*dim=*/2);
  auto split = [&](const at::Tensor& t) { return t.view({batch, time, heads_, headDim}).transpose(1, 2); };
  const at::Tensor q = split(qkv[0]), k = split(qkv[1]), v = split(qkv[2]);
#if TORCH_VERSION_MAJOR >= 2
  // PyTorch 2's fused attention (flash / memory-efficient kernels on GPUs): the same
  // softmax(q k^T / sqrt(d) + causal mask) v without materialising the scores.
  const at::Tensor attended = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true)
                                  .transpose(1, 2)
                                  .reshape({batch, time, width});
#else
  at::Tensor scores = kernels::batchedMatmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(headDim));
  const at::Tensor future = at::ones({time, time}, x.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  const at::Tensor attended = kernels::batchedMatmul(at::softmax(scores, -1), v).transpose(1, 2).reshape({batch, time, width});
#endif
  const at::Tensor h = x + attnOut_->forward(attended);
  return h + mlpOut_->forward(at::gelu(mlpIn_->forward(ln2_->forward(h))));
}

Gpt::Gpt(const ModelOptions& options, at::Device device) : options_(options) {
  TESSERA_CHECK_AS(ConfigError, options.embed_dim % options.heads == 0, "model.embed_dim ", options.embed_dim,
                   " is not divisible by model.heads ", options.heads);
  wte_ = register_module("wte", layers::Embedding(options.vocab_size, options.embed_dim, device));
  wpe_ = register_module("wpe", layers::Embedding(options.context, options.embed_dim, device));
  wte_->setInit("weight", dtensor::ParamInit::normal(0.0, kGpt2Std));
  wpe_->setInit("weight", dtensor::ParamInit::normal(0.0, kGpt2Std));
  blocks_ = register_module("h", sharding::UnitList<GptBlock>());
  for (int64_t i = 0; i < options.layers; ++i) blocks_->emplace_back(options.embed_dim, options.heads, options.layers, device);
  lnF_ = register_module("ln_f", layers::LayerNorm(options.embed_dim, device));
  if (!options.tie_head) {
    lmHead_ = register_module("lm_head", layers::Linear(options.embed_dim, options.vocab_size, /*bias=*/false, device));
    gpt2Init(*lmHead_, kGpt2Std);
  }
}

at::Tensor Gpt::forward(const at::Tensor& tokens) {
  TESSERA_CHECK(tokens.dim() == 2 && tokens.size(1) >= 1 && tokens.size(1) <= options_.context,
                "Gpt: expected tokens [batch, 1..", options_.context, "], got ", tokens.sizes());
  const at::Tensor positions = at::arange(tokens.size(1), tokens.options());
  at::Tensor x = wte_->forward(tokens) + wpe_->forward(positions);
  for (auto& block : *blocks_) x = block->forward(x);
  x = lnF_->forward(x);
  return options_.tie_head ? kernels::linear(x, wte_->weight, {}) : lmHead_->forward(x);
}

double GptBlock::forwardFlops(int64_t time) const {
  const double t = static_cast<double>(time), width = static_cast<double>(attnOut_->weight.size(0));
  return t * layers::linearFlops(*this) + 2.0 * 2.0 * t * t * width;
}

double Gpt::forwardFlopsPerSample() const {
  // Every position of the window: the blocks, then the head (the tied one is a product with
  // wte's transpose, the same count).
  double total = 0;
  for (const auto& module : modules(/*include_self=*/false)) {
    if (const auto* block = dynamic_cast<const GptBlock*>(module.get())) total += block->forwardFlops(options_.context);
  }
  return total + static_cast<double>(options_.context) * 2.0 * static_cast<double>(options_.embed_dim) *
                     static_cast<double>(options_.vocab_size);
}

at::Tensor Gpt::nextTokenLogits(const at::Tensor& tokens) { return forward(tokens).select(1, tokens.size(1) - 1); }

std::shared_ptr<TrainModel> makeGpt(const ModelOptions& options, const datasets::DataSpec& data, c10::Device device) {
  TESSERA_CHECK_AS(ConfigError, data.tokens, "model.arch gpt needs token data (data.kind text or tokens)");
  return std::make_shared<Gpt>(options, device);
}

}  // namespace tessera::models
