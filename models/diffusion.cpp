// The diffusion denoisers' shared loss, guidance and samplers, and the residual-MLP denoiser
// (see diffusion.h).
#include "models/diffusion.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/accumulate.h>
#include <torch/nn/modules/activation.h>

#include <algorithm>
#include <cmath>

#include "common/errors.h"
#include "sharding/unit.h"

namespace tessera::models {

NoiseSchedule::NoiseSchedule(int64_t steps, double betaStart, double betaEnd) : timesteps(steps) {
  TESSERA_CHECK_AS(ConfigError, steps >= 1, "model.timesteps must be >= 1, got ", steps);
  TESSERA_CHECK_AS(ConfigError, betaStart > 0 && betaStart <= betaEnd && betaEnd < 1, "model.beta_start ", betaStart,
                   " and model.beta_end ", betaEnd, " must satisfy 0 < beta_start <= beta_end < 1");
  double product = 1.0;
  for (int64_t t = 0; t < steps; ++t) {
    const double beta = steps == 1 ? betaStart : betaStart + (betaEnd - betaStart) * static_cast<double>(t) / (steps - 1);
    product *= 1.0 - beta;
    betas.push_back(beta);
    alphaBars.push_back(product);
  }
}

NoiseSchedule::NoiseSchedule(const ModelOptions& o) : NoiseSchedule(o.timesteps, o.beta_start, o.beta_end) {
  TESSERA_CHECK_AS(ConfigError, o.noise_schedule == "linear" || o.noise_schedule == "cosine",
                   "model.noise_schedule: unknown schedule '", o.noise_schedule, "' (linear, cosine)");
  TESSERA_CHECK_AS(ConfigError, o.prediction == "eps" || o.prediction == "v", "model.prediction: unknown '",
                   o.prediction, "' (eps, v)");
  prediction = o.prediction == "v" ? Prediction::kVelocity : Prediction::kNoise;
  if (o.noise_schedule == "cosine") {
    TESSERA_CHECK_AS(ConfigError, prediction == Prediction::kVelocity,
                     "model.noise_schedule cosine needs model.prediction v: its last abar (2e-9) makes a noise "
                     "prediction's clean estimate multiply every error by 20000");
    // abar(u) = f(u) / f(0), f(u) = cos^2((u / T + s) / (1 + s) pi / 2), s = 0.008; abar_t =
    // abar(t + 1), each beta capped at 0.999 (improved-diffusion's betas_for_alpha_bar).
    constexpr double kOffset = 0.008, kMaxBeta = 0.999;
    const auto f = [&](double u) {
      const double c = std::cos((u / static_cast<double>(timesteps) + kOffset) / (1 + kOffset) * M_PI / 2);
      return c * c;
    };
    double product = 1.0;
    for (int64_t t = 0; t < timesteps; ++t) {
      const double beta = std::min(1.0 - f(static_cast<double>(t + 1)) / f(static_cast<double>(t)), kMaxBeta);
      product *= 1.0 - beta;
      betas[static_cast<size_t>(t)] = beta;
      alphaBars[static_cast<size_t>(t)] = product;
    }
  }
  if (o.zero_terminal_snr) {
    TESSERA_CHECK_AS(ConfigError, prediction == Prediction::kVelocity,
                     "model.zero_terminal_snr needs model.prediction v: at the last timestep (abar = 0) the input is "
                     "pure noise, and a noise prediction says nothing about the clean sample");
    TESSERA_CHECK_AS(ConfigError, timesteps >= 2, "model.zero_terminal_snr needs model.timesteps >= 2, got ",
                     timesteps);
    // Lin et al. 2024, algorithm 1: sqrt(abar) shifted so that its last value is 0 and
    // scaled so that its first stays; the betas from the ratios of consecutive abars.
    const double first = std::sqrt(alphaBars.front()), last = std::sqrt(alphaBars.back());
    double previous = 1.0;
    for (size_t t = 0; t < alphaBars.size(); ++t) {
      const double root = (std::sqrt(alphaBars[t]) - last) * first / (first - last);
      alphaBars[t] = t + 1 == alphaBars.size() ? 0.0 : root * root;
      betas[t] = 1.0 - alphaBars[t] / previous;
      previous = alphaBars[t];
    }
  }
}

double NoiseSchedule::signal(int64_t t) const { return std::sqrt(alphaBars[static_cast<size_t>(t)]); }
double NoiseSchedule::spread(int64_t t) const { return std::sqrt(1.0 - alphaBars[static_cast<size_t>(t)]); }

namespace {

// x0 and eps from an output: eps = out and x0 = (x - spread eps) / signal, or for a
// velocity x0 = signal x - spread v and eps = spread x + signal v. C: double or a tensor.
template <class C>
at::Tensor cleanOf(Prediction p, const at::Tensor& x, const at::Tensor& out, const C& signal, const C& spread) {
  return p == Prediction::kNoise ? (x - spread * out) / signal : signal * x - spread * out;
}
template <class C>
at::Tensor noiseOf(Prediction p, const at::Tensor& x, const at::Tensor& out, const C& signal, const C& spread) {
  return p == Prediction::kNoise ? out : spread * x + signal * out;
}

}  // namespace

at::Tensor NoiseSchedule::cleanEstimate(const at::Tensor& x, const at::Tensor& out, double signal,
                                        double spread) const {
  return cleanOf(prediction, x, out, signal, spread);
}
at::Tensor NoiseSchedule::cleanEstimate(const at::Tensor& x, const at::Tensor& out, const at::Tensor& signal,
                                        const at::Tensor& spread) const {
  return cleanOf(prediction, x, out, signal, spread);
}
at::Tensor NoiseSchedule::noiseEstimate(const at::Tensor& x, const at::Tensor& out, double signal,
                                        double spread) const {
  return noiseOf(prediction, x, out, signal, spread);
}
at::Tensor NoiseSchedule::target(const at::Tensor& x0, const at::Tensor& eps, const at::Tensor& signal,
                                 const at::Tensor& spread) const {
  return prediction == Prediction::kNoise ? eps : signal * eps - spread * x0;
}

DenoiserBlock::DenoiserBlock(int64_t width, at::Device device) {
  norm_ = register_module("norm", layers::LayerNorm(width, device));
  timeProj_ = register_module("time_proj", layers::Linear(width, width, /*bias=*/true, device));
  fc1_ = register_module("fc1", layers::Linear(width, 4 * width, /*bias=*/true, device));
  fc2_ = register_module("fc2", layers::Linear(4 * width, width, /*bias=*/true, device));
}

at::Tensor DenoiserBlock::forward(const at::Tensor& h, const at::Tensor& timeEmbedding) {
  const at::Tensor y = norm_->forward(h) + timeProj_->forward(at::silu(timeEmbedding));
  return h + fc2_->forward(at::silu(fc1_->forward(y)));
}

Denoiser::Denoiser(const ModelOptions& options, std::vector<int64_t> sampleShape, int64_t classes)
    : options_(options),
      sampleShape_(std::move(sampleShape)),
      features_(c10::multiply_integers(sampleShape_)),
      schedule_(options),
      classes_(classes) {
  TESSERA_CHECK_AS(ConfigError, features_ >= 1, options.arch, ": samples have no features (shape [",
                   sampleShape_.size(), " dims])");
  TESSERA_CHECK_AS(ConfigError, classes >= 0, options.arch, ": ", classes, " classes");
}

at::Tensor Denoiser::noClassLabels(int64_t count, at::Device device) const {
  return at::full({count}, classes_, at::TensorOptions().dtype(at::kLong).device(device));
}

DiffusionDenoiser::DiffusionDenoiser(const ModelOptions& options, std::vector<int64_t> sampleShape, at::Device device)
    : Denoiser(options, std::move(sampleShape), /*classes=*/0) {
  const int64_t width = options.embed_dim;
  timeEmbed_ = register_module("time_embed",
                               torch::nn::Sequential(layers::Linear(width, width, /*bias=*/true, device), torch::nn::SiLU(),
                                                     layers::Linear(width, width, /*bias=*/true, device)));
  inputProj_ = register_module("input_proj", layers::Linear(features_, width, /*bias=*/true, device));
  blocks_ = register_module("blocks", sharding::UnitList<DenoiserBlock>());
  for (int64_t i = 0; i < options.layers; ++i) blocks_->emplace_back(width, device);
  outNorm_ = register_module("out_norm", layers::LayerNorm(width, device));
  outputProj_ = register_module("output_proj", layers::Linear(width, features_, /*bias=*/true, device));
  addGanHead(width, device);
}

// The transformer's sinusoidal position encoding of t: [cos(t f_k), sin(t f_k)] with
// f_k = 10000^(-k / half), zero-padded to an odd width.
at::Tensor DiffusionDenoiser::timeEmbedding(const at::Tensor& timesteps) const {
  const int64_t width = options_.embed_dim, half = width / 2;
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(timesteps.device());
  const at::Tensor freqs = at::exp(at::arange(half, opts) * (-std::log(10000.0) / static_cast<double>(std::max<int64_t>(half, 1))));
  const at::Tensor args = timesteps.to(at::kFloat).unsqueeze(1) * freqs.unsqueeze(0);
  at::Tensor emb = at::cat({at::cos(args), at::sin(args)}, 1);
  if (width % 2 == 1) emb = at::cat({emb, at::zeros({emb.size(0), 1}, opts)}, 1);
  return emb;
}

at::Tensor DiffusionDenoiser::blockOutput(const at::Tensor& noisy, const at::Tensor& timesteps,
                                          const at::Tensor& /*labels*/, int64_t block) {
  TESSERA_CHECK(noisy.dim() >= 2 && noisy.numel() == noisy.size(0) * features_ && timesteps.dim() == 1 &&
                    timesteps.size(0) == noisy.size(0),
                "DiffusionDenoiser: expected x_t [batch, ", features_, " features] and t [batch], got ", noisy.sizes(),
                " and ", timesteps.sizes());
  const auto dtype = inputProj_->weight.scalar_type();  // the compute dtype (sharding.param_dtype)
  const at::Tensor temb = timeEmbed_->forward(timeEmbedding(timesteps).to(dtype));
  at::Tensor h = inputProj_->forward(noisy.flatten(1).to(dtype));
  for (int64_t i = 0; i <= block; ++i) h = (*blocks_)[static_cast<size_t>(i)]->forward(h, temb);
  return h;
}

at::Tensor DiffusionDenoiser::forward(const at::Tensor& noisy, const at::Tensor& timesteps) {
  const at::Tensor h = blockOutput(noisy, timesteps, {}, static_cast<int64_t>(blocks_->size()) - 1);
  return outputProj_->forward(outNorm_->forward(h)).view(noisy.sizes());
}

void Denoiser::addGanHead(int64_t width, at::Device device) {
  if (options_.gan_head_block < 0) return;
  ganHead_ = register_module(kGanHeadModule, torch::nn::Sequential(layers::LayerNorm(width, device),
                                                               layers::Linear(width, width, /*bias=*/true, device),
                                                               torch::nn::SiLU(),
                                                               layers::Linear(width, 1, /*bias=*/true, device)));
}

at::Tensor Denoiser::discriminate(const at::Tensor& noisy, const at::Tensor& timesteps, const at::Tensor& labels) {
  TESSERA_CHECK(hasGanHead(), options_.arch, ": discriminate needs a GAN head (model.gan_head_block)");
  const at::Tensor y = labels.defined() ? labels : noClassLabels(noisy.size(0), noisy.device());
  const at::Tensor features = blockOutput(noisy, timesteps, y, options_.gan_head_block);
  const at::Tensor logits = ganHead_->forward(features).to(at::kFloat);  // [N, 1] or [N, tokens, 1]
  return logits.dim() == 3 ? logits.mean({1, 2}) : logits.view({-1});
}

namespace {

// `method` of the denoiser (x_t, t, labels; undefined labels: "no class") with its root
// entered as a unit.
at::Tensor callInUnits(Denoiser& model, const at::Tensor& noisy, const at::Tensor& timesteps, const at::Tensor& labels,
                       at::Tensor (Denoiser::*method)(const at::Tensor&, const at::Tensor&, const at::Tensor&)) {
  const at::Tensor y = labels.defined() ? labels : model.noClassLabels(noisy.size(0), noisy.device());
  return sharding::unitForward(model, std::vector<at::Tensor>{noisy, timesteps, y},
                               [&model, method](const std::vector<at::Tensor>& in) {
                                 return std::vector<at::Tensor>{(model.*method)(in[0], in[1], in[2])};
                               })[0];
}

}  // namespace

at::Tensor discriminateInUnits(Denoiser& model, const at::Tensor& noisy, const at::Tensor& timesteps,
                               const at::Tensor& labels) {
  return callInUnits(model, noisy, timesteps, labels, &Denoiser::discriminate);
}

at::Tensor Denoiser::losses(const datasets::Batch& batch) {
  const at::Tensor& clean = batch.inputs;
  const int64_t n = clean.size(0);
  TESSERA_CHECK(static_cast<int64_t>(batch.noiseSeeds.size()) == n, options_.arch, ": ", batch.noiseSeeds.size(),
                " noise seeds for ", n, " samples");
  const bool conditional = classes_ > 0;
  TESSERA_CHECK(!conditional || (batch.targets.defined() && batch.targets.numel() == n), options_.arch,
                ": a model conditioned on ", classes_, " classes needs a label per sample");
  // Timestep, noise and label drop of each sample from its own generator (CPU: the same
  // draws on any device), in that order.
  at::Tensor timesteps = at::empty({n}, at::kLong);
  at::Tensor noise = at::empty({n, features_}, at::kFloat);
  at::Tensor signal = at::empty({n, 1}, at::kFloat), spread = at::empty({n, 1}, at::kFloat);
  const bool minSnr = options_.loss_weighting == "min_snr";
  at::Tensor weight = minSnr ? at::empty({n}, at::kFloat) : at::Tensor();
  at::Tensor labels =
      conditional ? batch.targets.to(at::kCPU, at::kLong).reshape({n}).clone() : noClassLabels(n, at::kCPU);
  for (int64_t i = 0; i < n; ++i) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(batch.noiseSeeds[static_cast<size_t>(i)]);
    const at::Tensor t = at::randint(schedule_.timesteps, {1}, gen, at::kLong);
    noise[i].copy_(at::randn({features_}, gen, at::kFloat));
    const int64_t step = t.item<int64_t>();
    timesteps[i] = step;
    signal[i] = std::sqrt(schedule_.alphaBars[static_cast<size_t>(step)]);
    spread[i] = std::sqrt(1.0 - schedule_.alphaBars[static_cast<size_t>(step)]);
    if (minSnr) {
      weight[i] = minSnrLossWeight(schedule_.alphaBars[static_cast<size_t>(step)], schedule_.prediction,
                                   options_.min_snr_gamma);
    }
    if (conditional && options_.class_dropout > 0 &&
        at::rand({1}, gen, at::kDouble).item<double>() < options_.class_dropout) {
      labels[i] = classes_;
    }
  }
  const at::Device device = clean.device();
  noise = noise.to(device);
  signal = signal.to(device);
  spread = spread.to(device);
  const at::Tensor flat = clean.flatten(1).to(at::kFloat);
  const at::Tensor noisy = signal * flat + spread * noise;
  const at::Tensor predicted = predict(noisy.view(clean.sizes()), timesteps.to(device), labels.to(device));
  const at::Tensor loss = (predicted.flatten(1).to(at::kFloat) - schedule_.target(flat, noise, signal, spread)).square().mean(1);
  return minSnr ? loss * weight.to(device) : loss;
}

double minSnrLossWeight(double alphaBar, Prediction prediction, double gamma) {
  TESSERA_CHECK(alphaBar >= 0 && alphaBar < 1 && gamma > 0, "minSnrLossWeight: abar ", alphaBar, " and gamma ", gamma,
                " (needs 0 <= abar < 1, gamma > 0)");
  const double snr = alphaBar / (1 - alphaBar);
  if (prediction == Prediction::kVelocity) return std::min(snr, gamma) / (snr + 1);
  return snr <= gamma ? 1.0 : gamma / snr;
}

at::Tensor predictInUnits(Denoiser& model, const at::Tensor& noisy, const at::Tensor& timesteps,
                          const at::Tensor& labels) {
  return callInUnits(model, noisy, timesteps, labels, &Denoiser::predict);
}

GuidanceInterval makeGuidanceInterval(const std::vector<int64_t>& interval) {
  const std::string problem = guidanceIntervalProblem(interval, std::numeric_limits<int64_t>::max());
  TESSERA_CHECK_AS(UsageError, problem.empty(), "guidance interval ", problem);
  return interval.empty() ? GuidanceInterval{} : GuidanceInterval{interval[0], interval[1]};
}

PredictFunction guidedPrediction(Denoiser& model, const at::Tensor& labels, double cfg, GuidanceInterval interval) {
  return [&model, labels, cfg, interval](const at::Tensor& x, const at::Tensor& t) {
    const at::Tensor conditional = predictInUnits(model, x, t, labels).to(at::kFloat);
    if (cfg == 1.0 || model.classes() == 0 || !labels.defined()) return conditional;
    if (t.numel() > 0 && !interval.contains(t.reshape({-1})[0].item<int64_t>())) return conditional;
    const at::Tensor unconditional = predictInUnits(model, x, t).to(at::kFloat);
    return unconditional + cfg * (conditional - unconditional);
  };
}

at::Tensor guidedPredictionPerSample(Denoiser& model, const at::Tensor& x, const at::Tensor& t, const at::Tensor& labels,
                                     double cfg, GuidanceInterval interval) {
  const at::Tensor conditional = predictInUnits(model, x, t, labels).to(at::kFloat);
  if (cfg == 1.0 || model.classes() == 0 || !labels.defined()) return conditional;
  // Both forwards whatever timesteps this rank drew: under zero3 each is collective.
  const at::Tensor unconditional = predictInUnits(model, x, t).to(at::kFloat);
  const at::Tensor guided = unconditional + cfg * (conditional - unconditional);
  std::vector<int64_t> perSample(static_cast<size_t>(conditional.dim()), 1);
  perSample[0] = conditional.size(0);
  const at::Tensor inside = ((t >= interval.first) & (t <= interval.last)).reshape(perSample);
  return at::where(inside, guided, conditional);
}

at::Tensor sampleDdpm(const NoiseSchedule& schedule, const at::Tensor& noise, const std::vector<uint64_t>& stepSeeds,
                      const PredictFunction& predict) {
  const int64_t n = noise.size(0);
  TESSERA_CHECK(static_cast<int64_t>(stepSeeds.size()) == n, "sampleDdpm: ", stepSeeds.size(), " seeds for ", n,
                " samples");
  std::vector<at::Generator> gens;
  for (uint64_t seed : stepSeeds) gens.push_back(at::make_generator<at::CPUGeneratorImpl>(seed));
  const std::vector<int64_t> sampleShape(noise.sizes().begin() + 1, noise.sizes().end());
  at::Tensor x = noise.to(at::kFloat);
  for (int64_t t = schedule.timesteps - 1; t >= 0; --t) {
    const double beta = schedule.betas[static_cast<size_t>(t)];
    const double alphaBar = schedule.alphaBars[static_cast<size_t>(t)];
    const at::Tensor out =
        predict(x, at::full({n}, t, at::TensorOptions().dtype(at::kLong).device(x.device()))).to(at::kFloat);
    if (schedule.prediction == Prediction::kNoise) {
      x = (x - out * (beta / std::sqrt(1.0 - alphaBar))) / std::sqrt(1.0 - beta);
    } else {  // the posterior mean from the clean estimate: defined at beta = 1 (a zero-terminal-SNR start)
      const double previousBar = t == 0 ? 1.0 : schedule.alphaBars[static_cast<size_t>(t - 1)];
      const at::Tensor x0 = schedule.cleanEstimate(x, out, std::sqrt(alphaBar), std::sqrt(1.0 - alphaBar));
      x = x0 * (std::sqrt(previousBar) * beta / (1.0 - alphaBar)) +
          x * (std::sqrt(1.0 - beta) * (1.0 - previousBar) / (1.0 - alphaBar));
    }
    if (t == 0) break;
    at::Tensor z = at::empty(x.sizes(), at::kFloat);
    for (int64_t i = 0; i < n; ++i) z[i].copy_(at::randn(sampleShape, gens[static_cast<size_t>(i)], at::kFloat));
    x = x + z.to(x.device()) * std::sqrt(beta);
  }
  return x;
}

std::vector<int64_t> ddimTimesteps(int64_t timesteps, int64_t steps) {
  TESSERA_CHECK(steps >= 1 && steps <= timesteps, "DDIM: ", steps, " steps for ", timesteps, " timesteps");
  if (steps == 1) return {timesteps - 1};
  std::vector<int64_t> out;
  const int64_t den = steps - 1;
  for (int64_t k = 0; k < steps; ++k) {
    const int64_t num = (timesteps - 1) * (steps - 1 - k);
    int64_t q = num / den;
    const int64_t twiceRest = 2 * (num % den);
    if (twiceRest > den || (twiceRest == den && q % 2 == 1)) ++q;
    out.push_back(q);
  }
  return out;
}

at::Tensor sampleDdim(const NoiseSchedule& schedule, const at::Tensor& noise, int64_t steps,
                      const PredictFunction& predict) {
  return sampleDdim(schedule, noise, ddimTimesteps(schedule.timesteps, steps), predict);
}

void checkTimesteps(const NoiseSchedule& schedule, const std::vector<int64_t>& timesteps, const std::string& what) {
  TESSERA_CHECK_AS(UsageError, !timesteps.empty(), what, ": no timesteps");
  const std::string problem = timestepsProblem(timesteps, schedule.timesteps);
  TESSERA_CHECK_AS(UsageError, problem.empty(), what, ": ", problem);
}

at::Tensor sampleDdim(const NoiseSchedule& schedule, const at::Tensor& noise, const std::vector<int64_t>& ts,
                      const PredictFunction& predict) {
  checkTimesteps(schedule, ts, "DDIM");
  const int64_t n = noise.size(0);
  at::Tensor x = noise.to(at::kFloat);
  for (size_t k = 0; k < ts.size(); ++k) {
    const at::Tensor out =
        predict(x, at::full({n}, ts[k], at::TensorOptions().dtype(at::kLong).device(x.device()))).to(at::kFloat);
    if (k + 1 == ts.size()) return schedule.cleanEstimate(x, out, schedule.signal(ts[k]), schedule.spread(ts[k]));
    x = sampleDdimStep(schedule, x, ts[k], ts[k + 1], out);
  }
  return x;
}

at::Tensor sampleDdimStep(const NoiseSchedule& schedule, const at::Tensor& x, int64_t t, int64_t s,
                          const at::Tensor& out) {
  const double signal = schedule.signal(t), spread = schedule.spread(t);
  const at::Tensor x0 = schedule.cleanEstimate(x, out, signal, spread);
  const at::Tensor eps = schedule.noiseEstimate(x, out, signal, spread);
  return schedule.signal(s) * x0 + schedule.spread(s) * eps;
}

at::Tensor samplingNoise(const std::vector<int64_t>& sampleShape, int64_t count, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<int64_t> shape{count};
  shape.insert(shape.end(), sampleShape.begin(), sampleShape.end());
  return at::randn(shape, gen, at::kFloat);
}

std::shared_ptr<TrainModel> makeDiffusionDenoiser(const ModelOptions& options, const datasets::DataSpec& data,
                                                  c10::Device device) {
  TESSERA_CHECK_AS(ConfigError, !data.tokens, "model.arch diffusion needs float tensors or images");
  return std::make_shared<DiffusionDenoiser>(options, data.inputShape, device);
}

}  // namespace tessera::models
