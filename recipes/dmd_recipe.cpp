// Distribution-matching distillation (see dmd_recipe.h).
#include "recipes/dmd_recipe.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/accumulate.h>
#include <torch/autograd.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <tuple>

#include "common/counter_rng.h"
#include "common/enum_names.h"
#include "common/errors.h"
#include "distributed/communicator.h"
#include "ema/strategy_ema.h"
#include "sharding/fully_shard.h"
#include "models/diffusion.h"
#include "recipes/dmd_options.h"
#include "recipes/dmd_pairs.h"
#include "recipes/recipe_steps.h"
#include "recipes/recipes.h"
#include "sharding/mixed_precision.h"
#include "trainer/model_metadata.h"
#include "trainer/run_setup.h"
#include "models/sampling.h"

namespace tessera::recipes {

namespace {

// What each draw of a sample is for: one stream of random numbers per purpose (the critic's
// purposes once per critic update of the step).
constexpr uint64_t kGeneratorInput = 1;   // z of the generator's update
constexpr uint64_t kGeneratorNoise = 2;   // t and eps that noise its samples
constexpr uint64_t kCriticInput = 0x100;  // + update index: z of a critic update
constexpr uint64_t kCriticNoise = 0x200;  // + update index: the critic's diffusion loss draws
constexpr uint64_t kClass = 0x300;        // the class a sample is generated for
constexpr uint64_t kGeneratorStep = 3;    // the step of the generator's chain its update trains
constexpr uint64_t kCriticStep = 0x400;   // + update index: the chain step whose samples the critic sees
constexpr uint64_t kGanGeneratorNoise = 4;   // t and eps that noise the generator's samples for the GAN head
constexpr uint64_t kGanCriticNoise = 0x500;  // + update index: t and the real and fake samples' eps for the head

// Seeds of stream `purpose` for samples whose seeds are `sampleSeeds`.
std::vector<uint64_t> streamSeeds(const std::vector<uint64_t>& sampleSeeds, uint64_t purpose) {
  std::vector<uint64_t> out(sampleSeeds.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = mix64(sampleSeeds[i] ^ mix64(purpose));
  return out;
}

// Elements [begin, end) of `v`.
template <typename T>
std::vector<T> slice(const std::vector<T>& v, size_t begin, size_t end) {
  return std::vector<T>(v.begin() + static_cast<std::ptrdiff_t>(begin), v.begin() + static_cast<std::ptrdiff_t>(end));
}

// One seed per sample of global indices `indices` at `step` (run seed mixed in).
std::vector<uint64_t> sampleSeeds(int64_t runSeed, int64_t step, const std::vector<int64_t>& indices) {
  std::vector<uint64_t> out;
  out.reserve(indices.size());
  for (int64_t i : indices) out.push_back(datasets::noiseSeed(runSeed, step, i));
  return out;
}

// Standard normal [n, shape...], sample i drawn from its own CPU generator seeded seeds[i]:
// the same whichever rank or micro-batch draws it.
at::Tensor normalPerSample(const std::vector<uint64_t>& seeds, const std::vector<int64_t>& shape) {
  std::vector<int64_t> full{static_cast<int64_t>(seeds.size())};
  full.insert(full.end(), shape.begin(), shape.end());
  at::Tensor out = at::empty(full, at::kFloat);
  for (size_t i = 0; i < seeds.size(); ++i) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seeds[i]);
    out[static_cast<int64_t>(i)].copy_(at::randn(shape, gen, at::kFloat));
  }
  return out;
}

// The class of each sample of `seeds` (uniform over the model's classes, from the
// sample's own stream); undefined for an unconditional model.
at::Tensor classesOf(const models::Denoiser& model, const std::vector<uint64_t>& seeds) {
  if (model.classes() == 0) return {};
  std::vector<int64_t> labels;
  labels.reserve(seeds.size());
  for (uint64_t seed : seeds) labels.push_back(static_cast<int64_t>(mix64(seed ^ mix64(kClass)) % model.classes()));
  return at::tensor(labels, at::kLong);
}

// The step of a K-step generator's chain each sample of `seeds` is trained at (DMD2's
// backward simulation): uniform over 0 .. K-1, from the sample's own stream.
std::vector<int64_t> chainStepsOf(const std::vector<uint64_t>& seeds, uint64_t purpose, size_t steps) {
  std::vector<int64_t> out;
  out.reserve(seeds.size());
  for (uint64_t seed : seeds) out.push_back(static_cast<int64_t>(mix64(seed ^ mix64(purpose)) % steps));
  return out;
}

// `labels` on `device`, or undefined.
at::Tensor onDevice(const at::Tensor& labels, at::Device device) { return labels.defined() ? labels.to(device) : labels; }

models::Denoiser& denoiserOf(trainer::ModelPart& part) {
  auto* model = dynamic_cast<models::Denoiser*>(part.model.get());
  TESSERA_CHECK_AS(ConfigError, model != nullptr, "run.recipe dmd: ", part.cfg.modelKeys,
                   "arch must be diffusion (a denoiser)");
  return *model;
}

class DmdRecipe : public trainer::Recipe {
 public:
  explicit DmdRecipe(trainer::RunParts& run)
      : run_(run),
        options_(trainer::recipeOptions<DmdOptions>(run.cfg, kDmdRecipe)),
        generator_(run.model("generator")),
        critic_(run.model("critic")),
        teacher_(run.model("teacher")),
        generatorNet_(denoiserOf(generator_)),
        criticNet_(denoiserOf(critic_)),
        teacherNet_(denoiserOf(teacher_)),
        chain_(generator_.cfg.model.sample_timesteps) {  // checked and defaulted by finishTrainConfig
    // One noise schedule for the three (finishTrainConfig checked their keys).
    const int64_t T = generatorNet_.schedule().timesteps;
    std::tie(minT_, maxT_) = timestepRange(options_.min_t, options_.max_t, T);
    std::tie(ganMinT_, ganMaxT_) = timestepRange(options_.gan_min_t, options_.gan_max_t, T);
    if (options_.regression_weight > 0) makePairs();
    if (options_.gan()) {
      TESSERA_CHECK_AS(ConfigError, criticNet_.hasGanHead(), "recipe.gan_weight: the critic has no GAN head");
      TESSERA_CHECK_AS(ConfigError, !run_.data->streams(),
                       "recipe.gan_weight: the GAN head reads the data's images by index; data.kind ",
                       run_.cfg.data.kind, " streams them");
    }
  }

  trainer::StepOutcome step(int64_t step, bool stopRequested) override {
    const auto [first, last] = run_.samplePositions();
    const std::vector<int64_t> indices = run_.sampler->indicesOfRange(step, first, last);
    const std::vector<uint64_t> seeds = sampleSeeds(run_.cfg.run.seed, step, indices);
    double criticLoss = 0, criticGan = 0;
    bool criticApplied = false;
    for (int64_t k = 0; k < options_.critic_steps; ++k) {
      criticLoss += criticUpdate(step, k, indices, seeds, criticApplied, criticGan);
    }
    // A critic EMA (when one is configured) follows the critic once per run step, like every
    // EMA of the run: its update count stays within the run's step count.
    if (critic_.ema) critic_.ema->update(step + 1, criticApplied);

    generator_.strategy->zeroGrad();
    StepLoss stepLoss, ganLoss;
    forEachMicroBatch(run_, generator_, [&](const MicroBatch& mb) {
      const std::vector<uint64_t> micro = slice(seeds, mb.begin, mb.end);
      const std::vector<int64_t> microIndices = slice(indices, mb.begin, mb.end);
      at::Tensor gan;
      at::Tensor perSample = generatorLoss(micro, gan);
      if (options_.regression_weight > 0) {
        perSample = perSample + options_.regression_weight * regressionLoss(microIndices, micro);
      }
      const at::Tensor loss = perSample.mean() / static_cast<double>(run_.lossDivisor);
      loss.backward();
      stepLoss.add(mb, loss);
      if (gan.defined()) ganLoss.add(mb, gan.mean() / static_cast<double>(run_.lossDivisor));
    });
    std::map<std::string, const StepLoss*> figures;
    if (options_.gan()) figures["gan_loss"] = &ganLoss;
    trainer::StepOutcome out = stepMainModel(run_, generator_, step, stepLoss, stopRequested, figures);
    out.extra["critic_loss"] = criticLoss / static_cast<double>(options_.critic_steps);
    if (options_.gan()) out.extra["critic_gan_loss"] = criticGan / static_cast<double>(options_.critic_steps);
    out.extra["critic_lr"] = critic_.schedule->lrAt(step);  // "lr" is the generator's
    return out;
  }

  void evaluate(std::map<std::string, double>& out) override {
    out["eval_loss"] = teacherLossOfSamples();
    for (size_t d = 0; generator_.ema && d < generator_.ema->numProfiles(); ++d) {
      double emaLoss = 0;
      ema::withEmaWeights(*generator_.ema, *generator_.strategy, d, [&] { emaLoss = teacherLossOfSamples(); });
      out["eval_loss_" + (d == 0 ? std::string("ema") : generator_.ema->stateName(d))] = emaLoss;
    }
  }

  // Samples of generator_ema over its timesteps (every rank draws all of them: zero3 gathers
  // collectively).
  std::string drawSamples() override {
    TESSERA_CHECK(generator_.ema != nullptr, "model.samples needs the generator's EMA");
    torch::NoGradGuard noGrad;
    std::vector<int64_t> all(static_cast<size_t>(run_.cfg.defaults.model.samples));
    std::iota(all.begin(), all.end(), 0);
    const at::Tensor noise = normalPerSample(sampleSeeds(run_.cfg.run.seed, -2, all), generatorNet_.sampleShape());
    const at::Tensor labels = generatorNet_.classes() > 0
                                  ? at::arange(static_cast<int64_t>(all.size()), at::kLong).remainder(generatorNet_.classes())
                                  : at::Tensor();
    at::Tensor samples;
    ema::withEmaWeights(*generator_.ema, *generator_.strategy, 0, [&] {
      samples = generate(generatorNet_, chain_, noise.to(run_.device), onDevice(labels, run_.device));
    });
    return writeSamples(run_, samples, generator_.cfg.names.ema);
  }

  // Samples of each generator EMA and the live generator, a row per class (every
  // rank generates them all: zero3 gathers collectively).
  std::vector<trainer::SampleGrid> writeSampleGrids(int64_t step) override {
    if (generatorNet_.sampleShape().size() != 3) return {};  // not images
    torch::NoGradGuard noGrad;
    const int64_t perClass = run_.cfg.eval.sample_per_class;
    const models::SampleRequest request = models::gridRequest(generatorNet_, perClass, run_.cfg.run.seed);
    std::vector<trainer::SampleGrid> written;
    const auto draw = [&](const std::string& name) {
      const at::Tensor samples =
          generate(generatorNet_, chain_, request.noise.to(run_.device), onDevice(request.labels, run_.device));
      if (run_.comm->rank() == 0) written.push_back(writeStepGrid(run_, step, name, samples.cpu(), perClass));
    };
    if (generator_.ema) {
      for (size_t d = 0; d < generator_.ema->numProfiles(); ++d) {
        ema::withEmaWeights(*generator_.ema, *generator_.strategy, d, [&] { draw(generator_.ema->stateName(d)); });
      }
    }
    draw("generator");
    return written;
  }

 private:
  // Critic update k of `step`: the diffusion loss on generator samples (no gradient into
  // the generator). Returns the loss, mean over the global batch.
  // `applied` is set when the optimizer applied the update (a non-finite norm skips it).
  // With the GAN term the head's classification loss of the data's images `indices` and of
  // the same generator samples joins it; `ganLoss` gets that loss's mean added.
  double criticUpdate(int64_t step, int64_t k, const std::vector<int64_t>& indices, const std::vector<uint64_t>& seeds,
                      bool& applied, double& ganLoss) {
    sharding::ShardingStrategy& strategy = *critic_.strategy;
    strategy.zeroGrad();
    StepLoss stepLoss, ganStepLoss;
    forEachMicroBatch(run_, critic_, [&](const MicroBatch& mb) {
      const std::vector<uint64_t> micro = slice(seeds, mb.begin, mb.end);
      datasets::Batch batch;
      {
        torch::NoGradGuard noGrad;
        const at::Tensor z = normalPerSample(streamSeeds(micro, kCriticInput + static_cast<uint64_t>(k)),
                                             generatorNet_.sampleShape());
        batch.targets = classesOf(generatorNet_, micro);
        batch.inputs = generateAtSteps(z.to(run_.device), onDevice(batch.targets, run_.device),
                                       chainStepsOf(micro, kCriticStep + static_cast<uint64_t>(k), chain_.size()));
      }
      batch.noiseSeeds = streamSeeds(micro, kCriticNoise + static_cast<uint64_t>(k));
      const at::Tensor fake = batch.inputs, fakeLabels = batch.targets;
      at::Tensor perSample = lossesOf(*critic_.model, std::move(batch), run_.device);
      if (options_.gan()) {
        const datasets::Batch real = run_.data->trainBatch(slice(indices, mb.begin, mb.end));
        const Noising n = noising(streamSeeds(micro, kGanCriticNoise + static_cast<uint64_t>(k)), 2);
        const at::Tensor gan = ganCriticLosses(criticNet_, real.inputs.to(run_.device),
                                               onDevice(real.targets, run_.device), fake,
                                               onDevice(fakeLabels, run_.device), n.timesteps,
                                               n.signal, n.spread, n.eps[0], n.eps[1]);
        ganStepLoss.add(mb, gan.mean() / static_cast<double>(run_.lossDivisor));
        perSample = perSample + options_.gan_critic_weight * gan;
      }
      const at::Tensor loss = perSample.mean() / static_cast<double>(run_.lossDivisor);
      loss.backward();
      stepLoss.add(mb, loss);
    });
    sharding::StepSums sums;
    sums.add("loss", stepLoss.local());
    if (options_.gan()) sums.add("gan", ganStepLoss.local());
    const sharding::StepResult result = strategy.step(critic_.schedule->lrAt(step), &sums);
    applied = applied || !result.skipped;
    if (options_.gan()) ganLoss += meanStepLoss(run_, ganStepLoss, sums, "gan");
    return meanStepLoss(run_, stepLoss, sums);
  }

  // The noise of the GAN term's samples: per sample a timestep in [gan_min_t, gan_max_t] x T and
  // `draws` standard normal tensors of the sample shape, from the sample's own stream
  // (`seeds`), with signal and spread shaped to broadcast over [n, sample shape...].
  struct Noising {
    at::Tensor timesteps, signal, spread;
    std::vector<at::Tensor> eps;
  };
  Noising noising(const std::vector<uint64_t>& seeds, int draws) const {
    const auto n = static_cast<int64_t>(seeds.size());
    const std::vector<int64_t>& shape = generatorNet_.sampleShape();
    Noising out;
    out.timesteps = at::empty({n}, at::kLong);
    at::Tensor signal = at::empty({n}, at::kDouble), spread = at::empty({n}, at::kDouble);
    std::vector<int64_t> full{n};
    full.insert(full.end(), shape.begin(), shape.end());
    for (int d = 0; d < draws; ++d) out.eps.push_back(at::empty(full, at::kFloat));
    const models::NoiseSchedule& schedule = generatorNet_.schedule();
    for (int64_t i = 0; i < n; ++i) {
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seeds[static_cast<size_t>(i)]);
      const int64_t t = at::randint(ganMinT_, ganMaxT_ + 1, {1}, gen, at::kLong).item<int64_t>();
      for (at::Tensor& e : out.eps) e[i].copy_(at::randn(shape, gen, at::kFloat));
      out.timesteps[i] = t;
      signal[i] = schedule.signal(t);
      spread[i] = schedule.spread(t);
    }
    std::vector<int64_t> perSample(full.size(), 1);
    perSample[0] = n;
    out.timesteps = out.timesteps.to(run_.device);
    out.signal = signal.to(at::kFloat).view(perSample).to(run_.device);
    out.spread = spread.to(at::kFloat).view(perSample).to(run_.device);
    for (at::Tensor& e : out.eps) e = e.to(run_.device);
    return out;
  }

  // The generator's per-sample surrogate loss 0.5 mean(x - sg(x - g))^2 (dmd_recipe.h).
  // Per sample of the global batch (a K-step generator: K - 1 forwards without gradients
  // before each of its steps below): each critic update generates (a generator forward) and
  // trains the critic (its forward and backward); the generator's update runs it forward
  // and backward, the teacher once (twice with guidance: conditional and unconditional)
  // and the critic once, and the regression pairs add a generator forward and backward.
  double trainFlopsPerSample() const override {
    const double g = generatorNet_.forwardFlopsPerSample(), c = criticNet_.forwardFlopsPerSample(),
                 t = teacherNet_.forwardFlopsPerSample();
    if (g <= 0 || c <= 0 || t <= 0) return 0;
    const DmdOptions& r = options_;
    const double teacherPasses = r.guidance == 1.0 || teacherNet_.classes() == 0 ? 1.0 : 2.0;
    const double before = static_cast<double>(chain_.size() - 1) * g;  // the chain's steps run without gradients
    // The GAN head's passes run the critic up to its head block (a share of its blocks):
    // forward and backward of real and fake samples in each critic update, forward and the
    // backward to the samples in the generator's.
    const double head = r.gan() ? c * static_cast<double>(criticNet_.ganHeadBlock() + 1) /
                                      static_cast<double>(std::max<int64_t>(1, criticNet_.layers()))
                                : 0.0;
    return static_cast<double>(r.critic_steps) * (before + g + 3.0 * c + 6.0 * head) + before + 3.0 * g +
           teacherPasses * t + c + 3.0 * head + (r.regression_weight > 0 ? before + 3.0 * g : 0.0);
  }

  // With the GAN term, its surrogate is added and `gan` receives the GAN loss per sample.
  at::Tensor generatorLoss(const std::vector<uint64_t>& micro, at::Tensor& gan) {
    const std::vector<int64_t>& shape = generatorNet_.sampleShape();
    const at::Tensor z = normalPerSample(streamSeeds(micro, kGeneratorInput), shape).to(run_.device);
    const at::Tensor labels = onDevice(classesOf(generatorNet_, micro), run_.device);
    const at::Tensor x = generateAtSteps(z, labels, chainStepsOf(micro, kGeneratorStep, chain_.size()));
    // t in [minT, maxT] and eps per sample, from the sample's own stream.
    const auto n = static_cast<int64_t>(micro.size());
    const std::vector<uint64_t> noiseSeeds = streamSeeds(micro, kGeneratorNoise);
    at::Tensor timesteps = at::empty({n}, at::kLong);
    at::Tensor signal = at::empty({n, 1}, at::kFloat), spread = at::empty({n, 1}, at::kFloat);
    std::vector<int64_t> flatShape{c10::multiply_integers(shape)};
    at::Tensor eps = at::empty({n, flatShape[0]}, at::kFloat);
    const models::NoiseSchedule& schedule = generatorNet_.schedule();
    for (int64_t i = 0; i < n; ++i) {
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(noiseSeeds[static_cast<size_t>(i)]);
      const int64_t t = at::randint(minT_, maxT_ + 1, {1}, gen, at::kLong).item<int64_t>();
      eps[i].copy_(at::randn(flatShape, gen, at::kFloat));
      timesteps[i] = t;
      signal[i] = schedule.signal(t);
      spread[i] = schedule.spread(t);
    }
    const at::Device device = run_.device;
    signal = signal.to(device);
    spread = spread.to(device);
    const at::Tensor flatX = x.flatten(1).to(at::kFloat);
    at::Tensor direction;
    {
      torch::NoGradGuard noGrad;
      const at::Tensor noisy = (signal * flatX.detach() + spread * eps.to(device)).view(x.sizes());
      const at::Tensor t = timesteps.to(device);
      const at::Tensor teacherOut = models::guidedPredictionPerSample(teacherNet_, noisy, t, labels, options_.guidance,
                                                                      models::makeGuidanceInterval(options_.guidance_interval));
      const at::Tensor criticOut = models::predictInUnits(criticNet_, noisy, t, labels).to(at::kFloat);
      const at::Tensor flatNoisy = noisy.flatten(1);
      const at::Tensor x0Teacher = teacherNet_.schedule().cleanEstimate(flatNoisy, teacherOut.flatten(1), signal, spread);
      const at::Tensor x0Critic = criticNet_.schedule().cleanEstimate(flatNoisy, criticOut.flatten(1), signal, spread);
      const at::Tensor scale = (flatX.detach() - x0Teacher).abs().mean(1, /*keepdim=*/true).clamp_min(1e-6);
      direction = (x0Critic - x0Teacher) / scale;
    }
    const at::Tensor target = (flatX - direction).detach();
    at::Tensor perSample = 0.5 * (flatX - target).square().mean(1);
    if (options_.gan()) {
      const Noising g = noising(streamSeeds(micro, kGanGeneratorNoise), 1);
      perSample = perSample + options_.gan_weight * ganGeneratorSurrogate(criticNet_, x, labels, g.timesteps, g.signal,
                                                                          g.spread, g.eps[0], gan);
    }
    return perSample;
  }

  // DMD2's backward simulation: the generator's clean-sample estimate for sample i at step
  // steps[i] of its chain, from the chain's own iterate there (the steps before it run
  // without gradients, from `noise`). Every rank runs every step of the chain, whichever
  // steps its samples ask for: under zero3 each forward is collective.
  at::Tensor generateAtSteps(const at::Tensor& noise, const at::Tensor& labels, const std::vector<int64_t>& steps) {
    const auto n = static_cast<int64_t>(steps.size());
    at::Tensor input = noise, timesteps = at::full({n}, chain_[0], at::kLong);
    if (chain_.size() > 1) {
      torch::NoGradGuard noGrad;
      std::vector<at::Tensor> iterates{noise};
      at::Tensor x = noise;
      for (size_t k = 0; k + 1 < chain_.size(); ++k) {
        const at::Tensor t = at::full({n}, chain_[k], at::TensorOptions().dtype(at::kLong).device(x.device()));
        const at::Tensor out = models::predictInUnits(generatorNet_, x, t, labels).to(at::kFloat);
        x = models::sampleDdimStep(generatorNet_.schedule(), x, chain_[k], chain_[k + 1], out);
        iterates.push_back(x);
      }
      input = at::empty_like(noise);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t k = steps[static_cast<size_t>(i)];
        input[i].copy_(iterates[static_cast<size_t>(k)][i]);
        timesteps[i] = chain_[static_cast<size_t>(k)];
      }
    }
    at::Tensor signal = at::empty({n}, at::kFloat), spread = at::empty({n}, at::kFloat);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = chain_[static_cast<size_t>(steps[static_cast<size_t>(i)])];
      signal[i] = generatorNet_.schedule().signal(t);
      spread[i] = generatorNet_.schedule().spread(t);
    }
    std::vector<int64_t> perSample(static_cast<size_t>(noise.dim()), 1);
    perSample[0] = n;
    signal = signal.view(perSample).to(noise.device());
    spread = spread.view(perSample).to(noise.device());
    const at::Tensor out =
        models::predictInUnits(generatorNet_, input, timesteps.to(noise.device()), labels).to(at::kFloat);
    return generatorNet_.schedule().cleanEstimate(input, out, signal, spread);
  }

  // DMD's regression loss of the samples `indices` (global; `micro` their seeds): pair
  // index mod the number of pairs, mean squared distance of the generator's clean-sample
  // estimate at the sample's chain step (from the pair's noise) to the teacher's DDIM
  // sample of the same noise.
  at::Tensor regressionLoss(const std::vector<int64_t>& indices, const std::vector<uint64_t>& micro) {
    std::vector<int64_t> pairs;
    pairs.reserve(indices.size());
    for (int64_t i : indices) pairs.push_back(i % pairNoise_.size(0));
    const at::Tensor which = at::tensor(pairs, at::kLong);
    const at::Tensor labels = pairLabels_.defined() ? pairLabels_.index_select(0, which).to(run_.device) : at::Tensor();
    const at::Tensor x = generateAtSteps(pairNoise_.index_select(0, which).to(run_.device), labels,
                                         chainStepsOf(micro, kGeneratorStep, chain_.size()));
    return (x.flatten(1).to(at::kFloat) - pairSamples_.index_select(0, which).to(run_.device).flatten(1)).square().mean(1);
  }

  // The pairs of the regression loss: recipe.regression_pairs noises (fixed by run.seed)
  // and the teacher's DDIM samples of them, made on every rank alike (the teacher's
  // forwards are collective under zero3). A resumed run makes the same pairs.
  // They are kept in <run.dir>/cache (dmd_pairs.h): a resume or restart reads them.
  void makePairs() {
    torch::NoGradGuard noGrad;
    DmdPairsKeyParts parts;
    parts.teacherModelJson = trainer::modelMetadataJson(teacher_.cfg.model, run_.data->spec());
    parts.teacherInitFrom = teacher_.cfg.model.init_from.value_or("");
    parts.teacherTrainable = teacher_.cfg.trainable;
    parts.computeDtype = enumName(sharding::kFloatDtypeNames, teacher_.cfg.sharding.paramDtype);
    if (run_.cfg.run.matmul_dtype != "fp32") parts.computeDtype += strCat(", Linear products ", run_.cfg.run.matmul_dtype);
    parts.device = run_.device.str();
    parts.seed = run_.cfg.run.seed;
    parts.pairs = options_.regression_pairs;
    parts.pairSteps = options_.pair_steps;
    parts.guidance = options_.guidance;
    parts.guidanceInterval = options_.guidance_interval;
    parts.sampleShape = generatorNet_.sampleShape();
    parts.classes = generatorNet_.classes();
    DmdPairsCache cache(run_.runDir, parts, *run_.hostComm);
    if (std::optional<DmdPairs> cached = cache.load()) {
      pairNoise_ = cached->noise;
      pairSamples_ = cached->samples;
      pairLabels_ = cached->labels;
      return;
    }
    std::vector<int64_t> all(static_cast<size_t>(options_.regression_pairs));
    std::iota(all.begin(), all.end(), 0);
    const std::vector<uint64_t> seeds = sampleSeeds(run_.cfg.run.seed, -3, all);
    pairNoise_ = normalPerSample(seeds, generatorNet_.sampleShape());
    pairLabels_ = classesOf(generatorNet_, seeds);
    pairSamples_ = models::sampleDdim(teacherNet_.schedule(), pairNoise_.to(run_.device), options_.pair_steps,
                              models::guidedPrediction(teacherNet_, onDevice(pairLabels_, run_.device), options_.guidance,
                                                       models::makeGuidanceInterval(options_.guidance_interval)))
                       .cpu();
    cache.store({pairNoise_, pairSamples_, pairLabels_});
  }

  // The teacher's diffusion loss (of its model.prediction) on 1024 samples of the generator as it
  // is now (fixed noise: comparable from one evaluation to the next), split over the ranks.
  double teacherLossOfSamples() {
    torch::NoGradGuard noGrad;
    constexpr int64_t kSamples = 1024;
    return meanOverRanks(run_, std::max<int64_t>(kSamples, run_.comm->worldSize()), [&](int64_t begin, int64_t end) {
      std::vector<int64_t> mine(static_cast<size_t>(end - begin));
      std::iota(mine.begin(), mine.end(), begin);
      const std::vector<uint64_t> seeds = sampleSeeds(run_.cfg.run.seed, -1, mine);
      datasets::Batch batch;
      batch.targets = classesOf(generatorNet_, seeds);
      batch.inputs = generate(generatorNet_, chain_,
                              normalPerSample(streamSeeds(seeds, kGeneratorInput), generatorNet_.sampleShape())
                                  .to(run_.device),
                              onDevice(batch.targets, run_.device));
      batch.noiseSeeds = streamSeeds(seeds, kGeneratorNoise);
      return lossesOf(*teacher_.model, std::move(batch), run_.device);
    });
  }

  trainer::RunParts& run_;
  const DmdOptions& options_;  // recipe.*
  trainer::ModelPart &generator_, &critic_, &teacher_;
  models::Denoiser &generatorNet_, &criticNet_, &teacherNet_;
  const std::vector<int64_t> chain_;  // the generator's timesteps (its model.sample_timesteps)
  int64_t minT_ = 0, maxT_ = 0;  // the generator's samples are noised at t in [minT_, maxT_]
  int64_t ganMinT_ = 0, ganMaxT_ = 0;  // ... and for the GAN head at t in [ganMinT_, ganMaxT_]
  at::Tensor pairNoise_, pairSamples_;  // the regression loss's pairs (CPU)
  at::Tensor pairLabels_;               // their classes (undefined: unconditional)
};

}  // namespace

std::pair<int64_t, int64_t> timestepRange(double minFraction, double maxFraction, int64_t timesteps) {
  const auto T = static_cast<double>(timesteps);
  // A fraction times T that is an integer but for the product's rounding (0.07 * 100 =
  // 7.000000000000001) counts as that integer, or floor/ceil would move a bound by one.
  const auto snapped = [](double x) {
    const double nearest = std::round(x);
    return std::abs(x - nearest) <= 1e-9 * std::max(1.0, std::abs(x)) ? nearest : x;
  };
  const int64_t first = std::min<int64_t>(timesteps - 1, static_cast<int64_t>(std::floor(snapped(minFraction * T))));
  const int64_t last =
      std::clamp<int64_t>(static_cast<int64_t>(std::ceil(snapped(maxFraction * T))) - 1, first, timesteps - 1);
  return {first, last};
}

at::Tensor generate(models::Denoiser& model, const std::vector<int64_t>& timesteps, const at::Tensor& noise,
                    const at::Tensor& labels) {
  return models::sampleDdim(model.schedule(), noise, timesteps, models::guidedPrediction(model, labels, /*cfg=*/1.0));
}

at::Tensor ganCriticLosses(models::Denoiser& critic, const at::Tensor& real, const at::Tensor& realLabels,
                           const at::Tensor& fake, const at::Tensor& fakeLabels, const at::Tensor& timesteps,
                           const at::Tensor& signal, const at::Tensor& spread, const at::Tensor& realEps,
                           const at::Tensor& fakeEps) {
  const int64_t n = real.size(0);
  at::Tensor noisy;
  {
    torch::NoGradGuard noGrad;  // the samples are data: only the critic learns here
    noisy = at::cat({signal * real.to(at::kFloat) + spread * realEps, signal * fake.detach().to(at::kFloat) + spread * fakeEps});
  }
  at::Tensor labels;
  if (critic.classes() > 0) {
    const auto noClass = [&](const at::Tensor& l) { return l.defined() ? l : critic.noClassLabels(n, noisy.device()); };
    labels = at::cat({noClass(realLabels), noClass(fakeLabels)});
  }
  const at::Tensor logits = models::discriminateInUnits(critic, noisy, at::cat({timesteps, timesteps}), labels);
  return at::softplus(-logits.narrow(0, 0, n)) + at::softplus(logits.narrow(0, n, n));
}

at::Tensor ganGeneratorSurrogate(models::Denoiser& critic, const at::Tensor& x, const at::Tensor& labels,
                                 const at::Tensor& timesteps, const at::Tensor& signal, const at::Tensor& spread,
                                 const at::Tensor& eps, at::Tensor& ganLoss) {
  const at::Tensor sample = x.detach().to(at::kFloat).requires_grad_(true);
  const at::Tensor loss =
      at::softplus(-models::discriminateInUnits(critic, signal * sample + spread * eps, timesteps, labels));
  const at::Tensor grad = torch::autograd::grad({loss.sum()}, {sample})[0];
  ganLoss = loss.detach();
  // Zero in value (the logged loss stays DMD's), the GAN loss's gradient in x.
  const at::Tensor flat = x.to(at::kFloat).flatten(1);
  return ((flat - flat.detach()) * grad.flatten(1)).sum(1);
}

std::unique_ptr<trainer::Recipe> makeDmdRecipe(trainer::RunParts& run) { return std::make_unique<DmdRecipe>(run); }

}  // namespace tessera::recipes
