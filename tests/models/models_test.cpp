// The built-in models: shapes, parameter names (nanoGPT's for the GPT), causality of the
// GPT's attention, the tied head, and option errors; the diffusion denoiser's names, loss
// and sampler; the MLP over tensors (cross-entropy and mean-squared error).
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>

#include "checkpoint/safetensors.h"
#include "common/errors.h"
#include "sharding/unit_discovery.h"
#include "models/diffusion.h"
#include "models/gpt.h"
#include "models/mlp.h"
#include "models/models.h"

namespace tessera::models {
namespace {

ModelOptions gptOptions(bool tied = false) {
  ModelOptions o;
  o.arch = "gpt";
  o.vocab_size = 50;
  o.context = 6;
  o.embed_dim = 12;
  o.layers = 2;
  o.heads = 3;
  o.tie_head = tied;
  return o;
}

// A model built deferred (as every built-in one is), initialised in full for one process.
template <typename M>
std::shared_ptr<M> initialized(std::shared_ptr<M> model, uint64_t seed = 0) {
  initializeModel(*model, seed);
  return model;
}

// The model's own units (its sharding::Unit members), as a strategy with no wrap finds them.
std::vector<std::string> unitNames(const torch::nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& u : sharding::findUnits(m, {}, 0)) out.push_back(u.name);
  return out;
}

std::set<std::string> names(torch::nn::Module& m) {
  std::set<std::string> out;
  for (const auto& item : m.named_parameters()) out.insert(item.key());
  return out;
}

TEST(GptTest, ParameterNamesFollowNanoGpt) {
  torch::manual_seed(0);
  auto model = makeModel(gptOptions());
  const auto got = names(*model);
  for (const char* name : {"wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.ln_1.bias", "h.0.attn.c_attn.weight",
                           "h.0.attn.c_attn.bias", "h.0.attn.c_proj.weight", "h.1.ln_2.bias", "h.1.mlp.c_fc.weight",
                           "h.1.mlp.c_proj.bias", "ln_f.weight", "lm_head.weight"}) {
    EXPECT_TRUE(got.count(name)) << name;
  }
  EXPECT_FALSE(got.count("lm_head.bias"));
  EXPECT_EQ(got.size(), 2u + 2 * 12 + 2 + 1);  // wte, wpe; 12 per block; ln_f; lm_head
  EXPECT_FALSE(names(*makeModel(gptOptions(/*tied=*/true))).count("lm_head.weight"));
  EXPECT_EQ(unitNames(*makeModel(gptOptions())), (std::vector<std::string>{"h.0", "h.1"}));
}

TEST(GptTest, AttentionIsCausalAndNextTokenIsTheLastPosition) {
  torch::manual_seed(1);
  auto model = initialized(std::make_shared<Gpt>(gptOptions(), at::kCPU));
  const at::Tensor tokens = torch::randint(0, 50, {3, 6}, at::kLong);
  const at::Tensor logits = model->forward(tokens);
  EXPECT_EQ(logits.sizes(), (c10::IntArrayRef{3, 6, 50}));
  // Changing token 4 changes positions 4 and 5 only.
  at::Tensor changed = tokens.clone();
  changed.select(1, 4).fill_(7);
  changed.select(1, 4).masked_fill_(tokens.select(1, 4) == 7, 8);
  const at::Tensor after = model->forward(changed);
  EXPECT_TRUE(after.narrow(1, 0, 4).allclose(logits.narrow(1, 0, 4)));
  EXPECT_FALSE(after.narrow(1, 4, 2).allclose(logits.narrow(1, 4, 2)));
  EXPECT_TRUE(model->nextTokenLogits(tokens).equal(logits.select(1, 5)));
  // A shorter window is a prefix of the longer one's computation.
  EXPECT_TRUE(model->forward(tokens.narrow(1, 0, 3)).allclose(logits.narrow(1, 0, 3), 1e-5, 1e-6));
}

TEST(GptTest, TiedHeadUsesTheTokenEmbedding) {
  torch::manual_seed(2);
  auto model = initialized(std::make_shared<Gpt>(gptOptions(/*tied=*/true), at::kCPU));
  const at::Tensor tokens = torch::randint(0, 50, {2, 6}, at::kLong);
  const at::Tensor before = model->forward(tokens);
  {
    torch::NoGradGuard noGrad;
    for (auto& item : model->named_parameters()) {
      // Not a constant shift: LayerNorm output sums to ~0, so a constant would cancel.
      if (item.key() == "wte.weight") item.value().select(0, 3).add_(torch::randn({12}));
    }
  }
  EXPECT_FALSE(model->forward(tokens).select(2, 3).allclose(before.select(2, 3)));
}

TEST(GptTest, BadOptionsAreErrors) {
  ModelOptions o = gptOptions();
  o.heads = 5;  // does not divide 12
  EXPECT_THROW(makeModel(o), ConfigError);
  o.arch = "rnn";
  EXPECT_THROW(makeModel(o), ConfigError);
  auto model = initialized(std::make_shared<Gpt>(gptOptions(), at::kCPU));
  EXPECT_THROW(model->forward(torch::zeros({1, 7}, at::kLong)), Error);  // longer than the context
}

TEST(ContextMlpTest, NamesAndShape) {
  ModelOptions o;
  o.hidden = {8};
  auto model = std::dynamic_pointer_cast<NextTokenModel>(initialized(makeModel(o)));
  ASSERT_NE(model, nullptr);
  EXPECT_EQ(names(*model), (std::set<std::string>{"embed.weight", "layers.0.weight", "layers.0.bias", "head.weight",
                                                   "head.bias"}));
  EXPECT_EQ(model->nextTokenLogits(torch::zeros({2, o.context}, at::kLong)).sizes(), (c10::IntArrayRef{2, 256}));
}

ModelOptions diffusionOptions() {
  ModelOptions o;
  o.arch = "diffusion";
  o.embed_dim = 10;
  o.layers = 2;
  o.timesteps = 50;
  return o;
}

// A DiT of one block, 16 wide, on 8x8 images in 4x4 patches, 50 timesteps.
ModelOptions smallDitOptions() {
  ModelOptions o;
  o.arch = "dit";
  o.embed_dim = 16;
  o.layers = 1;
  o.heads = 2;
  o.patch_size = 4;
  o.timesteps = 50;
  return o;
}

datasets::DataSpec floatSpec(std::vector<int64_t> inputShape, int64_t classes = 0, std::vector<int64_t> targetShape = {}) {
  datasets::DataSpec s;
  s.inputShape = std::move(inputShape);
  s.classes = classes;
  s.targetShape = std::move(targetShape);
  return s;
}

std::vector<uint64_t> seedsFor(int64_t step, int64_t first, int64_t n) {
  std::vector<uint64_t> out;
  for (int64_t i = first; i < first + n; ++i) out.push_back(datasets::noiseSeed(11, step, i));
  return out;
}

TEST(DiffusionTest, NamesShapesAndUnits) {
  torch::manual_seed(3);
  auto model = std::dynamic_pointer_cast<DiffusionDenoiser>(initialized(makeModel(diffusionOptions(), floatSpec({3, 2, 2}))));
  ASSERT_NE(model, nullptr);
  std::set<std::string> expected = {"time_embed.0.weight", "time_embed.0.bias", "time_embed.2.weight",
                                    "time_embed.2.bias",   "input_proj.weight", "input_proj.bias",
                                    "out_norm.weight",     "out_norm.bias",     "output_proj.weight",
                                    "output_proj.bias"};
  for (int block = 0; block < 2; ++block) {
    for (const char* layer : {"norm", "time_proj", "fc1", "fc2"}) {
      for (const char* kind : {"weight", "bias"}) expected.insert(strCat("blocks.", block, ".", layer, ".", kind));
    }
  }
  EXPECT_EQ(names(*model), expected);
  const auto params = model->named_parameters();
  EXPECT_EQ(params["input_proj.weight"].sizes(), (c10::IntArrayRef{10, 12}));
  EXPECT_EQ(params["blocks.1.fc1.weight"].sizes(), (c10::IntArrayRef{40, 10}));
  const at::Tensor x = torch::randn({4, 3, 2, 2});
  EXPECT_EQ(model->forward(x, torch::tensor(std::vector<int64_t>{0, 1, 25, 49})).sizes(), x.sizes());
  EXPECT_THROW(model->forward(torch::randn({4, 5}), torch::zeros({4}, at::kLong)), Error);
  EXPECT_EQ(unitNames(*model), (std::vector<std::string>{"blocks.0", "blocks.1"}));
  EXPECT_THROW(makeModel(diffusionOptions()), ConfigError);  // token data
}

// The loss of a sample depends on its seed only: not on the batch it is in, so any split
// over ranks and micro-batches draws the same timesteps and noise.
TEST(DiffusionTest, LossesDependOnTheSeedsNotOnTheBatchSplit) {
  torch::manual_seed(4);
  auto model = initialized(std::make_shared<DiffusionDenoiser>(diffusionOptions(), std::vector<int64_t>{2}));
  datasets::Batch whole;
  whole.inputs = torch::randn({6, 2});
  whole.noiseSeeds = seedsFor(0, 0, 6);
  const at::Tensor all = model->losses(whole);
  ASSERT_EQ(all.sizes(), (c10::IntArrayRef{6}));
  EXPECT_TRUE(all.equal(model->losses(whole)));
  datasets::Batch tail;
  tail.inputs = whole.inputs.narrow(0, 4, 2);
  tail.noiseSeeds = seedsFor(0, 4, 2);
  EXPECT_TRUE(at::allclose(model->losses(tail), all.narrow(0, 4, 2), 1e-6, 1e-7));
  whole.noiseSeeds = seedsFor(1, 0, 6);  // another step draws other noise
  EXPECT_FALSE(at::allclose(model->losses(whole), all));
  whole.noiseSeeds.pop_back();
  EXPECT_THROW(model->losses(whole), Error);
}

// The loss is DDPM's: with the same timestep and noise as the model drew, recomputing
// x_t = sqrt(abar) x0 + sqrt(1 - abar) eps by hand gives the same mean-squared error.
TEST(DiffusionTest, LossIsNoisePredictionError) {
  torch::manual_seed(5);
  auto model = initialized(std::make_shared<DiffusionDenoiser>(diffusionOptions(), std::vector<int64_t>{3}));
  datasets::Batch batch;
  batch.inputs = torch::randn({1, 3});
  batch.noiseSeeds = seedsFor(2, 7, 1);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(batch.noiseSeeds[0]);
  const int64_t t = at::randint(50, {1}, gen, at::kLong).item<int64_t>();
  const at::Tensor eps = at::randn({1, 3}, gen, at::kFloat);
  const double abar = model->schedule().alphaBars[static_cast<size_t>(t)];
  const at::Tensor noisy = std::sqrt(abar) * batch.inputs + std::sqrt(1 - abar) * eps;
  const at::Tensor expected = (model->forward(noisy, torch::full({1}, t, at::kLong)) - eps).square().mean();
  EXPECT_NEAR(model->losses(batch).item<double>(), expected.item<double>(), 1e-6);
  // The schedule: linear betas, abar the running product.
  const NoiseSchedule& s = model->schedule();
  EXPECT_DOUBLE_EQ(s.betas.front(), 1e-4);
  EXPECT_DOUBLE_EQ(s.betas.back(), 0.02);
  EXPECT_NEAR(s.alphaBars[2], (1 - s.betas[0]) * (1 - s.betas[1]) * (1 - s.betas[2]), 1e-15);
  EXPECT_THROW(NoiseSchedule(10, 0.1, 0.01), ConfigError);
}

// With the exact noise predictor of Gaussian data N(m, s^2) (E[eps | x_t] =
// sqrt(1 - abar) (x_t - sqrt(abar) m) / (abar s^2 + 1 - abar)), DDPM sampling draws from
// N(m, s^2): checks the update and the noise it injects.
TEST(DiffusionTest, SamplerWithTheExactDenoiserDrawsTheDataDistribution) {
  const NoiseSchedule schedule(200, 1e-4, 0.05);
  const double m = 0.5, sd = 0.3;
  const auto exact = [&](const at::Tensor& x, const at::Tensor& t) {
    const double abar = schedule.alphaBars[static_cast<size_t>(t[0].item<int64_t>())];
    return std::sqrt(1 - abar) * (x - std::sqrt(abar) * m) / (abar * sd * sd + 1 - abar);
  };
  constexpr int64_t kSamples = 2000;
  std::vector<uint64_t> seeds;
  for (int64_t i = 0; i < kSamples; ++i) seeds.push_back(datasets::noiseSeed(9, -4, i));
  const at::Tensor noise = samplingNoise({1}, kSamples, 9);
  const at::Tensor samples = sampleDdpm(schedule, noise, seeds, exact);
  ASSERT_EQ(samples.sizes(), (c10::IntArrayRef{kSamples, 1}));
  EXPECT_NEAR(samples.mean().item<double>(), m, 0.03);  // standard error 0.007
  EXPECT_NEAR(samples.std().item<double>(), sd, 0.03);
  EXPECT_TRUE(samples.equal(sampleDdpm(schedule, noise, seeds, exact)));  // same seeds, same samples
  // A sample is its own: drawn alone (another batch, another rank), it is the same.
  EXPECT_TRUE(samples.slice(0, 7, 9).equal(sampleDdpm(schedule, noise.slice(0, 7, 9), {seeds[7], seeds[8]}, exact)));
}

ModelOptions velocityOptions(const std::string& schedule) {
  ModelOptions o = diffusionOptions();
  o.noise_schedule = schedule;
  o.zero_terminal_snr = true;
  o.prediction = "v";
  return o;
}

// Cosine betas follow abar(t + 1) / abar(0) until capped; zero terminal SNR maps sqrt(abar)
// affinely onto [0, sqrt(abar_0)] (Lin et al. 2024), the betas the ratios of what results.
TEST(DiffusionTest, CosineAndZeroTerminalSnrSchedules) {
  ModelOptions o = diffusionOptions();
  o.timesteps = 1000;
  o.noise_schedule = "cosine";
  o.prediction = "v";
  const NoiseSchedule cosine(o);
  const auto f = [](double u) { return std::pow(std::cos((u / 1000 + 0.008) / 1.008 * M_PI / 2), 2); };
  for (int64_t t : {0, 10, 500, 900}) EXPECT_NEAR(cosine.alphaBars[static_cast<size_t>(t)], f(t + 1) / f(0), 1e-12) << t;
  EXPECT_DOUBLE_EQ(cosine.betas.back(), 0.999);
  EXPECT_EQ(cosine.prediction, Prediction::kVelocity);
  for (const std::string kind : {"linear", "cosine"}) {
    ModelOptions base = o;
    base.noise_schedule = kind;
    ModelOptions zero = velocityOptions(kind);
    zero.timesteps = 1000;
    const NoiseSchedule b(base), z(zero);
    EXPECT_EQ(z.prediction, Prediction::kVelocity);
    EXPECT_EQ(z.alphaBars.back(), 0.0) << kind;
    EXPECT_EQ(z.betas.back(), 1.0) << kind;
    EXPECT_NEAR(z.alphaBars.front(), b.alphaBars.front(), 1e-15);
    const double first = std::sqrt(b.alphaBars.front()), last = std::sqrt(b.alphaBars.back());
    double product = 1.0;
    for (size_t t = 0; t + 1 < z.alphaBars.size(); ++t) {
      product *= 1.0 - z.betas[t];
      EXPECT_NEAR(z.alphaBars[t], product, 1e-12) << kind << " t " << t;
      EXPECT_NEAR(z.signal(static_cast<int64_t>(t)), (std::sqrt(b.alphaBars[t]) - last) / (first - last) * first, 1e-12);
    }
  }
  ModelOptions noise = o;
  noise.noise_schedule = "linear";
  noise.prediction = "eps";
  noise.zero_terminal_snr = true;  // a noise prediction at abar = 0 says nothing of x0
  EXPECT_THROW(NoiseSchedule{noise}, ConfigError);
  noise.zero_terminal_snr = false;
  noise.noise_schedule = "cosine";  // abar_999 = 2e-9: a factor 20000 on every error
  EXPECT_THROW(NoiseSchedule{noise}, ConfigError);
  noise.noise_schedule = "linear";
  EXPECT_NO_THROW(NoiseSchedule{noise});
  noise.prediction = "x0";
  EXPECT_THROW(NoiseSchedule{noise}, ConfigError);
}

// A velocity denoiser learns v = sqrt(abar) eps - sqrt(1 - abar) x0 of the draws the
// noise-prediction loss makes, and its estimates invert the forward process, also at abar = 0.
TEST(DiffusionTest, VelocityLossAndEstimates) {
  torch::manual_seed(5);
  auto model = initialized(std::make_shared<DiffusionDenoiser>(velocityOptions("cosine"), std::vector<int64_t>{3}));
  datasets::Batch batch;
  batch.inputs = torch::randn({1, 3});
  batch.noiseSeeds = seedsFor(2, 7, 1);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(batch.noiseSeeds[0]);
  const int64_t t = at::randint(50, {1}, gen, at::kLong).item<int64_t>();
  const at::Tensor eps = at::randn({1, 3}, gen, at::kFloat);
  const NoiseSchedule& s = model->schedule();
  const at::Tensor noisy = s.signal(t) * batch.inputs + s.spread(t) * eps;
  const at::Tensor v = s.signal(t) * eps - s.spread(t) * batch.inputs;
  const at::Tensor expected = (model->forward(noisy, torch::full({1}, t, at::kLong)) - v).square().mean();
  EXPECT_NEAR(model->losses(batch).item<double>(), expected.item<double>(), 1e-6);

  const at::Tensor x0 = torch::randn({4, 3}), e = torch::randn({4, 3});
  for (int64_t step : {0, 25, 49}) {  // 49: pure noise
    const at::Tensor x = s.signal(step) * x0 + s.spread(step) * e;
    const at::Tensor out = s.signal(step) * e - s.spread(step) * x0;
    EXPECT_TRUE(at::allclose(s.cleanEstimate(x, out, s.signal(step), s.spread(step)), x0, 1e-5, 1e-5)) << step;
    EXPECT_TRUE(at::allclose(s.noiseEstimate(x, out, s.signal(step), s.spread(step)), e, 1e-5, 1e-5)) << step;
    const at::Tensor perSample = at::full({4, 1}, s.signal(step)), spread = at::full({4, 1}, s.spread(step));
    EXPECT_TRUE(at::allclose(s.cleanEstimate(x, out, perSample, spread), x0, 1e-5, 1e-5)) << step;
    EXPECT_TRUE(s.target(x0, e, perSample, spread).allclose(out, 1e-6, 1e-6)) << step;
  }
}

// Min-SNR-gamma (model.loss_weighting: min_snr): the weighted loss of either output is the
// clean-sample error times min(SNR, gamma), whatever the output's own scale, and the loss a
// model returns is its uniform loss times the weight of the timestep it drew.
TEST(DiffusionTest, MinSnrWeightsTheCleanSampleErrorByTheClampedSnr) {
  torch::manual_seed(6);
  const double gamma = 5.0;
  for (const std::string prediction : {"eps", "v"}) {
    ModelOptions o = velocityOptions("cosine");
    o.prediction = prediction;
    o.zero_terminal_snr = prediction == "v";
    o.noise_schedule = prediction == "v" ? "cosine" : "linear";
    o.timesteps = 1000;
    const NoiseSchedule s(o);
    const at::Tensor x0 = torch::randn({64, 3}), e = torch::randn({64, 3}), out = torch::randn({64, 3});
    for (int64_t t : {0, 20, 100, 400, 800, 998}) {
      const double abar = s.alphaBars[static_cast<size_t>(t)], snr = abar / (1 - abar);
      const at::Tensor sig = at::full({64, 1}, s.signal(t)), spr = at::full({64, 1}, s.spread(t));
      const at::Tensor x = sig * x0 + spr * e;
      const double outputError = (out - s.target(x0, e, sig, spr)).square().mean().item<double>();
      const double cleanError = (s.cleanEstimate(x, out, sig, spr) - x0).square().mean().item<double>();
      const double w = minSnrLossWeight(abar, s.prediction, gamma);
      EXPECT_NEAR(w * outputError, std::min(snr, gamma) * cleanError, 1e-4 * std::min(snr, gamma) * cleanError)
          << prediction << " t " << t << " snr " << snr;
      EXPECT_LE(w, 1.0 + 1e-12) << prediction << " t " << t;
    }
    EXPECT_EQ(minSnrLossWeight(0.0, s.prediction, gamma), prediction == "v" ? 0.0 : 1.0);  // pure noise
  }
  EXPECT_THROW(minSnrLossWeight(1.0, Prediction::kVelocity, gamma), Error);

  ModelOptions uniform = velocityOptions("cosine"), weighted = uniform;
  weighted.loss_weighting = "min_snr";
  weighted.min_snr_gamma = gamma;
  // The same initialisation seed: the same weights, so only the weighting differs.
  auto a = initialized(std::make_shared<DiffusionDenoiser>(uniform, std::vector<int64_t>{3}), 7);
  auto b = initialized(std::make_shared<DiffusionDenoiser>(weighted, std::vector<int64_t>{3}), 7);
  ASSERT_EQ(a->parameters().size(), b->parameters().size());
  for (size_t i = 0; i < a->parameters().size(); ++i) ASSERT_TRUE(a->parameters()[i].equal(b->parameters()[i]));
  datasets::Batch batch;
  batch.inputs = torch::randn({8, 3});
  batch.noiseSeeds = seedsFor(3, 0, 8);
  const at::Tensor plain = a->losses(batch), scaled = b->losses(batch);
  for (int64_t i = 0; i < 8; ++i) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(batch.noiseSeeds[static_cast<size_t>(i)]);
    const int64_t t = at::randint(a->schedule().timesteps, {1}, gen, at::kLong).item<int64_t>();
    const double w = minSnrLossWeight(a->schedule().alphaBars[static_cast<size_t>(t)], Prediction::kVelocity, gamma);
    EXPECT_NEAR(scaled[i].item<double>(), w * plain[i].item<double>(), 1e-6 * plain[i].item<double>() + 1e-9) << i;
  }
  EXPECT_FALSE(at::allclose(plain, scaled));
}

// With the exact velocity of Gaussian data N(m, s^2) on a schedule that ends in pure noise,
// DDPM and DDIM both start at abar = 0 and draw the data's distribution.
TEST(DiffusionTest, SamplersStartFromPureNoiseWithAVelocityDenoiser) {
  ModelOptions o = velocityOptions("linear");
  o.timesteps = 200;
  o.beta_end = 0.05;
  const NoiseSchedule schedule(o);
  ASSERT_EQ(schedule.alphaBars.back(), 0.0);
  const double m = 0.5, sd = 0.3;
  const auto exact = [&](const at::Tensor& x, const at::Tensor& t) {
    const int64_t step = t[0].item<int64_t>();
    const double abar = schedule.alphaBars[static_cast<size_t>(step)];
    const at::Tensor x0 = m + sd * sd * std::sqrt(abar) * (x - std::sqrt(abar) * m) / (abar * sd * sd + 1 - abar);
    const at::Tensor eps = abar < 1 ? (x - std::sqrt(abar) * x0) / std::sqrt(1 - abar) : x;
    return std::sqrt(abar) * eps - std::sqrt(1 - abar) * x0;
  };
  constexpr int64_t kSamples = 2000;
  std::vector<uint64_t> seeds;
  for (int64_t i = 0; i < kSamples; ++i) seeds.push_back(datasets::noiseSeed(9, -4, i));
  const at::Tensor noise = samplingNoise({1}, kSamples, 9);
  for (const auto& [name, samples] : {std::pair{"ddpm", sampleDdpm(schedule, noise, seeds, exact)},
                                      std::pair{"ddim", sampleDdim(schedule, noise, 100, exact)}}) {
    EXPECT_TRUE(samples.isfinite().all().item<bool>()) << name;
    EXPECT_NEAR(samples.mean().item<double>(), m, 0.03) << name;
    EXPECT_NEAR(samples.std().item<double>(), sd, 0.03) << name;
  }
  // One DDIM step from pure noise is the clean estimate there: the data's mean.
  EXPECT_TRUE(at::allclose(sampleDdim(schedule, noise, std::vector<int64_t>{199}, exact), at::full({kSamples, 1}, m),
                           1e-6, 1e-6));
}

// model.final_conv: a zero-initialised residual 3x3 convolution named final_conv over the
// DiT's unpatchified output. A fresh model still outputs zero; once the convolution is
// non-zero, each output pixel depends on its neighbours across the patch border.
TEST(DiTTest, FinalConvSmoothsAcrossPatchBorders) {
  ModelOptions o = smallDitOptions();
  const auto plain = initialized(makeModel(o, floatSpec({1, 8, 8}, /*classes=*/3)));
  o.final_conv = true;
  const auto withConv = initialized(makeModel(o, floatSpec({1, 8, 8}, /*classes=*/3)));
  auto namesOf = [](torch::nn::Module& m) { return names(m); };
  std::set<std::string> expected = namesOf(*plain);
  expected.insert({"final_conv.weight", "final_conv.bias"});
  EXPECT_EQ(namesOf(*withConv), expected);
  auto* dit = dynamic_cast<Denoiser*>(withConv.get());
  ASSERT_NE(dit, nullptr);
  const at::Tensor x = torch::randn({2, 1, 8, 8}), t = torch::tensor(std::vector<int64_t>{3, 40});
  const at::Tensor y = torch::tensor(std::vector<int64_t>{0, 3});
  EXPECT_TRUE(dit->predict(x, t, y).eq(0).all().item<bool>());  // adaLN-Zero and a zero convolution
  torch::NoGradGuard noGrad;
  for (auto& item : withConv->named_parameters()) {
    if (item.key() == "final_layer.linear.bias") item.value().fill_(0.5);  // every pixel of every patch 0.5
    if (item.key() == "final_conv.weight") item.value().fill_(0.1);
  }
  const at::Tensor out = dit->predict(x, t, y);
  // Inside the image: 0.5 + 0.1 * 9 * 0.5; at a corner only 4 neighbours exist.
  EXPECT_NEAR(out[0][0][3][4].item<double>(), 0.95, 1e-6);
  EXPECT_NEAR(out[0][0][0][0].item<double>(), 0.7, 1e-6);
}

// model.patch_overlap m: the final linear predicts a (p + 2m)^2 window per patch, centred on
// it, and each pixel is the weighted mean of the windows over it (weights 1 inside, falling
// linearly over the 2m shared pixels). Patch 4, m 1 on an 8x8 image: windows of 6 rows
// starting at rows -1 and 3, weights [0.25, 0.75, 1, 1, 0.75, 0.25]. With every window
// predicting its own row index i, row y of the image is the weighted mean of the i that
// cover it: rows 0-2 see window 0 alone (1, 2, 3), row 3 (0.75 x 4 + 0.25 x 0) = 3, row 4
// (0.25 x 5 + 0.75 x 1) = 2, rows 5-6 see window 1 alone (2, 3), row 7 window 1's 4.
TEST(DiTTest, PatchOverlapBlendsNeighbouringWindows) {
  ModelOptions o = smallDitOptions();
  o.patch_overlap = 1;
  const auto model = initialized(makeModel(o, floatSpec({2, 8, 8}, /*classes=*/3)));
  auto* dit = dynamic_cast<Denoiser*>(model.get());
  ASSERT_NE(dit, nullptr);
  std::set<std::string> expected = names(*initialized(makeModel(smallDitOptions(), floatSpec({2, 8, 8}, 3))));
  EXPECT_EQ(names(*model), expected);  // the reference's names: only the final linear's rows change
  const at::Tensor x = torch::randn({2, 2, 8, 8}), t = torch::tensor(std::vector<int64_t>{3, 40});
  const at::Tensor y = torch::tensor(std::vector<int64_t>{0, 3});
  EXPECT_TRUE(dit->predict(x, t, y).eq(0).all().item<bool>());  // adaLN-Zero and a zero final linear
  torch::NoGradGuard noGrad;
  constexpr int64_t kWindow = 6, kChannels = 2;
  for (auto& item : model->named_parameters()) {
    if (item.key() == "final_layer.linear.weight") {
      EXPECT_EQ(item.value().sizes(), (at::IntArrayRef{kWindow * kWindow * kChannels, 16}));
    }
    if (item.key() != "final_layer.linear.bias") continue;
    // The window's pixels in (row, column, channel) order, as the reference unpatchifies.
    item.value().copy_(at::arange(kWindow, at::kFloat).view({kWindow, 1, 1}).expand({kWindow, kWindow, kChannels}).reshape(-1));
  }
  const at::Tensor rows = at::tensor({1.0F, 2.0F, 3.0F, 3.0F, 2.0F, 2.0F, 3.0F, 4.0F}).view({1, 1, 8, 1});
  EXPECT_TRUE(at::allclose(dit->predict(x, t, y), rows.expand({2, kChannels, 8, 8}), 1e-6, 1e-6))
      << dit->predict(x, t, y)[0][0];
  // With the bias 0.5 everywhere, every pixel is 0.5: the weights are normalised at the borders too.
  for (auto& item : model->named_parameters()) {
    if (item.key() == "final_layer.linear.bias") item.value().fill_(0.5);
  }
  EXPECT_TRUE(at::allclose(dit->predict(x, t, y), at::full({2, kChannels, 8, 8}, 0.5), 1e-6, 1e-6));
  // More than half the patch would let a pixel see windows two patches away: refused.
  o.patch_overlap = 3;
  EXPECT_THROW(makeModel(o, floatSpec({2, 8, 8}, 3)), ConfigError);
}

// A small class-conditional DiT (3 classes, 1x8x8) whose weights are drawn with `seed`
// past adaLN-Zero's zeros, so that its conditional and unconditional outputs differ.
std::shared_ptr<TrainModel> guidableDit(uint64_t seed) {
  const auto model = initialized(makeModel(smallDitOptions(), floatSpec({1, 8, 8}, /*classes=*/3)));
  torch::NoGradGuard noGrad;
  torch::manual_seed(seed);
  for (auto& item : model->named_parameters()) item.value().normal_(0, 0.3);
  return model;
}

// Guidance only inside its interval: e_u + cfg (e_c - e_u) at the timesteps in [first,
// last], the conditional output alone outside it; the default interval guides everywhere.
TEST(DiffusionTest, GuidanceAppliesOnlyInItsInterval) {
  const auto model = guidableDit(5);
  auto* dit = dynamic_cast<Denoiser*>(model.get());
  ASSERT_NE(dit, nullptr);
  torch::NoGradGuard noGrad;
  const at::Tensor x = torch::randn({2, 1, 8, 8}), y = torch::tensor(std::vector<int64_t>{0, 2});
  const auto at = [](int64_t t) { return at::full({2}, t, at::kLong); };
  const auto expected = [&](int64_t t, double cfg) {
    const at::Tensor c = predictInUnits(*dit, x, at(t), y), u = predictInUnits(*dit, x, at(t));
    return u + cfg * (c - u);
  };
  ASSERT_GT((expected(30, 3.0) - expected(30, 1.0)).abs().max().item<double>(), 1e-3) << "guidance changes nothing";
  const PredictFunction inside = guidedPrediction(*dit, y, 3.0, GuidanceInterval{10, 30});
  for (int64_t t : {10, 20, 30}) EXPECT_TRUE(at::allclose(inside(x, at(t)), expected(t, 3.0))) << "t " << t;
  for (int64_t t : {0, 9, 31, 49}) EXPECT_TRUE(at::allclose(inside(x, at(t)), expected(t, 1.0))) << "t " << t;
  const PredictFunction everywhere = guidedPrediction(*dit, y, 3.0);
  for (int64_t t : {0, 49}) EXPECT_TRUE(at::allclose(everywhere(x, at(t)), expected(t, 3.0))) << "t " << t;
}

// DMD's real score draws a timestep per sample: each sample is guided where its own
// timestep is in the interval, whatever the others' are.
TEST(DiffusionTest, PerSampleGuidanceFollowsEachSamplesTimestep) {
  const auto model = guidableDit(6);
  auto* dit = dynamic_cast<Denoiser*>(model.get());
  ASSERT_NE(dit, nullptr);
  torch::NoGradGuard noGrad;
  const at::Tensor x = torch::randn({4, 1, 8, 8}), y = torch::tensor(std::vector<int64_t>{0, 2, 1, 0});
  const at::Tensor t = torch::tensor(std::vector<int64_t>{5, 20, 40, 30});
  const at::Tensor c = predictInUnits(*dit, x, t, y), u = predictInUnits(*dit, x, t);
  const at::Tensor guided = u + 3.0 * (c - u);
  ASSERT_GT((guided - c).abs().max().item<double>(), 1e-3) << "guidance changes nothing";
  const at::Tensor out = guidedPredictionPerSample(*dit, x, t, y, 3.0, GuidanceInterval{10, 30});
  const std::vector<bool> inside{false, true, false, true};
  for (int64_t i = 0; i < 4; ++i) {
    const at::Tensor want = inside[static_cast<size_t>(i)] ? guided[i] : c[i];
    EXPECT_TRUE(at::allclose(out[i], want)) << "sample " << i << " at t " << t[i].item<int64_t>();
  }
  EXPECT_TRUE(at::allclose(guidedPredictionPerSample(*dit, x, t, y, 3.0), guided));  // every timestep
  EXPECT_TRUE(at::allclose(guidedPredictionPerSample(*dit, x, t, y, 1.0, GuidanceInterval{10, 30}), c));
}

// The exported names are those of the equivalent PyTorch module: the weights load into it
// with strict=True and it computes the same noise prediction (an independent
// implementation in Python, python3-torch).
TEST(DiffusionTest, MatchesTheEquivalentPyTorchModule) {
  const std::string python = TESSERA_PYTHON3;
  if (std::system((python + " -c 'import torch' 2>/dev/null").c_str()) != 0) GTEST_SKIP() << python << " has no torch";
  torch::manual_seed(8);
  ModelOptions o = diffusionOptions();
  o.embed_dim = 9;  // odd: the time embedding is zero-padded
  auto model = initialized(std::make_shared<DiffusionDenoiser>(o, std::vector<int64_t>{2, 3}));
  std::map<std::string, at::Tensor> tensors;
  for (const auto& item : model->named_parameters()) tensors["param." + item.key()] = item.value().detach();
  tensors["x"] = torch::randn({4, 2, 3});
  tensors["t"] = torch::tensor(std::vector<int64_t>{0, 3, 17, 49});
  tensors["out"] = model->forward(tensors["x"], tensors["t"]).detach();
  const auto dir = std::filesystem::temp_directory_path();
  const std::string data = (dir / ("tessera_denoiser_" + std::to_string(::getpid()) + ".safetensors")).string();
  const std::string script = (dir / ("tessera_denoiser_" + std::to_string(::getpid()) + ".py")).string();
  checkpoint::saveSafetensors(data, tensors);
  std::ofstream(script) << R"PY(
import json, math, struct, sys
import torch
from torch import nn
import torch.nn.functional as F

class Block(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.norm, self.time_proj = nn.LayerNorm(w), nn.Linear(w, w)
        self.fc1, self.fc2 = nn.Linear(w, 4 * w), nn.Linear(4 * w, w)
    def forward(self, h, temb):
        return h + self.fc2(F.silu(self.fc1(self.norm(h) + self.time_proj(F.silu(temb)))))

class Denoiser(nn.Module):
    def __init__(self, features, w, layers):
        super().__init__()
        self.w = w
        self.time_embed = nn.Sequential(nn.Linear(w, w), nn.SiLU(), nn.Linear(w, w))
        self.input_proj = nn.Linear(features, w)
        self.blocks = nn.ModuleList([Block(w) for _ in range(layers)])
        self.out_norm, self.output_proj = nn.LayerNorm(w), nn.Linear(w, features)
    def forward(self, x, t):
        half = self.w // 2
        freqs = torch.exp(torch.arange(half, dtype=torch.float32) * (-math.log(10000.0) / max(half, 1)))
        args = t.float()[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], 1)
        if self.w % 2:
            emb = torch.cat([emb, torch.zeros(emb.shape[0], 1)], 1)
        temb = self.time_embed(emb)
        h = self.input_proj(x.flatten(1))
        for block in self.blocks:
            h = block(h, temb)
        return self.output_proj(self.out_norm(h)).view(x.shape)

raw = open(sys.argv[1], 'rb').read()
n = struct.unpack('<Q', raw[:8])[0]
header = json.loads(raw[8:8 + n])
types = {'F32': torch.float32, 'I64': torch.int64}
tensors = {name: torch.frombuffer(bytearray(raw[8 + n + info['data_offsets'][0]:8 + n + info['data_offsets'][1]]),
                                  dtype=types[info['dtype']]).reshape(info['shape'])
           for name, info in header.items() if name != '__metadata__'}
model = Denoiser(6, 9, 2)
model.load_state_dict({k[len('param.'):]: v for k, v in tensors.items() if k.startswith('param.')}, strict=True)
with torch.no_grad():
    out = model(tensors['x'], tensors['t'])
err = (out - tensors['out']).abs().max().item()
print('max abs difference', err)
sys.exit(0 if err < 1e-5 else 1)
)PY";
  std::string command = python + " " + script + " " + data + " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buffer[512];
  while (std::fgets(buffer, sizeof buffer, pipe)) output += buffer;
  const int status = ::pclose(pipe);
  EXPECT_EQ(status, 0) << output;
  std::filesystem::remove(data);
  std::filesystem::remove(script);
}

// The convnet (the second judge's architecture): PyTorch's Conv2d names per stage, each
// stage a 3x3 convolution with padding 1, ReLU and a 2x2 max pool; fc over the flattened
// map with ReLU gives the features the head reads; cross-entropy of the classes. Refused
// for anything but labelled images or without a feature width.
TEST(ConvNetTest, StagesFeaturesAndHeadAsTorchWouldComputeThem) {
  ModelOptions o;
  o.arch = "convnet";
  o.hidden = {4, 6, 5};
  auto net = std::dynamic_pointer_cast<FeatureModel>(initialized(makeModel(o, floatSpec({2, 8, 12}, /*classes=*/3))));
  ASSERT_NE(net, nullptr);
  EXPECT_EQ(names(*net), (std::set<std::string>{"stages.0.weight", "stages.0.bias", "stages.1.weight", "stages.1.bias",
                                                "fc.weight", "fc.bias", "head.weight", "head.bias"}));
  EXPECT_EQ(unitNames(*net), (std::vector<std::string>{"stages.0", "stages.1"}));
  auto p = net->named_parameters();
  EXPECT_EQ(p["stages.1.weight"].sizes(), (c10::IntArrayRef{6, 4, 3, 3}));
  EXPECT_EQ(p["fc.weight"].sizes(), (c10::IntArrayRef{5, 6 * 2 * 3}));  // 8 x 12 pooled twice
  const at::Tensor x = torch::randn({3, 2, 8, 12});  // not square: height and width kept apart
  at::Tensor h = x;
  for (const char* s : {"stages.0", "stages.1"}) {
    h = torch::max_pool2d(torch::relu(torch::conv2d(h, p[std::string(s) + ".weight"], p[std::string(s) + ".bias"], 1, 1)), 2);
  }
  const at::Tensor features = torch::relu(torch::linear(h.flatten(1), p["fc.weight"], p["fc.bias"]));
  EXPECT_TRUE(at::allclose(net->features(x), features, 1e-5, 1e-6));
  const at::Tensor logits = net->forward(x);
  EXPECT_TRUE(at::allclose(logits, torch::linear(features, p["head.weight"], p["head.bias"]), 1e-5, 1e-6));
  datasets::Batch batch;
  batch.inputs = x;
  batch.targets = torch::tensor(std::vector<int64_t>{2, 0, 1});
  const at::Tensor expected = -logits.log_softmax(1).gather(1, batch.targets.unsqueeze(1)).squeeze(1);
  EXPECT_TRUE(at::allclose(net->losses(batch), expected, 1e-5, 1e-6));
  // The stages are im2col and kernels::linear's product (not at::conv2d, whose kernels the
  // CPU chooses): their gradients are torch::conv2d's, the input's too.
  {
    const at::Tensor xn = x.clone().requires_grad_(true), xt = x.clone().requires_grad_(true);
    std::map<std::string, at::Tensor> torchParams;
    for (const auto& item : p) torchParams[item.key()] = item.value().detach().clone().requires_grad_(true);
    net->losses(datasets::Batch{xn, batch.targets}).sum().backward();
    at::Tensor ht = xt;
    for (const char* s : {"stages.0", "stages.1"}) {
      ht = torch::max_pool2d(
          torch::relu(torch::conv2d(ht, torchParams[std::string(s) + ".weight"], torchParams[std::string(s) + ".bias"], 1, 1)), 2);
    }
    const at::Tensor ft = torch::relu(torch::linear(ht.flatten(1), torchParams["fc.weight"], torchParams["fc.bias"]));
    const at::Tensor lt = torch::linear(ft, torchParams["head.weight"], torchParams["head.bias"]);
    (-lt.log_softmax(1).gather(1, batch.targets.unsqueeze(1))).sum().backward();
    for (const auto& item : p) {
      ASSERT_TRUE(item.value().grad().defined()) << item.key();
      EXPECT_TRUE(at::allclose(item.value().grad(), torchParams[item.key()].grad(), 1e-4, 1e-6)) << item.key();
    }
    EXPECT_TRUE(at::allclose(xn.grad(), xt.grad(), 1e-4, 1e-6));
  }
  // The convolutions' FLOPs (2 x 4 x 2 x 9 over 8 x 12 pixels, 2 x 6 x 4 x 9 over 4 x 6) and
  // the two linears'.
  EXPECT_DOUBLE_EQ(net->forwardFlopsPerSample(), 2.0 * 72 * 96 + 2.0 * 216 * 24 + 2.0 * 5 * 36 + 2.0 * 3 * 5);
  EXPECT_THROW(makeModel(o, floatSpec({2, 8, 8})), ConfigError);     // no classes
  EXPECT_THROW(makeModel(o, floatSpec({64}, 3)), ConfigError);       // not images
  o.hidden = {4};
  EXPECT_THROW(makeModel(o, floatSpec({2, 8, 8}, 3)), ConfigError);  // no feature width
}

TEST(FeatureMlpTest, ClassesAndRegression) {
  torch::manual_seed(6);
  ModelOptions o;
  o.hidden = {7, 5};
  auto classifier = std::dynamic_pointer_cast<FeatureMlp>(initialized(makeModel(o, floatSpec({2, 3}, /*classes=*/4))));
  ASSERT_NE(classifier, nullptr);
  EXPECT_EQ(names(*classifier), (std::set<std::string>{"layers.0.weight", "layers.0.bias", "layers.1.weight",
                                                        "layers.1.bias", "head.weight", "head.bias"}));
  datasets::Batch batch;
  batch.inputs = torch::randn({3, 2, 3});
  batch.targets = torch::tensor(std::vector<int64_t>{3, 0, 1});
  const at::Tensor logits = classifier->forward(batch.inputs);
  EXPECT_EQ(logits.sizes(), (c10::IntArrayRef{3, 4}));
  const at::Tensor expected = -logits.log_softmax(1).gather(1, batch.targets.unsqueeze(1)).squeeze(1);
  EXPECT_TRUE(at::allclose(classifier->losses(batch), expected, 1e-5, 1e-6));

  auto regressor = std::dynamic_pointer_cast<FeatureMlp>(initialized(makeModel(o, floatSpec({6}, 0, {2}))));
  batch.inputs = torch::randn({3, 6});
  batch.targets = torch::randn({3, 2});
  const at::Tensor mse = (regressor->forward(batch.inputs) - batch.targets).square().mean(1);
  EXPECT_TRUE(at::allclose(regressor->losses(batch), mse, 1e-5, 1e-6));
  auto scalar = std::dynamic_pointer_cast<FeatureMlp>(initialized(makeModel(o, floatSpec({6}, 0, {}))));  // targets [n]
  batch.targets = torch::randn({3});
  EXPECT_TRUE(at::allclose(scalar->losses(batch), (scalar->forward(batch.inputs).squeeze(1) - batch.targets).square(),
                           1e-5, 1e-6));
  datasets::DataSpec unlabelled = floatSpec({6});
  unlabelled.hasTargets = false;
  EXPECT_THROW(makeModel(o, unlabelled), ConfigError);
  o.arch = "gpt";
  EXPECT_THROW(makeModel(o, floatSpec({6}, 3)), ConfigError);
}

}  // namespace
}  // namespace tessera::models
