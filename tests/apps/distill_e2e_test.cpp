// Several models in one run, end to end: distribution-matching distillation (run.recipe
// dmd) of a diffusion teacher into a one-step generator. The shipped configs reach the
// teacher's sample quality; the run sharded over 2-4 ranks, each model under its own
// strategy, equals one process; a run stopped and resumed on another world size with
// other strategies equals the uninterrupted one; one checkpoint serves tessera-export and
// tessera-ckpt; bad models: configs are config errors naming the model and key.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "checkpoint/metadata.h"
#include "checkpoint/safetensors.h"
#include "tests/apps/train_runs.h"
#include "tests/support/run_command.h"
#include "tests/support/run_files.h"
#include "tests/support/scratch_path.h"

namespace {

namespace fs = std::filesystem;
using tessera::test::CommandResult;
using tessera::test::runCommand;

using tessera::test::kBin;
using tessera::test::kSource;
using tessera::test::kTrain;
const std::string kRings = kSource + "/data/rings.safetensors";

std::string distillScratch(const std::string& tag) { return tessera::test::scratchPath("tessera_distill", tag); }

using tessera::test::mustRun;
using tessera::test::trainCommand;

using tessera::test::readMetrics;

at::Tensor samplesOf(const std::string& runDir) {
  return tessera::checkpoint::loadSafetensors(runDir + "/samples.safetensors").at("samples");
}

// The ring metric of the diffusion test (train_e2e_test.cpp): the 1-Wasserstein distance
// between the radius distribution of `points` and the data's (mean |r_i - q_i| over the
// sorted radii and the data's radius quantiles at the same ranks).
double ringDistance(const at::Tensor& points) {
  static const at::Tensor dataRadii =
      std::get<0>(tessera::checkpoint::loadSafetensors(kRings).at("inputs").norm(2, 1).sort());
  const at::Tensor radii = std::get<0>(points.norm(2, 1).sort());
  const at::Tensor ranks = (at::linspace(0, 1, radii.size(0)) * (dataRadii.size(0) - 1)).round().to(at::kLong);
  return (radii - dataRadii.index_select(0, ranks)).abs().mean().item<double>();
}

// Every tensor of the two files within `tolerance` relative (L2 norm of the difference
// over the norm of `a`'s tensor).
void expectSameWeights(const std::string& a, const std::string& b, double tolerance) {
  const auto x = tessera::checkpoint::loadSafetensors(a);
  const auto y = tessera::checkpoint::loadSafetensors(b);
  ASSERT_EQ(x.size(), y.size()) << a << " vs " << b;
  for (const auto& [name, t] : x) {
    ASSERT_TRUE(y.count(name)) << name << " missing from " << b;
    const double rel = (t - y.at(name)).norm().item<double>() / std::max(t.norm().item<double>(), 1e-30);
    EXPECT_LT(rel, tolerance) << name << " of " << a << " vs " << b;
  }
}

// Same logged figures. The generator's loss is compared more loosely: it is the squared
// difference of two nearly equal clean-sample estimates, each divided by sqrt(abar_t)
// (down to 0.08 here), so float rounding of another reduction order grows in it.
void expectSameMetrics(const std::string& a, const std::string& b) {
  const auto x = readMetrics(a), y = readMetrics(b);
  ASSERT_EQ(x.size(), y.size()) << a << " vs " << b;
  ASSERT_FALSE(x.empty());
  for (size_t i = 0; i < x.size(); ++i) {
    for (const auto& [key, tolerance] : std::vector<std::pair<std::string, double>>{
             {"loss", 1e-4}, {"critic_loss", 1e-5}, {"eval_loss", 1e-5}, {"eval_loss_ema", 1e-5},
             {"gan_loss", 1e-5}, {"critic_gan_loss", 1e-5}}) {
      if (!x[i].contains(key)) continue;
      ASSERT_TRUE(y[i].contains(key)) << key;
      const double u = x[i][key], v = y[i][key];
      EXPECT_NEAR(u, v, tolerance * std::abs(u)) << key << " at step " << x[i]["step"] << ": " << a << " vs " << b;
    }
  }
}

// A small teacher: the diffusion config's denoiser trained briefly, exported as
// <dir>/export/generator_ema.safetensors.
std::string smallTeacher() {
  const std::string dir = distillScratch("teacher");
  mustRun(kTrain + " --config " + kSource + "/configs/diffusion.yaml --set data.path=" + kRings +
          " --set run.dir=" + dir + " --set run.steps=20 --set run.log_every=10 --set run.eval_every=0"
          " --set model.samples=0 --set optim.schedule.warmup_steps=2 --set log.per_rank_files=false");
  return dir + "/export/generator_ema.safetensors";
}

// configs/distill.yaml, small and fast: 6 steps, evaluations at 3 and 6, a few pairs.
std::string smallDistill(const std::string& teacher, const std::string& runDir) {
  return " --config " + kSource + "/configs/distill.yaml --set data.path=" + kRings + " --set model.init_from=" +
         teacher + " --set run.dir=" + runDir +
         " --set run.steps=6 --set run.log_every=1 --set run.eval_every=3 --set data.global_batch=48"
         " --set data.micro_batch=4 --set recipe.regression_pairs=64 --set recipe.pair_steps=10"
         " --set model.samples=16 --set checkpoint.every_steps=0 --set checkpoint.async=false"
         " --set log.per_rank_files=false";
}

std::string strategies(const std::string& generator, const std::string& critic, const std::string& teacher) {
  return " --set models.generator.sharding.strategy=" + generator + " --set models.critic.sharding.strategy=" +
         critic + " --set models.teacher.sharding.strategy=" + teacher;
}

// The shipped configs: train the teacher (configs/diffusion.yaml, 2048 DDPM samples), then
// distil it (configs/distill.yaml). The one-step generator_ema's 2048 samples reach the
// ring metric within 1.5x of the teacher's, far below the untrained one-step generator's.
TEST(DistillE2ETest, ShippedConfigsDistilTheTeacherIntoOneStep) {
  const std::string teacher = distillScratch("diffusion"), distilled = distillScratch("distill"), untrained = distillScratch("untrained");
  mustRun(trainCommand(2) + " --config " + kSource + "/configs/diffusion.yaml --set data.path=" + kRings +
          " --set run.dir=" + teacher + " --set model.samples=2048 --set log.per_rank_files=false");
  const std::string teacherWeights = teacher + "/export/generator_ema.safetensors";
  const std::string distill = " --config " + kSource + "/configs/distill.yaml --set data.path=" + kRings +
                              " --set model.init_from=" + teacherWeights + " --set log.per_rank_files=false";
  const std::string out = mustRun(trainCommand(2) + distill + " --set run.dir=" + distilled);
  // The generator as it starts (the teacher's one-step guess): one step at a learning
  // rate of ~0, with an EMA that keeps the start.
  mustRun(kTrain + distill + " --set run.dir=" + untrained +
          " --set run.steps=1 --set models.generator.optim.lr=1e-12 --set models.generator.ema.decays=[0.999999]"
          " --set checkpoint.export=[generator_ema]");
  const double teacherDistance = ringDistance(samplesOf(teacher));
  const double oneStep = ringDistance(samplesOf(distilled));
  const double start = ringDistance(samplesOf(untrained));
  ASSERT_EQ(samplesOf(distilled).sizes(), (c10::IntArrayRef{2048, 2}));
  ASSERT_EQ(samplesOf(teacher).sizes(), (c10::IntArrayRef{2048, 2}));
  std::cout << "ring distance: teacher (200-step DDPM) " << teacherDistance << ", one-step generator_ema " << oneStep
            << " (" << oneStep / teacherDistance << "x), untrained one-step " << start << "\n";
  EXPECT_LT(oneStep, 1.5 * teacherDistance) << out;
  EXPECT_GT(start, 2.5 * oneStep);
  // The run's metrics carry both models' losses and the evaluations.
  const auto metrics = readMetrics(distilled);
  ASSERT_FALSE(metrics.empty());
  EXPECT_TRUE(metrics.back().contains("critic_loss"));
  EXPECT_TRUE(metrics.back().contains("eval_loss_ema"));
  for (const std::string name : {"generator_ema", "generator", "critic"}) {
    EXPECT_TRUE(fs::exists(distilled + "/export/" + name + ".safetensors")) << name;
  }
}

// 2, 3 and 4 ranks, every model under another strategy (none the same as the one-process
// run's), equal one process: same losses and evaluations, exports within 1e-6.
TEST(DistillE2ETest, ShardedRunsEqualOneProcess) {
  const std::string teacher = smallTeacher();
  const std::string single = distillScratch("single");
  mustRun(trainCommand(1) + smallDistill(teacher, single) + strategies("no_shard", "no_shard", "no_shard"));
  const std::vector<std::pair<int, std::string>> runs = {{2, strategies("zero3", "zero2", "zero3")},
                                                         {3, strategies("zero2", "zero3", "zero1")},
                                                         {4, strategies("zero1", "no_shard", "zero3")}};
  for (const auto& [ranks, chosen] : runs) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks:" + chosen);
    const std::string dir = distillScratch("world" + std::to_string(ranks));
    mustRun(trainCommand(ranks) + smallDistill(teacher, dir) + chosen);
    expectSameMetrics(single, dir);
    for (const std::string name : {"generator_ema", "generator", "critic"}) {
      expectSameWeights(single + "/export/" + name + ".safetensors", dir + "/export/" + name + ".safetensors", 1e-6);
    }
    const double samples = (samplesOf(single) - samplesOf(dir)).abs().max().item<double>();
    EXPECT_LT(samples, 1e-5) << "one-step samples differ by " << samples;
  }
}

// run.deterministic over several models: the generator, the critic (2 updates a step) and
// the frozen teacher on 1 rank and on 4 (6 micro-batches of 8: 1 or 2 a rank) under other
// strategies give the same bits: exports compared with torch::equal, losses exactly.
TEST(DistillE2ETest, DeterministicRunsHaveTheSameBitsOnOneAndFourRanks) {
  const std::string teacher = smallTeacher();
  const std::string single = distillScratch("det_single"), four = distillScratch("det_four");
  const std::string det = " --set run.deterministic=true --set data.micro_batch=8";
  mustRun(trainCommand(1) + smallDistill(teacher, single) + det + strategies("no_shard", "no_shard", "no_shard"));
  mustRun(trainCommand(4) + smallDistill(teacher, four) + det + strategies("zero3", "zero2", "zero1"));
  for (const std::string name : {"generator_ema", "generator", "critic"}) {
    const auto x = tessera::checkpoint::loadSafetensors(single + "/export/" + name + ".safetensors");
    const auto y = tessera::checkpoint::loadSafetensors(four + "/export/" + name + ".safetensors");
    ASSERT_EQ(x.size(), y.size()) << name;
    for (const auto& [tensor, value] : x) EXPECT_TRUE(at::equal(value, y.at(tensor))) << name << ": " << tensor;
  }
  const auto a = readMetrics(single), b = readMetrics(four);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    for (const char* key : {"loss", "critic_loss", "eval_loss"}) {
      if (a[i].contains(key)) EXPECT_EQ(b[i].value(key, -1.0), a[i][key].get<double>()) << key << ", line " << i;
    }
  }
}

// A 3-step generator stopped at step 3 on 4 ranks (generator zero3, critic zero2, teacher
// zero3: the config's), resumed on 3 ranks with every model under another strategy: the same figures
// and exports as the uninterrupted 4-rank run. The one checkpoint holds all three models,
// the optimizers and the EMA; tessera-export and tessera-ckpt read it offline.
TEST(DistillE2ETest, ResumedOnAnotherWorldSizeAndStrategiesEqualsUninterrupted) {
  const std::string teacher = smallTeacher();
  const std::string whole = distillScratch("whole"), resumed = distillScratch("resumed");
  // The critic with an EMA of its own too, updated once per run step however many critic
  // updates a step makes; the generator a few-step one (backward simulation draws its
  // chain steps from the sample seeds, so a resumed run draws the same).
  const std::string criticEma = " --set models.critic.ema.enabled=true --set recipe.critic_steps=3"
                                " --set checkpoint.export=[generator_ema,generator,critic,critic_ema]"
                                " --set models.generator.sample_timesteps=[199,120,40]";
  mustRun(trainCommand(4) + smallDistill(teacher, whole) + criticEma);
  mustRun(trainCommand(4) + smallDistill(teacher, resumed) + criticEma + " --set run.stop_after_steps=3");
  const std::string out =
      mustRun(trainCommand(3) + smallDistill(teacher, resumed) + criticEma + strategies("zero2", "zero3", "zero1"));
  EXPECT_NE(out.find("resumed from " + resumed + "/checkpoints/step_00000003"), std::string::npos) << out;
  EXPECT_NE(out.find("now 3 ranks with generator:zero2 critic:zero3 teacher:zero1"), std::string::npos) << out;
  // The regression pairs come from the run's cache, made by the 4 ranks (not sampled again).
  EXPECT_NE(out.find("dmd: 64 regression pairs read from " + resumed + "/cache/dmd_pairs.safetensors"),
            std::string::npos) << out;
  expectSameMetrics(whole, resumed);
  for (const std::string name : {"generator_ema", "generator", "critic", "critic_ema"}) {
    expectSameWeights(whole + "/export/" + name + ".safetensors", resumed + "/export/" + name + ".safetensors", 1e-6);
  }

  // Offline, from the one checkpoint: every model and the EMA by name.
  const std::string step = resumed + "/checkpoints/step_00000006";
  for (const std::string name : {"generator_ema", "generator", "critic", "teacher"}) {
    const std::string file = distillScratch(name + ".safetensors");
    mustRun(kBin + "/tessera-export " + step + " --what " + name + " --out " + file);
    if (name == "teacher") {
      expectSameWeights(teacher, file, 1e-30);  // frozen: what it started from, bit for bit
    } else {
      expectSameWeights(resumed + "/export/" + name + ".safetensors", file, 1e-7);
    }
  }
  const std::string info = mustRun(kBin + "/tessera-ckpt info " + step);
  EXPECT_NE(info.find("model        generator  34 tensors"), std::string::npos) << info;
  // The component table: whose optimizer state and EMA each is; the frozen teacher has neither.
  EXPECT_NE(info.find("model        teacher  34 tensors, 472.3 KiB\n"), std::string::npos) << info;
  EXPECT_NE(info.find("optimizer    optim/generator  "), std::string::npos) << info;
  EXPECT_NE(info.find("ema          critic_ema  34 tensors, 472.3 KiB; of critic"), std::string::npos) << info;
  EXPECT_EQ(info.find("of teacher"), std::string::npos) << info;
  EXPECT_NE(info.find("ema          generator_ema"), std::string::npos) << info;
}

// DMD2's form: the GAN term (a head on the critic's block 0, trained on the data's points
// against the generator's) and no regression loss. Sharded over 3 ranks (the critic's head
// under zero3, its gathers in the head's partial forwards) it equals one process; stopped
// at step 3 on 4 ranks and resumed on 2 with other strategies it equals the uninterrupted
// 4-rank run, the head's weights included (resharded with the critic's). Without the
// regression loss no pairs are made.
TEST(DistillE2ETest, GanTermWithoutRegressionShardsAndResumesOnAnotherWorldSize) {
  const std::string teacher = smallTeacher();
  const std::string gan = " --set recipe.gan_weight=0.5 --set recipe.gan_critic_weight=0.1 --set recipe.gan_block=0"
                          " --set recipe.regression_weight=0 --set recipe.critic_steps=2";
  const std::string single = distillScratch("gan_single"), three = distillScratch("gan_three");
  const std::string out = mustRun(trainCommand(1) + smallDistill(teacher, single) + gan +
                                  strategies("no_shard", "no_shard", "no_shard"));
  EXPECT_EQ(out.find("regression pairs"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(single + "/cache/dmd_pairs.safetensors"));
  mustRun(trainCommand(3) + smallDistill(teacher, three) + gan + strategies("zero2", "zero3", "zero1"));
  const auto metrics = readMetrics(single), metrics3 = readMetrics(three);
  ASSERT_FALSE(metrics.empty());
  for (size_t i = 0; i < metrics.size(); ++i) {
    for (const char* key : {"gan_loss", "critic_gan_loss"}) {
      ASSERT_TRUE(metrics[i].contains(key)) << key << " missing at line " << i;
      EXPECT_NEAR(metrics[i][key].get<double>(), metrics3[i][key].get<double>(), 1e-5) << key << ", line " << i;
    }
  }
  expectSameMetrics(single, three);
  const auto critic = tessera::checkpoint::loadSafetensors(single + "/export/critic.safetensors");
  ASSERT_TRUE(critic.count("gan_head.3.weight")) << "the critic's export lacks its GAN head";
  for (const std::string name : {"generator_ema", "generator", "critic"}) {
    expectSameWeights(single + "/export/" + name + ".safetensors", three + "/export/" + name + ".safetensors", 1e-6);
  }
  // The GAN term changes what the generator learns (against the same run without it).
  const std::string plain = distillScratch("gan_off");
  mustRun(trainCommand(1) + smallDistill(teacher, plain) + " --set recipe.regression_weight=0 --set recipe.critic_steps=2" +
          strategies("no_shard", "no_shard", "no_shard"));
  const auto a = tessera::checkpoint::loadSafetensors(single + "/export/generator.safetensors");
  const auto b = tessera::checkpoint::loadSafetensors(plain + "/export/generator.safetensors");
  double differs = 0;
  for (const auto& [name, t] : a) differs = std::max(differs, (t - b.at(name)).abs().max().item<double>());
  EXPECT_GT(differs, 1e-6);
  // The head's own timestep range (here its least noisy tenth) changes it too.
  const std::string low = distillScratch("gan_low_t");
  mustRun(trainCommand(1) + smallDistill(teacher, low) + gan + " --set recipe.gan_max_t=0.1" +
          strategies("no_shard", "no_shard", "no_shard"));
  const auto c = tessera::checkpoint::loadSafetensors(low + "/export/generator.safetensors");
  differs = 0;
  for (const auto& [name, t] : a) differs = std::max(differs, (t - c.at(name)).abs().max().item<double>());
  EXPECT_GT(differs, 1e-6);

  const std::string whole = distillScratch("gan_whole"), resumed = distillScratch("gan_resumed");
  mustRun(trainCommand(4) + smallDistill(teacher, whole) + gan);
  mustRun(trainCommand(4) + smallDistill(teacher, resumed) + gan + " --set run.stop_after_steps=3");
  const std::string again =
      mustRun(trainCommand(2) + smallDistill(teacher, resumed) + gan + strategies("zero3", "zero3", "no_shard"));
  EXPECT_NE(again.find("resumed from " + resumed + "/checkpoints/step_00000003"), std::string::npos) << again;
  expectSameMetrics(whole, resumed);
  for (const std::string name : {"generator_ema", "generator", "critic"}) {
    expectSameWeights(whole + "/export/" + name + ".safetensors", resumed + "/export/" + name + ".safetensors", 1e-6);
  }
}

// The regression pairs are sampled once and kept in <run.dir>/cache: a resume reads them
// and trains as the uninterrupted run; a damaged cache file is named and replaced; a cache
// made with other recipe settings is not used.
TEST(DistillE2ETest, RegressionPairsAreKeptForTheRestart) {
  const std::string teacher = smallTeacher();
  const std::string whole = distillScratch("uncached"), dir = distillScratch("cached");
  const std::string cache = dir + "/cache/dmd_pairs.safetensors";
  mustRun(trainCommand(1) + smallDistill(teacher, whole));
  std::string out = mustRun(trainCommand(1) + smallDistill(teacher, dir) + " --set run.stop_after_steps=2");
  EXPECT_EQ(out.find("regression pairs read from"), std::string::npos) << out;
  ASSERT_TRUE(fs::is_regular_file(cache)) << out;

  fs::resize_file(cache, fs::file_size(cache) / 2);  // damaged
  out = mustRun(trainCommand(1) + smallDistill(teacher, dir) + " --set run.stop_after_steps=2");  // to step 4
  EXPECT_NE(out.find("dmd: the cached regression pairs " + cache + " are not used ("), std::string::npos) << out;
  EXPECT_NE(out.find("sampling them again"), std::string::npos) << out;

  out = mustRun(trainCommand(1) + smallDistill(teacher, dir));  // sampled again and kept: read now
  EXPECT_NE(out.find("dmd: 64 regression pairs read from " + cache), std::string::npos) << out;
  expectSameMetrics(whole, dir);
  expectSameWeights(whole + "/export/generator_ema.safetensors", dir + "/export/generator_ema.safetensors", 1e-7);

  const std::string other = distillScratch("other_steps");
  fs::create_directories(other + "/cache");
  fs::copy_file(cache, other + "/cache/dmd_pairs.safetensors");
  out = mustRun(trainCommand(1) + smallDistill(teacher, other) + " --set recipe.pair_steps=8");
  EXPECT_NE(out.find("made for other settings: pair_steps: the file's 'pair_steps 10', this run's 'pair_steps 8'"),
            std::string::npos) << out;
  // The guidance interval is part of the key (the pairs are the guided teacher's samples).
  const std::string interval = distillScratch("other_interval");
  fs::create_directories(interval + "/cache");
  fs::copy_file(cache, interval + "/cache/dmd_pairs.safetensors");
  out = mustRun(trainCommand(1) + smallDistill(teacher, interval) + " --set recipe.guidance_interval=[0,50] --set run.steps=2");
  EXPECT_NE(out.find("made for other settings: guidance: the file's 'guidance 1', this run's 'guidance 1 at t in [0, 50]'"),
            std::string::npos) << out;

  // A FIFO in the cache's place is neither read (no hang) nor written through.
  const std::string fifo = distillScratch("fifo_cache");
  fs::create_directories(fifo + "/cache");
  ASSERT_EQ(runCommand("mkfifo " + fifo + "/cache/dmd_pairs.safetensors", 10).status, 0);
  out = mustRun(trainCommand(1) + smallDistill(teacher, fifo), 120);
  EXPECT_NE(out.find("not a regular file"), std::string::npos) << out;
  EXPECT_NE(out.find("dmd: could not keep the regression pairs in"), std::string::npos) << out;

  // Round 4, class 4: a cache with the right key and an extra tensor of 8 GiB (a sparse
  // file) is refused from its header at once, in the file's words, before any data is read.
  const std::string extra = distillScratch("extra_tensor");
  fs::create_directories(extra + "/cache");
  {
    std::ifstream in(cache, std::ios::binary);
    uint64_t headerBytes = 0;
    in.read(reinterpret_cast<char*>(&headerBytes), 8);
    std::string header(headerBytes, '\0');
    in.read(header.data(), static_cast<std::streamsize>(headerBytes));
    const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    nlohmann::json j = nlohmann::json::parse(header);
    const int64_t end = static_cast<int64_t>(data.size());
    const int64_t huge = int64_t{8} << 30;
    j["extra"] = {{"dtype", "F32"}, {"shape", {huge / 4}}, {"data_offsets", {end, end + huge}}};
    std::string text = j.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    std::ofstream out(extra + "/cache/dmd_pairs.safetensors", std::ios::binary);
    const uint64_t n = text.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << text << data;
  }
  fs::resize_file(extra + "/cache/dmd_pairs.safetensors", fs::file_size(extra + "/cache/dmd_pairs.safetensors") +
                                                             (uint64_t{8} << 30));  // sparse: no disk used
  const CommandResult refused = runCommand(trainCommand(1) + smallDistill(teacher, extra) + " --set run.steps=2", 120);
  EXPECT_EQ(refused.status, 0) << refused.output;
  EXPECT_NE(refused.output.find("are not used (a tensor 'extra' it should not have)"), std::string::npos)
      << refused.output;
  EXPECT_EQ(refused.output.find("frame #"), std::string::npos) << refused.output;
  // ... and not read: the run's resident memory never came near the 8 GiB.
  for (const auto& line : readMetrics(extra)) {
    if (line.contains("peak_rss_mib")) EXPECT_LT(line["peak_rss_mib"].get<double>(), 2048.0) << line.dump();
  }

  // A resume whose teacher file is gone (the frozen teacher comes from the checkpoint):
  // the pairs cannot be keyed, so they are sampled, and the run goes on.
  const std::string moved = distillScratch("moved_teacher.safetensors"), gone = distillScratch("gone");
  fs::copy_file(teacher, moved);
  const std::string withMoved = smallDistill(teacher, gone) + " --set model.init_from=" + moved;
  mustRun(trainCommand(1) + withMoved + " --set run.stop_after_steps=2");
  fs::remove(moved);
  out = mustRun(trainCommand(1) + withMoved);
  EXPECT_NE(out.find("cannot be read for their key"), std::string::npos) << out;
  EXPECT_NE(out.find("resumed from"), std::string::npos) << out;
}

// A single-model run's checkpoint as earlier versions wrote it — format 2, with flat
// export aliases instead of the component table, and without the "model" alias — resumes,
// and tessera-export and tessera-ckpt find the model and the EMA by name.
TEST(DistillE2ETest, SingleModelCheckpointsOfEarlierVersionsLoad) {
  const std::string run = distillScratch("single_model");
  const std::string args = " --config " + kSource + "/configs/default.yaml --set run.dir=" + run +
                           " --set log.per_rank_files=false --set checkpoint.async=false --set run.log_every=1"
                           " --set optim.schedule.kind=constant";
  mustRun(kTrain + args + " --set run.steps=2");
  const std::string step = run + "/checkpoints/step_00000002";
  nlohmann::json md = nlohmann::json::parse(std::ifstream(step + "/metadata.json"));
  nlohmann::json aliases = nlohmann::json::object();
  for (const auto& c : md["components"]) {
    for (const auto& [name, prefix] : c["exports"].items()) aliases[name] = prefix;
  }
  ASSERT_EQ(aliases["model"], "model/");
  aliases.erase("model");
  aliases.erase("model_ema");  // the EMA's own name: format 2 found it under ema/ by convention
  md.erase("components");
  md["aliases"] = aliases;
  md["version"] = 2;
  std::ofstream(step + "/metadata.json") << tessera::checkpoint::resealMetadata(md.dump());  // as that version wrote it
  const std::string info = mustRun(kBin + "/tessera-ckpt info " + step);
  EXPECT_NE(info.find("ema          model_ema  "), std::string::npos) << info;
  EXPECT_NE(info.find("optimizer    optim  "), std::string::npos) << info;
  const std::string out = mustRun(kTrain + args + " --set run.steps=3");
  EXPECT_NE(out.find("resumed from " + step), std::string::npos) << out;
  mustRun(kBin + "/tessera-export " + step + " --what model --out " + distillScratch("model.safetensors"));
  mustRun(kBin + "/tessera-export " + step + " --what model_ema --out " + distillScratch("model_ema.safetensors"));
}

// Bad models: configs exit with status 2 and name the model and the key.
TEST(DistillE2ETest, BadModelConfigsAreConfigErrors) {
  const std::string teacher = smallTeacher();
  // A config of its own with `models` as its models: section, and a run.dir of its own
  // (one run per run.dir).
  auto configWith = [&](const std::string& tag, const std::string& models) {
    const std::string path = distillScratch(tag + ".yaml");
    std::ofstream(path) << "run: {recipe: dmd, steps: 2, dir: " << distillScratch("run_" + tag) << "}\n"
                        << "model: {arch: diffusion, embed_dim: 64, layers: 3, timesteps: 200, beta_start: 1.0e-4, "
                           "beta_end: 0.05, init_from: "
                        << teacher << "}\n"
                        << "data: {kind: tensors, path: " << kRings << ", global_batch: 48, micro_batch: 4}\n"
                        << "log: {per_rank_files: false}\n"
                        << "checkpoint: {resume: none}\n"
                        << "models:\n"
                        << models;
    return path;
  };
  const std::string good = "  generator: {}\n  critic: {}\n  teacher: {trainable: false}\n";
  auto expectConfigError = [&](const std::string& args, const std::vector<std::string>& names) {
    const CommandResult r = runCommand(kTrain + args, 120);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.output;
    for (const auto& name : names) EXPECT_NE(r.output.find(name), std::string::npos) << name << " in\n" << r.output;
  };
  // The config as written trains (two steps): the cases below each change one thing.
  EXPECT_EQ(runCommand(kTrain + " --config " + configWith("good", good), 300).status, 0);
  // A model named twice.
  const std::string twice = configWith("twice", good + "  critic: {}\n");
  expectConfigError(" --config " + twice, {twice + ":10:3", "models.critic: named twice"});
  // A recipe that needs a model the config lacks.
  expectConfigError(" --config " + configWith("lacking", "  generator: {}\n  teacher: {trainable: false}\n"),
                    {"run.recipe: dmd needs a model named 'critic' under models: (the config has: generator, teacher)"});
  // A frozen model with an optim or ema section.
  expectConfigError(" --config " + configWith("frozen", "  generator: {}\n  critic: {}\n  teacher: {trainable: false, "
                                                          "optim: {lr: 0.1}}\n"),
                    {"models.teacher.optim.lr: set on a frozen model (models.teacher.trainable: false), which has no "
                     "optim"});
  const std::string config = " --config " + configWith("base", good);
  expectConfigError(config + " --set models.teacher.ema.decays=[0.9]", {"models.teacher.ema.decays", "has no ema"});
  // ema.enabled false on it only says what is so; its resolved config loads back.
  const std::string resolved = distillScratch("resolved.yaml");
  ASSERT_EQ(runCommand(kTrain + config + " --set models.teacher.ema.enabled=false --print-config > " + resolved, 60).status,
            0);
  EXPECT_EQ(runCommand(kTrain + " --config " + resolved + " --print-config", 60).status, 0);
  // Reserved names, and names that collide with an EMA's.
  expectConfigError(" --config " + configWith("reserved", good + "  optim: {}\n"), {"models.optim", "reserved"});
  // Named at the key that was written, with its line (not at models.ema.trainable).
  expectConfigError(" --config " + configWith("reserved_ema", good + "  ema:\n    arch: diffusion\n"),
                    {"models.ema.arch", "reserved"});
  expectConfigError(" --config " + configWith("extra", good + "  student: {}\n"),
                    {"models.student.trainable", "'student' would never be used"});
  expectConfigError(config + " --set models.teacher.timesteps=100",
                    {"models.teacher.timesteps", "must be the generator's"});
  // init_from whose tensors do not fit: a narrower teacher than the file; the setting that
  // differs from the export's is named.
  expectConfigError(config + " --set models.teacher.embed_dim=32",
                    {"models.teacher.init_from: ", teacher, "does not match the model", "shape mismatch",
                     "the file was exported from a model with other settings: models.teacher.embed_dim: 64 in the "
                     "file, 32 here"});
  // --set for a model the config does not name; a bad name; the recipe's roles.
  expectConfigError(config + " --set models.critc.optim.lr=1", {"models.critc.optim.lr", "no entry 'critc'"});
  expectConfigError(" --config " + configWith("bad_name", good + "  9lives: {}\n"), {"models.9lives", "identifiers"});
  expectConfigError(config + " --set models.critic.trainable=false", {"models.critic.trainable", "dmd trains its critic"});
  expectConfigError(config + " --set models.generator.sharding.strategy=hybrid",
                    {"models.generator.sharding.strategy", "hybrid is not supported"});
  expectConfigError(config + " --set run.recipe=standard", {"run.recipe: standard trains the single model"});
  expectConfigError(config + " --set checkpoint.export=[teacher_ema]",
                    {"checkpoint.export", "'teacher_ema'", "generator_ema"});
  // The GAN term: a block the critic does not have; a head that would never learn.
  expectConfigError(config + " --set recipe.gan_weight=0.1 --set recipe.gan_block=3",
                    {"recipe.gan_block: 3 is not a block of the critic (3 layers, counted from 0; -1: the middle)"});
  expectConfigError(config + " --set recipe.gan_weight=0.1 --set recipe.gan_critic_weight=0",
                    {"recipe.gan_critic_weight: must be > 0 with recipe.gan_weight > 0"});
  expectConfigError(config + " --set recipe.gan_weight=-1", {"recipe.gan_weight"});
  expectConfigError(config + " --set recipe.gan_weight=0.1 --set recipe.gan_min_t=0.5 --set recipe.gan_max_t=0.3",
                    {"recipe.gan_min_t: 0.5 is not below recipe.gan_max_t (0.3)"});
}

}  // namespace
