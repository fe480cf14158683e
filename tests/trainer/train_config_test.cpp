// The run config binds the library's own option structs: a key lands in the field the
// library reads (no mirror struct in between), closed sets are enums, the single-model
// form is the one entry of TrainConfig::models, and each recipe's spec answers what the
// recipe asks of the config.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "recipes/dmd_options.h"
#include "tests/support/scratch_path.h"
#include "trainer/recipe_spec.h"
#include "trainer/run_setup.h"
#include "trainer/train_config.h"

namespace tessera::trainer {
namespace {

const std::string kConfigs = std::string(TESSERA_SOURCE_DIR) + "/configs";

std::string writeConfig(const std::string& text) {
  const std::string path = test::scratchPath("tessera_train_config", "run.yaml");
  std::ofstream(path) << text;
  return path;
}

// run.backend: how parameters and gradients travel. auto picks nccl only for cuda with a
// GPU per rank and a build that has it; nccl asked for where it cannot work is a config
// error naming the key, before any rendezvous.
TEST(TrainConfigTest, RunBackendPicksTheCommunicator) {
  distributed::RankEnv env;
  env.world_size = 2;
  env.local_world_size = 2;
  auto backendOf = [&](std::vector<std::string> overrides) {
    return runtimeOptions(loadTrainConfig(kConfigs + "/default.yaml", overrides, 2).config, env).backend;
  };
  // auto on the CPU: "cpu" (Runtime: shm on one host when it can be set up, else gloo).
  EXPECT_EQ(backendOf({}), "cpu");
  EXPECT_EQ(backendOf({"run.backend=gloo"}), "gloo");
  EXPECT_EQ(backendOf({"run.backend=shm"}), "shm");
  auto refusedBecause = [&](std::vector<std::string> overrides, const std::string& why) {
    try {
      backendOf(std::move(overrides));
      ADD_FAILURE() << "accepted; expected: " << why;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("run.backend"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  };
  refusedBecause({"run.backend=shm", "run.device=cuda"}, "shm moves CPU tensors");
  env.world_size = 4;  // two nodes of 2
  refusedBecause({"run.backend=shm"}, "shm needs every rank on one host: 2 of 4 ranks");
  EXPECT_EQ(backendOf({}), "cpu");  // Runtime picks gloo across hosts
  env.world_size = 2;
  try {
    backendOf({"run.backend=nccl"});
    ADD_FAILURE() << "nccl for a CPU run";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("run.backend"), std::string::npos) << e.what();
  }
  EXPECT_THROW(loadTrainConfig(kConfigs + "/default.yaml", {"run.backend=mpi"}, 2), ConfigError);
  if (!torch::cuda::is_available()) {
    // cuda without a GPU fails when the run starts (trainingDevice); auto then says gloo.
    EXPECT_EQ(backendOf({"run.device=cuda"}), "gloo");
  }
}

TEST(TrainConfigTest, KeysLandInTheLibrarysOptionStructs) {
  const auto loaded = loadTrainConfig(kConfigs + "/default.yaml",
                                      {"sharding.strategy=zero2", "sharding.bucket_mb=0.5", "sharding.prefetch=3",
                                       "sharding.param_dtype=bf16", "optim.name=adam", "optim.betas=[0.8, 0.95]",
                                       "optim.no_decay=[embed.*]", "optim.lr_scale={head.*: 2.5}", "ema.dtype=bf16",
                                       "ema.buffers=average", "checkpoint.export_dtype=fp16"},
                                      2);
  const TrainConfig& c = loaded.config;
  ASSERT_EQ(c.models.size(), 1u);
  const ModelEntry& m = c.models.front();
  EXPECT_EQ(m.sharding.strategy, sharding::StrategyKind::kZero2);
  EXPECT_EQ(m.sharding.bucketBytes, 512 * 1024);
  EXPECT_EQ(m.sharding.fullyShard.prefetch, 3);
  EXPECT_EQ(m.sharding.paramDtype, at::kBFloat16);
  EXPECT_EQ(m.sharding.gradClip, 1.0);  // optim.grad_clip of default.yaml
  EXPECT_EQ(m.sharding.optimizer.kind, optim::OptimizerKind::kAdam);
  EXPECT_EQ(m.sharding.optimizer.beta1, 0.8);
  EXPECT_EQ(m.sharding.optimizer.beta2, 0.95);
  EXPECT_EQ(m.sharding.optimizer.noDecay, std::vector<std::string>{"embed.*"});
  EXPECT_EQ(m.sharding.optimizer.lrScale.at("head.*"), 2.5);
  EXPECT_FALSE(optim::decays(m.sharding.optimizer, "embed.weight", {256, 32}));
  EXPECT_EQ(m.schedule.baseLr, 3e-3);
  EXPECT_EQ(m.schedule.kind, optim::ScheduleKind::kCosine);
  EXPECT_EQ(m.schedule.totalSteps, 300);  // run.steps
  EXPECT_EQ(m.ema.options.dtype, at::kBFloat16);
  EXPECT_EQ(m.ema.options.buffers, ema::EmaBuffers::kAverage);
  EXPECT_EQ(c.checkpoint.export_dtype, at::kHalf);
  // Enums print by their names.
  EXPECT_NE(loaded.resolvedYaml.find("strategy: zero2"), std::string::npos) << loaded.resolvedYaml;
  EXPECT_NE(loaded.resolvedYaml.find("bucket_mb: 0.5"), std::string::npos) << loaded.resolvedYaml;
  EXPECT_NE(loaded.resolvedYaml.find("lr_scale: {head.*: 2.5}"), std::string::npos) << loaded.resolvedYaml;
}

// sharding.cpu_offload lands in FullyShardOptions; it is zero3/hybrid's, and with another
// strategy the error names the key and the strategy.
TEST(TrainConfigTest, CpuOffloadIsForFullySharding) {
  const auto loaded = loadTrainConfig(kConfigs + "/default.yaml", {"sharding.strategy=zero3", "sharding.cpu_offload=true"}, 2);
  EXPECT_TRUE(loaded.config.models.front().sharding.fullyShard.cpuOffload);
  try {
    loadTrainConfig(kConfigs + "/default.yaml", {"sharding.strategy=zero2", "sharding.cpu_offload=true"}, 2);
    FAIL() << "cpu_offload with zero2 was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("sharding.cpu_offload"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("zero2"), std::string::npos) << e.what();
  }
}

// ema.warmup caps the decay at 1 - (1 + k)^(-2/3): two decays above its value at the last
// step are the same EMA kept twice, which a warning names (with the decays and the cap);
// one such decay, or decays the run reaches, warn of nothing.
TEST(TrainConfigTest, DecaysTheWarmupNeverReachesAreNamedWhenTheyDuplicate) {
  const auto warningsOf = [](const std::vector<std::string>& more) {
    std::vector<std::string> sets = {"ema.enabled=true", "ema.warmup=true", "checkpoint.export=[model_ema]"};
    sets.insert(sets.end(), more.begin(), more.end());
    return loadTrainConfig(kConfigs + "/default.yaml", sets, 2).config.warnings;
  };
  // 1 - 5501^(-2/3) = 0.99679: neither 0.999 nor 0.9995 is reached.
  const auto twice = warningsOf({"run.steps=5500", "ema.decays=[0.999,0.9995]"});
  ASSERT_EQ(twice.size(), 1u);
  EXPECT_NE(twice[0].find("ema.decays 0.999, 0.9995 are never reached in run.steps 5500"), std::string::npos)
      << twice[0];
  EXPECT_NE(twice[0].find("0.99679"), std::string::npos) << twice[0];
  EXPECT_TRUE(warningsOf({"run.steps=5500", "ema.decays=[0.999]"}).empty());
  EXPECT_TRUE(warningsOf({"run.steps=5500", "ema.decays=[0.99,0.995]"}).empty());  // both reached
  EXPECT_TRUE(warningsOf({"run.steps=5500", "ema.decays=[0.999,0.9995]", "ema.warmup=false"}).empty());
}

// run.matmul_dtype: fp32 (the default) or bf16 Linear products on the CPU; another value,
// or bf16 asked of a GPU run (whose products are LibTorch's), is an error naming the key.
TEST(TrainConfigTest, MatmulDtypeIsForTheCpu) {
  EXPECT_EQ(loadTrainConfig(kConfigs + "/default.yaml", {}, 2).config.run.matmul_dtype, "fp32");
  EXPECT_EQ(loadTrainConfig(kConfigs + "/default.yaml", {"run.matmul_dtype=bf16"}, 2).config.run.matmul_dtype, "bf16");
  for (const auto& [overrides, expected] :
       std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"run.matmul_dtype=fp16"}, "run.matmul_dtype"},
           {{"run.matmul_dtype=bf16", "run.device=cuda"}, "bf16 Linear products are for run.device cpu, not cuda"}}) {
    try {
      loadTrainConfig(kConfigs + "/default.yaml", overrides, 2);
      FAIL() << overrides.front() << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("run.matmul_dtype"), std::string::npos) << e.what();
    }
  }
}

// optim.name muon: its keys land in the optimizer's options (adamw_lr as a multiple of
// optim.lr); set to other than their defaults under another optimizer they are refused, and a
// resolved config (every key at its value) loads again.
TEST(TrainConfigTest, MuonKeysAreMuonsAlone) {
  const auto muon = loadTrainConfig(kConfigs + "/default.yaml",
                                    {"optim.name=muon", "optim.lr=0.02", "optim.muon.adamw_lr=0.005",
                                     "optim.muon.ns_steps=4", "optim.muon.exclude=[layers.0.*]"},
                                    2);
  const optim::OptimizerOptions& o = muon.config.models.front().sharding.optimizer;
  EXPECT_EQ(o.kind, optim::OptimizerKind::kMuon);
  EXPECT_DOUBLE_EQ(o.muon.adamwLrScale, 0.25);
  EXPECT_EQ(o.muon.nsSteps, 4);
  EXPECT_EQ(o.muon.exclude, std::vector<std::string>{"layers.0.*"});
  for (const auto& [overrides, expected] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"optim.muon.momentum=0.9"}, "optim.muon.momentum: applies to optim.name muon, not adamw"},
           {{"optim.name=sgd", "optim.muon.exclude=[x]"}, "optim.muon.exclude: applies to optim.name muon, not sgd"},
           {{"optim.name=muon", "optim.muon.ns_dtype=bf16"}, "optim.muon.ns_dtype: bf16 is for the iteration on a GPU"}}) {
    try {
      loadTrainConfig(kConfigs + "/default.yaml", overrides, 2);
      FAIL() << overrides.back() << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  }
  const std::string resolved = tessera::test::scratchPath("tessera_config", "resolved.yaml");
  std::ofstream(resolved) << loadTrainConfig(kConfigs + "/default.yaml", {}, 2).resolvedYaml;
  EXPECT_NO_THROW(loadTrainConfig(resolved, {}, 2));
}

// checkpoint.* and diagnostics.* bind into the checkpointer's and the runtime's options,
// with the trainer's defaults where they differ; a timeout is written in seconds and held
// as milliseconds, and prints back as written.
TEST(TrainConfigTest, CheckpointAndDiagnosticsKeysLandInTheLibrariesOptions) {
  const TrainConfig defaults = loadTrainConfig(kConfigs + "/default.yaml", {}, 2).config;
  EXPECT_EQ(defaults.checkpoint.writer.keepLast, 3);
  EXPECT_TRUE(defaults.checkpoint.writer.async);
  EXPECT_EQ(defaults.diagnostics.runtime.commTimeout, std::chrono::seconds(100));
  EXPECT_EQ(defaults.diagnostics.runtime.rendezvousTimeout, std::chrono::seconds(300));
  EXPECT_EQ(defaults.diagnostics.checkpoint_timeout, std::chrono::seconds(600));
  EXPECT_EQ(defaults.diagnostics.straggler_ratio, 1.3);
  const auto loaded = loadTrainConfig(kConfigs + "/default.yaml",
                                      {"checkpoint.keep_last=7", "checkpoint.async=false",
                                       "diagnostics.collective_timeout_s=2.5", "diagnostics.startup_timeout_s=30",
                                       "diagnostics.check_collectives=true", "diagnostics.checkpoint_timeout_s=1.25"},
                                      2);
  const TrainConfig& c = loaded.config;
  EXPECT_EQ(c.checkpoint.writer.keepLast, 7);
  EXPECT_FALSE(c.checkpoint.writer.async);
  EXPECT_EQ(c.diagnostics.runtime.commTimeout, std::chrono::milliseconds(2500));
  EXPECT_EQ(c.diagnostics.runtime.rendezvousTimeout, std::chrono::seconds(30));
  EXPECT_TRUE(c.diagnostics.runtime.checkCollectives);
  EXPECT_EQ(c.diagnostics.checkpoint_timeout, std::chrono::milliseconds(1250));
  EXPECT_NE(loaded.resolvedYaml.find("collective_timeout_s: 2.5"), std::string::npos) << loaded.resolvedYaml;
  EXPECT_NE(loaded.resolvedYaml.find("checkpoint_timeout_s: 1.25"), std::string::npos) << loaded.resolvedYaml;
  // A timeout keeps its bounds (in seconds), and a straggler ratio below 1 would name even ranks.
  EXPECT_THROW(loadTrainConfig(kConfigs + "/default.yaml", {"diagnostics.collective_timeout_s=0.5"}, 2), ConfigError);
  try {
    loadTrainConfig(kConfigs + "/default.yaml", {"diagnostics.straggler_ratio=0.5"}, 2);
    ADD_FAILURE() << "a straggler ratio of 0.5 was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("diagnostics.straggler_ratio"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(loadTrainConfig(kConfigs + "/default.yaml", {"diagnostics.straggler_ratio=0"}, 2));
  // fault.lost_after_s notices a loss before the waits on the lost rank time out (over shm
  // twice it): at 5 s a collective timeout of 10 would end the run first, 10.5 leaves room.
  const auto survive = [&](const std::string& timeout) {
    return loadTrainConfig(kConfigs + "/default.yaml",
                           {"fault.survive=true", "sharding.strategy=no_shard", "fault.lost_after_s=5",
                            "diagnostics.collective_timeout_s=" + timeout},
                           2);
  };
  try {
    survive("10");
    ADD_FAILURE() << "fault.lost_after_s 5 under a collective timeout of 10 s was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("fault.lost_after_s"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("collective_timeout_s (10)"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(survive("10.5"));
}

// The single-model form is one entry, named for the state it always had; the MLP's EMA
// is named after its model, a diffusion model's keeps generator_ema.
TEST(TrainConfigTest, SingleModelFormIsOneEntryWithItsNames) {
  const TrainConfig mlp = loadTrainConfig(kConfigs + "/default.yaml", {}, 2).config;
  EXPECT_TRUE(mlp.singleModelForm);
  const ModelEntry& m = mlp.models.front();
  EXPECT_EQ(m.name, "model");
  EXPECT_EQ(m.names.weights, "model");
  EXPECT_EQ(m.names.optimizer, "optim");
  EXPECT_EQ(m.names.ema, "model_ema");
  EXPECT_EQ(m.names.formerEma, "generator_ema");
  EXPECT_EQ(m.ema.options.prefix, "model_ema");
  const TrainConfig diffusion = loadTrainConfig(kConfigs + "/diffusion.yaml", {}, 2).config;
  EXPECT_EQ(diffusion.models.front().names.ema, "generator_ema");
  EXPECT_EQ(diffusion.models.front().names.formerEma, "");
  const TrainConfig distill = loadTrainConfig(kConfigs + "/distill.yaml", {}, 2).config;
  EXPECT_FALSE(distill.singleModelForm);
  ASSERT_EQ(distill.models.size(), 3u);
  EXPECT_EQ(distill.models[1].names.optimizer, "optim/critic");
  EXPECT_EQ(distill.models[1].sharding.strategy, sharding::StrategyKind::kZero2);
  EXPECT_EQ(distill.models[1].schedule.baseLr, 4e-4);                  // its own
  EXPECT_EQ(distill.models[1].sharding.optimizer.beta1, 0.0);          // inherited from optim.betas
  EXPECT_FALSE(distill.models[2].hasEma());                            // the frozen teacher
}

TEST(TrainConfigTest, RecipesOwnTheirSpecs) {
  EXPECT_EQ(recipeSpec("dmd").maxUpdatesPerRunStep("critic"), recipes::DmdOptions::kMaxCriticSteps);
  // dmd binds its own keys into its own struct, which the config keeps for it.
  const TrainConfig distill = loadTrainConfig(kConfigs + "/distill.yaml", {"recipe.critic_steps=3"}, 2).config;
  EXPECT_EQ(recipeOptions<recipes::DmdOptions>(distill, recipes::kDmdRecipe).critic_steps, 3);
  EXPECT_EQ(recipeOptions<recipes::DmdOptions>(distill, recipes::kDmdRecipe).min_t, recipes::DmdOptions().min_t);
  const TrainConfig guided = loadTrainConfig(kConfigs + "/distill.yaml", {"recipe.guidance_interval=[0,99]"}, 2).config;
  EXPECT_EQ(recipeOptions<recipes::DmdOptions>(guided, recipes::kDmdRecipe).guidance_interval,
            (std::vector<int64_t>{0, 99}));
  for (const char* bad : {"recipe.guidance_interval=[0,100000]", "recipe.guidance_interval=[50,10]",
                          "recipe.guidance_interval=[5]"}) {
    try {
      loadTrainConfig(kConfigs + "/distill.yaml", {bad}, 2);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("recipe.guidance_interval"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("is not FIRST,LAST"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(recipeSpec("dmd").maxUpdatesPerRunStep("generator"), 1);
  EXPECT_EQ(recipeSpec("standard").maxUpdatesPerRunStep("model"), 1);
  EXPECT_THROW(recipeSpec("gan"), ConfigError);
  // The standard recipe refuses a models: map; dmd refuses the single-model form.
  const std::string models = writeConfig("data: {path: /usr/share/common-licenses/GPL-3}\n"
                                         "models: {a: {arch: mlp}}\n");
  try {
    loadTrainConfig(models, {}, 1);
    FAIL() << "a models: map under run.recipe standard was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("standard trains the single model"), std::string::npos) << e.what();
  }
  try {
    loadTrainConfig(kConfigs + "/diffusion.yaml", {"run.recipe=dmd"}, 1);
    FAIL() << "dmd without models was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("dmd needs a model named 'generator'"), std::string::npos) << e.what();
  }
}

// model.sample_timesteps: a denoiser's own DDIM timesteps; dmd's generator gets its one
// step from pure noise unless the config names its steps, and only the generator does.
TEST(TrainConfigTest, SampleTimestepsAreCheckedAndDmdGivesTheGeneratorItsSteps) {
  const TrainConfig distill = loadTrainConfig(kConfigs + "/distill.yaml", {}, 1).config;
  EXPECT_EQ(distill.models[0].name, "generator");
  EXPECT_EQ(distill.models[0].model.sample_timesteps, std::vector<int64_t>{distill.models[0].model.timesteps - 1});
  EXPECT_TRUE(distill.models[1].model.sample_timesteps.empty());  // critic
  EXPECT_TRUE(distill.models[2].model.sample_timesteps.empty());  // teacher
  const TrainConfig fewStep =
      loadTrainConfig(kConfigs + "/distill.yaml", {"models.generator.sample_timesteps=[199, 120, 50]"}, 1).config;
  EXPECT_EQ(fewStep.models[0].model.sample_timesteps, (std::vector<int64_t>{199, 120, 50}));
  const auto refused = [](const std::string& config, const std::string& set, const std::string& expected) {
    try {
      loadTrainConfig(kConfigs + config, {set}, 1);
      ADD_FAILURE() << set << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << set << ": " << e.what();
    }
  };
  refused("/distill.yaml", "models.generator.sample_timesteps=[200]", "timestep 200 is outside the schedule's [0, 199]");
  refused("/distill.yaml", "models.generator.sample_timesteps=[50, 120]", "must decrease (50 then 120)");
  refused("/distill.yaml", "models.generator.sample_timesteps=[-1]", "models.generator.sample_timesteps");
  refused("/diffusion.yaml", "model.sample_timesteps=[99, 99]", "must decrease (99 then 99)");
  refused("/default.yaml", "model.sample_timesteps=[5]", "is a denoiser's");
  // Pure noise at the last timestep needs a velocity predictor; dmd's models share one schedule.
  refused("/diffusion.yaml", "model.zero_terminal_snr=true", "model.zero_terminal_snr: needs model.prediction v, not eps");
  refused("/diffusion.yaml", "model.prediction=x0", "model.prediction");
  refused("/diffusion.yaml", "model.noise_schedule=sigmoid", "model.noise_schedule");
  refused("/diffusion.yaml", "model.noise_schedule=cosine", "model.noise_schedule: cosine needs model.prediction v");
  refused("/distill.yaml", "models.critic.noise_schedule=cosine", "noise_schedule and zero_terminal_snr must be the generator's");
  // The DiT's own limits, named at the key's line or --set before any model is built.
  refused("/dit_quick.yaml", "model.patch_overlap=3", "model.patch_overlap: 3 must be between 0 and half of model.patch_size (4)");
  refused("/dit_quick.yaml", "model.patch_size=2", "dit_quick.yaml:");  // the overlap of 2 set in the file, at its line
  refused("/dit_quick.yaml", "model.patch_size=2", "model.patch_overlap: 2 must be between 0 and half of model.patch_size (2)");
}

}  // namespace
}  // namespace tessera::trainer
