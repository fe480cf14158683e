// The DiT workload end to end: a class-conditional DiT on IDX images (tests/support/idx_images.h:
// 8x8, 4 classes) trains the same at 1 to 4 ranks under every strategy (flips and label drops
// included), resumes on another world size as if uninterrupted, and its exports carry
// their model: tessera-sample draws from an export or a checkpoint (the same samples,
// split over ranks or not), offline exports describe the model as the run's own do, and
// bad requests are refused naming what is wrong.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <iterator>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/reader.h"
#include "checkpoint/safetensors.h"
#include "tests/apps/train_runs.h"
#include "tests/support/idx_images.h"
#include "tests/support/run_command.h"
#include "tests/support/run_files.h"
#include "tests/support/scratch_path.h"

namespace {

namespace fs = std::filesystem;
using tessera::test::emaExport;
using tessera::test::expectCloseExports;
using tessera::test::expectSameLosses;
using tessera::test::mustRun;
using tessera::test::readMetrics;
using tessera::test::trainCommand;

using tessera::test::kBin;

std::string ditScratch(const std::string& tag) { return tessera::test::scratchPath("tessera_dit", tag); }

// A small DiT run: width 20 and 2 heads (rows that do not divide over 3 or 4 ranks), flips,
// label drops, an EMA exported; the constant learning rate lets a run be cut in two.
std::string ditConfig(const std::string& dir) {
  const auto [images, labels] = tessera::test::writeIdxImages(dir + "/data");
  const std::string path = dir + "/dit.yaml";
  std::ofstream(path) << "run: {name: dit, seed: 3, steps: 8, log_every: 4, eval_every: 8}\n"
                         "log: {per_rank_files: false}\n"
                         "model: {arch: dit, embed_dim: 20, layers: 2, heads: 2, patch_size: 4, mlp_ratio: 2.5,\n"
                         "        timesteps: 100, class_dropout: 0.25}\n"
                         "data: {kind: idx, path: " << images << ", labels: " << labels
                      << ", global_batch: 24, micro_batch: 2,\n"
                         "       eval_fraction: 0.25, hflip: true}\n"
                         "optim: {name: adamw, lr: 0.002, weight_decay: 0.01, schedule: {kind: constant}}\n"
                         "ema: {enabled: true, decays: [0.9]}\n"
                         "checkpoint: {every_steps: 4, async: false, export: [generator_ema]}\n";
  return " --config " + path;
}

TEST(DitE2ETest, ShardedMatchesOneProcessUnderEveryStrategyAtOneToFourRanks) {
  const std::string dir = ditScratch("runs");
  const std::string args = ditConfig(dir);
  const std::string single = dir + "/single";
  mustRun(trainCommand(1) + args + " --set sharding.strategy=no_shard --set run.dir=" + single);
  ASSERT_TRUE(readMetrics(single).back().contains("eval_loss_ema"));
  const auto exported = emaExport(single);
  // The reference's names: 2 blocks x 10, x_embedder 2, pos_embed, t_embedder 4, y_embedder 1, final_layer 4.
  EXPECT_EQ(exported.size(), 32u);
  EXPECT_EQ(exported.at("x_embedder.proj.weight").sizes(), (c10::IntArrayRef{20, 1, 4, 4}));
  EXPECT_EQ(exported.at("pos_embed").sizes(), (c10::IntArrayRef{1, 4, 20}));
  EXPECT_EQ(exported.at("y_embedder.embedding_table.weight").sizes(), (c10::IntArrayRef{5, 20}));  // 4 classes + none
  EXPECT_EQ(exported.at("blocks.1.mlp.fc1.weight").sizes(), (c10::IntArrayRef{50, 20}));
  EXPECT_EQ(exported.at("blocks.0.adaLN_modulation.1.weight").sizes(), (c10::IntArrayRef{120, 20}));
  EXPECT_EQ(exported.at("final_layer.linear.weight").sizes(), (c10::IntArrayRef{16, 20}));
  struct Case {
    int ranks;
    std::string strategy, extra;
  };
  for (const Case& c : {Case{2, "zero1", ""}, Case{2, "zero2", ""}, Case{3, "zero3", ""},
                        Case{4, "hybrid", " --set sharding.shard_size=2 --set data.micro_batch=3"}}) {
    const std::string what = c.strategy + " on " + std::to_string(c.ranks) + " ranks";
    const std::string runDir = dir + "/" + c.strategy;
    mustRun(trainCommand(c.ranks) + args + " --set sharding.strategy=" + c.strategy + c.extra + " --set run.dir=" + runDir);
    expectSameLosses(single, runDir, what);
    expectCloseExports(single, runDir, what);
  }
}

// The largest absolute difference between two runs' generator_ema exports.
double maxExportDifference(const std::string& a, const std::string& b) {
  const auto x = emaExport(a), y = emaExport(b);
  double most = 0;
  for (const auto& [name, tensor] : x) most = std::max(most, (tensor - y.at(name)).abs().max().item<double>());
  return most;
}

// run.matmul_dtype bf16: the Linear layers multiply bf16 copies in fp32 accumulators. The
// run is then not the fp32 one (the rounding shows in the losses) but close to it, and it
// is still sharded as in one process: zero3 on 3 ranks has no_shard's losses on one (to
// 1e-5). Its weights agree to bf16's precision, not fp32's: sharding sums gradients in
// another order, weights differing in their last fp32 bit can round to neighbouring bf16
// values, and the next products see that. So the exports are compared against the gap
// between bf16 and fp32 products, which is more than 5 times larger.
TEST(DitE2ETest, Bf16LinearsTrainShardedAsInOneProcessAndCloseToFp32) {
  const std::string dir = ditScratch("bf16");
  const std::string args = ditConfig(dir);
  const std::string fp32 = dir + "/fp32", single = dir + "/single", sharded = dir + "/sharded";
  mustRun(trainCommand(1) + args + " --set sharding.strategy=no_shard --set run.dir=" + fp32);
  const std::string log = mustRun(trainCommand(1) + args +
                                  " --set sharding.strategy=no_shard --set run.matmul_dtype=bf16 --set run.dir=" + single);
  EXPECT_NE(log.find("matrix products: Linear layers in bf16 ("), std::string::npos) << log;
  mustRun(trainCommand(3) + args + " --set sharding.strategy=zero3 --set run.matmul_dtype=bf16 --set run.dir=" + sharded);
  expectSameLosses(single, sharded, "bf16 Linears, zero3 on 3 ranks");
  const double shardedGap = maxExportDifference(single, sharded), fp32Gap = maxExportDifference(single, fp32);
  EXPECT_LT(shardedGap, 5e-4);
  EXPECT_LT(shardedGap, fp32Gap / 5) << "sharded " << shardedGap << ", fp32 " << fp32Gap;
  const auto a = readMetrics(fp32), b = readMetrics(single);
  ASSERT_EQ(a.size(), b.size());
  const double x = a.back()["eval_loss"], y = b.back()["eval_loss"];
  EXPECT_NE(x, y) << "bf16 products changed nothing";
  EXPECT_NEAR(x, y, 0.02 * x) << "bf16 products far from fp32's";
  // Where oneDNN has no bf16 kernel (cores below AVX-512) the products are LibTorch's own;
  // TESSERA_CPU_MATMUL=aten takes that path here. Its outputs are rounded to bf16, so the
  // run is close to the others, not equal.
  const std::string aten = dir + "/aten";
  const std::string atenLog = mustRun("TESSERA_CPU_MATMUL=aten " + trainCommand(1) + args +
                                      " --set sharding.strategy=no_shard --set run.matmul_dtype=bf16 --set run.dir=" + aten);
  EXPECT_NE(atenLog.find("Linear layers in bf16 (LibTorch's bf16 product (TESSERA_CPU_MATMUL=aten)"), std::string::npos)
      << atenLog;
  const double z = readMetrics(aten).back()["eval_loss"];
  EXPECT_NEAR(z, y, 0.02 * y) << "LibTorch's bf16 products far from oneDNN's";
}

TEST(DitE2ETest, ResumeOnAnotherWorldSizeEqualsUninterrupted) {
  const std::string dir = ditScratch("resume");
  const std::string args = ditConfig(dir);
  const std::string full = dir + "/full", cut = dir + "/cut";
  mustRun(trainCommand(2) + args + " --set sharding.strategy=zero3 --set run.dir=" + full);
  mustRun(trainCommand(2) + args + " --set sharding.strategy=zero3 --set run.stop_after_steps=4 --set run.dir=" + cut);
  const std::string out = mustRun(trainCommand(3) + args + " --set sharding.strategy=zero2 --set run.dir=" + cut);
  EXPECT_NE(out.find("saved by 2 ranks with zero3; now 3 ranks with zero2"), std::string::npos) << out;
  expectCloseExports(full, cut, "2 ranks zero3 -> 3 ranks zero2");
}

// Every tensor of a run's checkpoint and post-hoc EMA snapshot of step 8 (those it has),
// by "<step dir>:<name>".
std::map<std::string, at::Tensor> step8Tensors(const std::string& runDir) {
  std::map<std::string, at::Tensor> out;
  for (const std::string& step : {"/checkpoints/step_00000008", "/posthoc/step_00000008"}) {
    if (!fs::exists(runDir + step)) continue;
    tessera::checkpoint::CheckpointReader reader(runDir + step);
    for (const auto& t : reader.metadata().tensors) out[step + ":" + t.name] = reader.readFull(t.name);
  }
  return out;
}

// `runDir` holds bitwise what `referenceDir` holds: every tensor of step 8's checkpoint (and
// snapshot), the EMA export and every logged loss.
void expectSameBits(const std::string& referenceDir, const std::string& runDir, const std::string& what) {
  const auto reference = step8Tensors(referenceDir);
  ASSERT_FALSE(reference.empty()) << referenceDir;
  const auto got = step8Tensors(runDir);
  EXPECT_EQ(got.size(), reference.size()) << what;
  for (const auto& [name, want] : reference) {
    if (got.count(name) == 0) continue;  // (the count differs: reported above)
    EXPECT_TRUE(torch::equal(got.at(name), want)) << what << ": checkpoint tensor " << name;
  }
  const auto referenceExport = emaExport(referenceDir);
  const auto exported = emaExport(runDir);
  for (const auto& [name, want] : referenceExport) EXPECT_TRUE(torch::equal(exported.at(name), want)) << what << ": " << name;
  const auto referenceMetrics = readMetrics(referenceDir);
  const auto metrics = readMetrics(runDir);
  ASSERT_EQ(metrics.size(), referenceMetrics.size()) << what;
  for (size_t i = 0; i < metrics.size(); ++i) {
    for (const char* key : {"loss", "eval_loss", "eval_loss_ema"}) {
      if (!referenceMetrics[i].contains(key)) continue;
      EXPECT_EQ(metrics[i].value(key, -1.0), referenceMetrics[i][key].get<double>()) << what << ": " << key << ", line " << i;
    }
  }
}

// run.deterministic: the same bits whatever the world size and strategy, a stop on one
// world size and a resume on another included. 6 micro-batches of 4 (uneven over 4 ranks),
// compared with torch::equal: every tensor of the last checkpoint (masters, the optimizer's
// state, the EMA), the export, and every logged loss exactly. `extra`: the optimizer.
void expectDeterministicEverywhere(const std::string& dir, const std::string& extra) {
  const std::string args = ditConfig(dir) + " --set run.deterministic=true --set data.micro_batch=4" +
                           " --set ema.posthoc.stds=[0.05,0.1] --set ema.posthoc.snapshot_every=4" + extra;
  const std::string single = dir + "/single";
  const std::string log = mustRun(trainCommand(1) + args + " --set sharding.strategy=no_shard --set run.dir=" + single);
  EXPECT_NE(log.find("run.deterministic"), std::string::npos) << log;
  struct Case {
    int ranks;
    std::string strategy, extra;
  };
  for (const Case& c : {Case{2, "zero3", ""}, Case{3, "zero2", ""}, Case{4, "hybrid", " --set sharding.shard_size=2"}}) {
    const std::string what = c.strategy + " on " + std::to_string(c.ranks) + " ranks";
    const std::string runDir = dir + "/" + c.strategy;
    mustRun(trainCommand(c.ranks) + args + " --set sharding.strategy=" + c.strategy + c.extra + " --set run.dir=" + runDir);
    expectSameBits(single, runDir, what);
  }
  // Stopped after step 4 on 4 ranks with zero1, resumed on 3 with zero3.
  const std::string cut = dir + "/cut";
  mustRun(trainCommand(4) + args + " --set sharding.strategy=zero1 --set run.stop_after_steps=4 --set run.dir=" + cut);
  mustRun(trainCommand(3) + args + " --set sharding.strategy=zero3 --set run.dir=" + cut);
  expectSameBits(single, cut, "4 ranks zero1 -> 3 ranks zero3");
}

TEST(DitE2ETest, DeterministicRunsHaveTheSameBitsOnEveryWorldSizeAndStrategy) {
  expectDeterministicEverywhere(ditScratch("deterministic"), "");
}

// The same with Muon: its momentum is sharded state like AdamW's moments (checkpointed,
// resharded on resume), and each matrix's update is computed whole by one rank, so the bits
// do not depend on which rank, how many ranks, or which strategy.
TEST(DitE2ETest, MuonRunsHaveTheSameBitsOnEveryWorldSizeAndStrategy) {
  expectDeterministicEverywhere(ditScratch("deterministic_muon"), " --set optim.name=muon --set optim.lr=0.01");
}

// Fewer micro-batches than ranks cannot be spread whole: refused at the start, naming keys.
TEST(DitE2ETest, DeterministicNeedsAMicroBatchForEveryRank) {
  const std::string dir = ditScratch("deterministic_bad");
  const std::string args = ditConfig(dir) + " --set run.deterministic=true";
  auto r = tessera::test::runCommand(trainCommand(4) + args + " --set data.micro_batch=12 --set run.dir=" + dir + "/run", 300);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("data.micro_batch"), std::string::npos) << r.output;
  r = tessera::test::runCommand(trainCommand(1) + args + " --set data.micro_batch=5 --set run.dir=" + dir + "/run", 300);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("data.global_batch"), std::string::npos) << r.output;
}

// A resume whose settings change the shape of a saved tensor is refused before any
// weights are read (the load is planned against the checkpoint's metadata): exit 2, naming
// the tensors and the keys that differ from the checkpoint's; never a fallback to an older
// checkpoint, and the run's checkpoints stay as they were.
TEST(DitE2ETest, ResumeWithAnotherShapeIsAConfigErrorNamingTheKey) {
  const std::string dir = ditScratch("reshape");
  const std::string config = ditConfig(dir);
  const std::string runDir = dir + "/run";
  mustRun(trainCommand(2) + config + " --set run.stop_after_steps=4 --set run.dir=" + runDir);
  struct Change {
    std::string set, key, tensor;
  };
  for (const Change& c : {Change{"model.patch_size=2", "model.patch_size 4 -> 2", "'model/x_embedder.proj.weight' saved with shape"},
                          Change{"model.mlp_ratio=4", "model.mlp_ratio 2.5 -> 4", "mlp.fc1.weight' saved with shape"},
                          Change{"data.image_size=16", "data.image_size 0 -> 16", "pos_embed' saved with shape"}}) {
    const auto r = tessera::test::runCommand(trainCommand(2) + config + " --set " + c.set + " --set run.dir=" + runDir, 300);
    EXPECT_EQ(r.status, 2) << c.set << "\n" << r.output;
    EXPECT_NE(r.output.find(c.key), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(c.tensor), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("start afresh in another run.dir"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("falling back"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("resumed from"), std::string::npos) << r.output;
  }
  EXPECT_TRUE(fs::exists(runDir + "/checkpoints/step_00000004"));
  const std::string resumed = mustRun(trainCommand(2) + config + " --set run.dir=" + runDir);
  EXPECT_NE(resumed.find("resumed from"), std::string::npos) << resumed;
}

TEST(DitE2ETest, SamplesFromAnExportOrACheckpointSplitOverRanksOrNot) {
  const std::string dir = ditScratch("sample");
  const std::string runDir = dir + "/run";
  mustRun(trainCommand(2) + ditConfig(dir) + " --set sharding.strategy=zero3 --set run.dir=" + runDir);
  const std::string weights = runDir + "/export/generator_ema.safetensors";
  const std::string request = " --classes 0,3 --per-class 3 --steps 6 --cfg 2.5 --seed 5";
  const std::string one = dir + "/one.safetensors", two = dir + "/two.safetensors", ckpt = dir + "/ckpt.safetensors";
  const std::string grid = dir + "/grid.png";
  const std::string out =
      mustRun(kBin + "/tessera-sample --weights " + weights + request + " --out " + grid + " --out-tensors " + one);
  EXPECT_NE(out.find("grid: " + fs::absolute(grid).string()), std::string::npos) << out;
  EXPECT_TRUE(fs::file_size(grid) > 0);
  mustRun(kBin + "/tessera-run --standalone --nproc-per-node 2 " + kBin + "/tessera-sample --weights " + weights +
          request + " --out-tensors " + two);
  mustRun(kBin + "/tessera-sample --checkpoint " + runDir + "/checkpoints --what generator_ema" + request +
          " --out-tensors " + ckpt);
  const auto a = tessera::checkpoint::loadSafetensors(one);
  ASSERT_EQ(a.at("samples").sizes(), (c10::IntArrayRef{6, 1, 8, 8}));
  EXPECT_TRUE(a.at("labels").equal(at::tensor({0, 0, 0, 3, 3, 3}, at::kLong)));
  EXPECT_TRUE(a.at("samples").isfinite().all().item<bool>());
  for (const std::string& other : {two, ckpt}) {
    const auto b = tessera::checkpoint::loadSafetensors(other);
    EXPECT_TRUE(at::allclose(a.at("samples"), b.at("samples"), 1e-5, 1e-5)) << other;
  }
  // The same seed and request with DDPM: reproducible, and not DDIM's.
  const std::string ddpm1 = dir + "/ddpm1.safetensors", ddpm2 = dir + "/ddpm2.safetensors";
  for (const std::string& file : {ddpm1, ddpm2}) {
    mustRun(kBin + "/tessera-sample --weights " + weights + request + " --sampler ddpm --out-tensors " + file);
  }
  const at::Tensor d1 = tessera::checkpoint::loadSafetensors(ddpm1).at("samples");
  EXPECT_TRUE(d1.equal(tessera::checkpoint::loadSafetensors(ddpm2).at("samples")));
  EXPECT_FALSE(at::allclose(d1, a.at("samples")));

  // An offline export of the checkpoint describes the model as the run's own export does.
  const std::string offline = dir + "/offline.safetensors", fromOffline = dir + "/offline_samples.safetensors";
  mustRun(kBin + "/tessera-export " + runDir + "/checkpoints --what generator_ema --out " + offline);
  mustRun(kBin + "/tessera-sample --weights " + offline + request + " --out-tensors " + fromOffline);
  EXPECT_TRUE(a.at("samples").equal(tessera::checkpoint::loadSafetensors(fromOffline).at("samples")));
}

// Exports written before the diffusion keys existed (no noise_schedule, zero_terminal_snr
// or prediction in their metadata) are linear-schedule noise predictors: they sample as
// they did, and the same weights declared velocity predictors sample otherwise.
TEST(DitE2ETest, ExportsWithoutTheDiffusionKeysSampleAsNoisePredictors) {
  const std::string dir = ditScratch("old_export");
  const std::string runDir = dir + "/run";
  mustRun(trainCommand(1) + ditConfig(dir) + " --set run.dir=" + runDir);
  const std::string current = runDir + "/export/generator_ema.safetensors";
  const auto tensors = tessera::checkpoint::loadSafetensors(current);
  auto metadata = tessera::checkpoint::SafetensorsReader(current).header().metadata;
  auto model = nlohmann::json::parse(metadata.at("tessera.model"));
  ASSERT_EQ(model.at("prediction"), "eps");
  const std::string old = dir + "/old.safetensors", velocity = dir + "/velocity.safetensors";
  for (const char* key : {"noise_schedule", "zero_terminal_snr", "prediction"}) model.erase(key);
  metadata["tessera.model"] = model.dump();
  tessera::checkpoint::saveSafetensors(old, tensors, metadata);
  model["prediction"] = "v";
  metadata["tessera.model"] = model.dump();
  tessera::checkpoint::saveSafetensors(velocity, tensors, metadata);
  const auto sample = [&](const std::string& weights) {
    const std::string out = weights + ".samples.safetensors";
    mustRun(kBin + "/tessera-sample --weights " + weights + " --per-class 2 --steps 5 --seed 3 --out-tensors " + out);
    return tessera::checkpoint::loadSafetensors(out).at("samples");
  };
  const at::Tensor now = sample(current);
  EXPECT_TRUE(now.equal(sample(old)));
  EXPECT_FALSE(at::allclose(now, sample(velocity)));
}

// A classifier trained by Tessera on the same images judges the DiT's samples: the accuracy
// of its predictions against the classes asked for, and the Frechet distance of its
// features to the held-out images' (with the scale: its own accuracy on real images, and
// what as many real images score). A DiT is no classifier: refused.
TEST(DitE2ETest, JudgeScoresSamplesWithAClassifierOfTheSameData) {
  const std::string dir = ditScratch("judge");
  const std::string config = ditConfig(dir);
  const std::string ditRun = dir + "/dit", classifierRun = dir + "/classifier";
  mustRun(trainCommand(1) + config + " --set run.dir=" + ditRun);
  mustRun(trainCommand(2) + config + " --set run.dir=" + classifierRun +
          " --set model.arch=mlp --set model.hidden=[32,16] --set run.steps=30 --set checkpoint.export=[model_ema]");
  const std::string classifier = classifierRun + "/export/model_ema.safetensors";
  // The second judge: a convnet on the same images (configs/fashion_convnet.yaml's kind).
  const std::string convnetRun = dir + "/convnet", convnet = convnetRun + "/export/model_ema.safetensors";
  mustRun(trainCommand(2) + config + " --set run.dir=" + convnetRun +
          " --set model.arch=convnet --set model.hidden=[4,8,16] --set run.steps=30 --set checkpoint.export=[model_ema]");
  const std::string out = mustRun(kBin + "/tessera-sample --weights " + ditRun +
                                  "/export/generator_ema.safetensors --per-class 3 --steps 5 --judge " + classifier +
                                  " --judge " + convnet);
  // Each judge's lines, the second named by its number and file, with figures of its own.
  const std::string second = "judge 2 (" + convnet + "): ";
  const auto secondAccuracyAt = out.find(second + "accuracy ");
  const auto secondFrechetAt = out.find(second + "Frechet distance ");
  ASSERT_NE(secondAccuracyAt, std::string::npos) << out;
  ASSERT_NE(secondFrechetAt, std::string::npos) << out;
  EXPECT_NE(out.find(second + "per class asked for"), std::string::npos) << out;
  const double secondAccuracy = std::stod(out.substr(secondAccuracyAt + second.size() + 9));
  EXPECT_GE(secondAccuracy, 0.0);
  EXPECT_LE(secondAccuracy, 1.0);
  const double secondFrechet = std::stod(out.substr(secondFrechetAt + second.size() + 17));
  const auto accuracyAt = out.find("judge: accuracy ");
  ASSERT_NE(accuracyAt, std::string::npos) << out;
  const double accuracy = std::stod(out.substr(accuracyAt + 16));
  EXPECT_GE(accuracy, 0.0);
  EXPECT_LE(accuracy, 1.0);
  EXPECT_NE(out.find("(12 samples classified as the class asked for; on real images the classifier scores "),
            std::string::npos)
      << out;
  const auto frechetAt = out.find("judge: Frechet distance ");
  ASSERT_NE(frechetAt, std::string::npos) << out;
  EXPECT_GE(std::stod(out.substr(frechetAt + 24)), 0.0);
  EXPECT_GE(secondFrechet, 0.0);
  EXPECT_NE(secondFrechet, std::stod(out.substr(frechetAt + 24))) << "the two judges' features are the same";
  EXPECT_NE(out.find("to the 24 held-out images of " + dir + "/data/images-idx3-ubyte (12 real images score "),
            std::string::npos)
      << out;
  // Each class's share: the 4 classes asked for, 3 samples each, whose accuracies average to
  // the overall one; beside each, the classifier's accuracy on the real images of that class
  // where the 24 held-out images have any.
  const std::string perClassHead = "judge: per class asked for, accuracy (the classifier on real ones): ";
  const auto perClassAt = out.find(perClassHead);
  ASSERT_NE(perClassAt, std::string::npos) << out;
  const auto perClassFrom = perClassAt + perClassHead.size();
  const std::string perClassLine = out.substr(perClassFrom, out.find('\n', perClassFrom) - perClassFrom);
  const std::regex entry(R"((\d+) (\d\.\d\d)(?: \((\d\.\d\d)\))?)");
  double sum = 0;
  int64_t label = 0;
  for (auto it = std::sregex_iterator(perClassLine.begin(), perClassLine.end(), entry); it != std::sregex_iterator();
       ++it, ++label) {
    EXPECT_EQ(std::stoll((*it)[1]), label) << perClassLine;
    const double share = std::stod((*it)[2]);
    EXPECT_TRUE(share == 0.0 || share == 0.33 || share == 0.67 || share == 1.0) << perClassLine;
    if ((*it)[3].matched) {
      EXPECT_LE(std::stod((*it)[3]), 1.0) << perClassLine;
    }
    sum += share;
  }
  EXPECT_EQ(label, 4) << perClassLine;
  EXPECT_NEAR(sum / 4, accuracy, 0.01) << out;

  const auto r = tessera::test::runCommand(kBin + "/tessera-sample --weights " + ditRun +
                                               "/export/generator_ema.safetensors --judge " + ditRun +
                                               "/export/generator_ema.safetensors",
                                           120);
  EXPECT_TRUE(r.refused()) << r.output;
  EXPECT_NE(r.output.find("not a classifier of images"), std::string::npos) << r.output;
  // Under tessera-run the judge loads on rank 0 only; the others learn of its failure at
  // once, before they draw their share of the samples.
  const auto ranked = tessera::test::runCommand(kBin + "/tessera-run --standalone --nproc-per-node 2 " + kBin +
                                                    "/tessera-sample --weights " + ditRun +
                                                    "/export/generator_ema.safetensors --judge " + ditRun +
                                                    "/export/generator_ema.safetensors",
                                                120);
  EXPECT_NE(ranked.status, 0) << ranked.output;
  EXPECT_NE(ranked.output.find("loading the judge failed on rank 0 (its log has the reason)"), std::string::npos)
      << ranked.output;

  // eval.judge: the training run judges its generator_ema at the end; a classifier that
  // cannot be used is a config error when the run starts.
  const std::string judged = mustRun(trainCommand(2) + config + " --set run.steps=2 --set run.dir=" + dir + "/judged" +
                                     " --set eval.judge_per_class=3 --set eval.sample_steps=4 --set eval.judge=" +
                                     classifier + " --set eval.sample_cfg_interval=[0,60]");
  EXPECT_NE(judged.find("judge: 12 samples of generator_ema (DDIM 4 steps, guidance 1.5 at t in [0, 60]): accuracy "),
            std::string::npos)
      << judged;
  const auto badInterval = tessera::test::runCommand(trainCommand(1) + config + " --set run.dir=" + dir +
                                                         "/bad_interval --set eval.sample_cfg_interval=[60,0]",
                                                     120);
  EXPECT_EQ(badInterval.status, 2) << badInterval.output;
  EXPECT_NE(badInterval.output.find("eval.sample_cfg_interval"), std::string::npos) << badInterval.output;
  EXPECT_NE(badInterval.output.find("[60,0] is not FIRST,LAST"), std::string::npos) << badInterval.output;
  const auto bad = tessera::test::runCommand(trainCommand(2) + config + " --set run.dir=" + dir + "/bad_judge" +
                                                 " --set eval.judge=" + ditRun + "/export/generator_ema.safetensors",
                                             120);
  EXPECT_EQ(bad.status, 2) << bad.output;
  EXPECT_NE(bad.output.find("eval.judge: "), std::string::npos) << bad.output;
  EXPECT_FALSE(fs::exists(dir + "/bad_judge/checkpoints/step_00000004")) << "trained before refusing";
}

// Post-hoc EMA picks its length by the judge: tessera-export sweeps sigma_rel over a run's
// power-function snapshots, samples and judges each, keeps the lowest Frechet distance as
// --out (the same file a single --posthoc-ema at that sigma_rel writes, with the model
// description tessera-sample needs), and writes the sweep as a table and a plot.
TEST(DitE2ETest, PosthocEmaSweepKeepsTheJudgesBest) {
  const std::string dir = ditScratch("posthoc_sweep");
  const std::string config = ditConfig(dir);
  const std::string ditRun = dir + "/dit", classifierRun = dir + "/classifier";
  mustRun(trainCommand(2) + config + " --set run.dir=" + ditRun +
          " --set ema.posthoc.stds=[0.05,0.1] --set ema.posthoc.snapshot_every=2 --set model.sample_timesteps=[99,49]");
  mustRun(trainCommand(1) + config + " --set run.dir=" + classifierRun +
          " --set model.arch=mlp --set model.hidden=[32,16] --set run.steps=30 --set checkpoint.export=[model_ema]");
  const std::string classifier = classifierRun + "/export/model_ema.safetensors";
  const std::string out = dir + "/best.safetensors";
  const std::string sweep = kBin + "/tessera-export " + ditRun + " --judge " + classifier +
                            " --per-class 3 --steps 4 --cfg 1.5 --cfg-interval 10,80 --seed 2 --out " + out;
  const std::string printed = mustRun(sweep + " --posthoc-ema 0.05,0.07,0.1");
  EXPECT_NE(printed.find("DDIM 4 steps, guidance 1.5 at t in [10, 80]; judged by"), std::string::npos) << printed;
  // Without --steps it samples at the model's own timesteps, as tessera-sample does.
  const std::string ownSteps = mustRun(kBin + "/tessera-export " + ditRun + " --judge " + classifier +
                                       " --per-class 2 --posthoc-ema 0.05,0.1 --out " + dir + "/own_steps.safetensors");
  EXPECT_NE(ownSteps.find("DDIM at the model's timesteps 99, 49, guidance 2"), std::string::npos) << ownSteps;
  std::ifstream tableFile(dir + "/best_sweep.tsv");
  std::string line;
  std::getline(tableFile, line);
  EXPECT_EQ(line, "sigma_rel\tfrechet\taccuracy\tsamples");
  std::vector<std::pair<double, double>> rows;  // sigma_rel, Frechet
  while (std::getline(tableFile, line)) {
    std::istringstream fields(line);
    double sigma = 0, frechet = 0, accuracy = 0;
    int64_t samples = 0;
    fields >> sigma >> frechet >> accuracy >> samples;
    EXPECT_EQ(samples, 12) << line;
    EXPECT_GE(accuracy, 0.0);
    rows.emplace_back(sigma, frechet);
  }
  ASSERT_EQ(rows.size(), 3u) << printed;
  const auto best = *std::min_element(rows.begin(), rows.end(), [](auto a, auto b) { return a.second < b.second; });
  std::ostringstream kept;
  kept << "kept sigma_rel " << best.first << ": " << out;
  EXPECT_NE(printed.find(kept.str()), std::string::npos) << printed;
  EXPECT_NE(printed.find("<- kept"), std::string::npos) << printed;
  // The plot: Frechet distance and accuracy each in a chart of its own (on one axis the two
  // were flat lines 50 units apart), one line each.
  std::ifstream plotFile(dir + "/best_sweep.svg");
  const std::string plot((std::istreambuf_iterator<char>(plotFile)), std::istreambuf_iterator<char>());
  EXPECT_NE(plot.find(">Frechet distance (lower is better)</text>"), std::string::npos) << plot;
  EXPECT_NE(plot.find(">accuracy (%)</text>"), std::string::npos) << plot;
  EXPECT_NE(plot.find("translate(0,420)"), std::string::npos) << plot;
  size_t lines = 0;
  for (size_t at = plot.find("<polyline"); at != std::string::npos; at = plot.find("<polyline", at + 1)) ++lines;
  EXPECT_EQ(lines, 2u) << plot;
  EXPECT_FALSE(fs::exists(dir + "/best.sweep_candidate.safetensors"));
  EXPECT_FALSE(fs::exists(dir + "/best.sweep_best.safetensors"));
  // The kept file is that sigma_rel's reconstruction, and it samples like a run's export.
  std::ostringstream sigma;
  sigma << best.first;
  const std::string single = dir + "/single.safetensors";
  mustRun(kBin + "/tessera-export " + ditRun + " --posthoc-ema " + sigma.str() + " --out " + single);
  const auto a = tessera::checkpoint::loadSafetensors(out), b = tessera::checkpoint::loadSafetensors(single);
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, tensor] : a) EXPECT_TRUE(tensor.equal(b.at(name))) << name;
  const std::string judged =
      mustRun(kBin + "/tessera-sample --weights " + out + " --per-class 3 --steps 4 --cfg 1.5 --seed 2 --judge " + classifier);
  EXPECT_NE(judged.find("judge: accuracy "), std::string::npos) << judged;
  // Mistakes: a judge that is no classifier (nothing written), a sigma_rel twice, sampling
  // options without --judge, a list without --judge; numbers and an --out that would fail
  // only after the first sigma_rel's work (a sigma_rel out of range later in the list, NaN
  // guidance, more steps than timesteps, a directory to rename the best over) refused first.
  fs::remove(out);
  fs::create_directories(dir + "/a_directory");
  for (const auto& [args, expected] :
       std::vector<std::pair<std::string, std::string>>{
           {" --posthoc-ema 0.05,0.1 --judge " + ditRun + "/export/generator_ema.safetensors --out " + out,
            "not a classifier of images"},
           {" --posthoc-ema 0.05,0.05 --judge " + classifier + " --out " + out, "given twice"},
           {" --posthoc-ema 0.05 --per-class 3 --out " + out, "--judge"},
           {" --posthoc-ema 0.05,0.1 --out " + out, "a list to sweep with --judge"},
           {" --posthoc-ema 0.05,0.1 --judge " + classifier + " --cfg-interval 10,100 --out " + out,
            "--cfg-interval: [10,100] is not FIRST,LAST with 0 <= FIRST <= LAST <= 99"},
           {" --posthoc-ema 0.05,0.5 --judge " + classifier + " --out " + out, "--posthoc-ema 0.5: sigma_rel must be in"},
           {" --posthoc-ema 0.05,0.1 --judge " + classifier + " --cfg nan --out " + out, "--cfg: nan is not a number"},
           {" --posthoc-ema 0.05,0.1 --judge " + classifier + " --steps 200 --out " + out,
            "--steps 200: more steps than"},
           {" --posthoc-ema 0.05,0.1 --judge " + classifier + " --out " + dir + "/a_directory",
            "is a directory, not a regular file"}}) {
    const auto r = tessera::test::runCommand(kBin + "/tessera-export " + ditRun + args, 120);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(expected), std::string::npos) << args << "\n" << r.output;
    EXPECT_FALSE(fs::exists(out)) << args;
    EXPECT_FALSE(fs::exists(dir + "/best.sweep_candidate.safetensors")) << args;
  }
  // A working file that is already there is the user's: refused, left as it was.
  std::ofstream(dir + "/best.sweep_best.safetensors") << "mine";
  const auto r = tessera::test::runCommand(sweep + " --posthoc-ema 0.05,0.1", 120);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("exists (the sweep's working file)"), std::string::npos) << r.output;
  std::ifstream mine(dir + "/best.sweep_best.safetensors");
  std::string content((std::istreambuf_iterator<char>(mine)), {});
  EXPECT_EQ(content, "mine");
  // The run directory after --posthoc-ema is the positional argument, not a second sigma_rel.
  mustRun(kBin + "/tessera-export --posthoc-ema 0.05 " + ditRun + " --out " + dir + "/positional.safetensors");

  // Under tessera-run the samples are split over the ranks: the same table (the samples
  // equal up to the batch split's rounding), the same sigma_rel kept, the same file; only
  // rank 0 prints and writes.
  const std::string launch = kBin + "/tessera-run --standalone --nproc-per-node 3 ";
  const std::string ranked = dir + "/ranked.safetensors";
  const std::string rankedPrinted = mustRun(launch + kBin + "/tessera-export " + ditRun + " --judge " + classifier +
                                            " --per-class 3 --steps 4 --cfg 1.5 --cfg-interval 10,80 --seed 2 --out " +
                                            ranked + " --posthoc-ema 0.05,0.07,0.1");
  EXPECT_NE(rankedPrinted.find("[rank 0]: kept sigma_rel " + sigma.str() + ": " + ranked), std::string::npos)
      << rankedPrinted;
  EXPECT_EQ(rankedPrinted.find("[rank 1]: kept"), std::string::npos) << rankedPrinted;
  std::ifstream rankedTable(dir + "/ranked_sweep.tsv");
  std::getline(rankedTable, line);
  for (const auto& [sigmaRel, frechet] : rows) {
    ASSERT_TRUE(std::getline(rankedTable, line));
    std::istringstream fields(line);
    double s = 0, f = 0;
    fields >> s >> f;
    EXPECT_EQ(s, sigmaRel) << line;
    EXPECT_NEAR(f, frechet, 1e-3 * frechet + 1e-6) << line;
  }
  const auto c = tessera::checkpoint::loadSafetensors(ranked);
  for (const auto& [name, tensor] : c) EXPECT_TRUE(tensor.equal(b.at(name))) << name;
  // Ranks other than 0 need none of the run's files (nodes without a shared file system):
  // started in an empty directory, every path relative to the test's, they are sent the
  // model and each reconstruction by rank 0, and the sweep keeps the same file.
  const std::string elsewhere = dir + "/elsewhere", wrapper = dir + "/rank_cwd.sh";
  fs::create_directories(elsewhere);
  std::ofstream(wrapper) << "#!/bin/sh\nif [ \"$RANK\" != 0 ]; then cd \"$1\" || exit 1; fi\nshift\nexec \"$@\"\n";
  fs::permissions(wrapper, fs::perms::owner_all);
  const std::string remote = mustRun("cd " + dir + " && " + launch + wrapper + " " + elsewhere + " " + kBin +
                                     "/tessera-export dit --judge classifier/export/model_ema.safetensors --per-class 3"
                                     " --steps 4 --cfg 1.5 --cfg-interval 10,80 --seed 2 --out remote.safetensors"
                                     " --posthoc-ema 0.05,0.07,0.1");
  EXPECT_NE(remote.find("[rank 0]: kept sigma_rel " + sigma.str() + ": remote.safetensors"), std::string::npos)
      << remote;
  const auto d = tessera::checkpoint::loadSafetensors(dir + "/remote.safetensors");
  ASSERT_EQ(d.size(), b.size());
  for (const auto& [name, tensor] : d) EXPECT_TRUE(tensor.equal(b.at(name))) << name;
  EXPECT_TRUE(fs::is_empty(elsewhere)) << "a rank wrote outside rank 0's directory";
  // A judge that fails on rank 0 stops every rank (no rank left waiting), nothing written.
  const auto failed = tessera::test::runCommand(launch + kBin + "/tessera-export " + ditRun + " --posthoc-ema 0.05,0.1 --judge " +
                                                    ditRun + "/export/generator_ema.safetensors --out " + dir + "/failed.safetensors",
                                                120);
  EXPECT_NE(failed.status, 0) << failed.output;
  EXPECT_NE(failed.output.find("not a classifier of images"), std::string::npos) << failed.output;
  EXPECT_NE(failed.output.find("loading the judge failed on rank 0 (its log has the reason)"), std::string::npos)
      << failed.output;
  EXPECT_FALSE(fs::exists(dir + "/failed.safetensors"));
  EXPECT_FALSE(fs::exists(dir + "/failed.sweep_candidate.safetensors"));
}

// run.recipe dmd over DiTs: a class-conditional few-step generator (DMD2's backward
// simulation over 3 timesteps) distilled from a DiT teacher with guidance (the real
// score's CFG) trains the same on 2 ranks (generator zero3, critic zero2, teacher zero3)
// as in one process, draws a grid per class from its EMA and the live generator, and its
// export samples at its own timesteps.
TEST(DitE2ETest, DmdDistilsAClassConditionalDitShardedAsInOneProcess) {
  const std::string dir = ditScratch("dmd");
  const std::string config = ditConfig(dir);
  const std::string teacher = dir + "/teacher";
  mustRun(trainCommand(1) + config + " --set run.dir=" + teacher);
  const std::string distill = dir + "/distill.yaml";
  std::ofstream(distill) << "recipe: {critic_steps: 2, guidance: 2.0, regression_weight: 1.0, regression_pairs: 12,"
                            " pair_steps: 4}\n"
                            "models:\n"
                            "  generator: {sample_timesteps: [99, 60, 25], sharding: {strategy: zero3},\n"
                            "              ema: {enabled: true, decays: [0.9]}}\n"
                            "  critic: {sharding: {strategy: zero2}, ema: {enabled: false}}\n"
                            "  teacher: {trainable: false, sharding: {strategy: zero3}}\n";
  // The teacher's config, turned into a distillation: the models: section from a second file.
  const std::string args = config + " --set run.recipe=dmd --set model.init_from=" + teacher +
                           "/export/generator_ema.safetensors --set eval.sample_per_class=2"
                           " --set checkpoint.export=[generator_ema] --set optim.lr=0.0002";
  std::ifstream base(dir + "/dit.yaml");
  std::stringstream merged;
  merged << base.rdbuf() << std::ifstream(distill).rdbuf();
  std::ofstream(dir + "/dmd.yaml") << merged.str();
  const std::string dmdArgs = " --config " + dir + "/dmd.yaml" + args.substr(args.find(" --set run.recipe"));
  const std::string single = dir + "/single", sharded = dir + "/sharded";
  mustRun(trainCommand(1) + dmdArgs + " --set run.dir=" + single);
  const std::string out = mustRun(trainCommand(2) + dmdArgs + " --set run.dir=" + sharded);
  expectSameLosses(single, sharded, "dmd over DiTs on 2 ranks");
  for (const char* grid : {"step_00000008_generator_ema.png", "step_00000008_generator.png"}) {
    EXPECT_TRUE(fs::exists(fs::path(sharded) / "samples" / grid)) << grid << "\n" << out;
  }
  expectCloseExports(single, sharded, "dmd generator_ema");
  // The export says its timesteps: tessera-sample takes them unless told the steps.
  const std::string exported = sharded + "/export/generator_ema.safetensors";
  int drawn = 0;
  const auto sample = [&](const std::string& how) {
    const std::string out = dir + "/samples" + std::to_string(++drawn) + ".safetensors";
    mustRun(kBin + "/tessera-sample --weights " + exported + " --per-class 1 --seed 4 --out-tensors " + out + how);
    return tessera::checkpoint::loadSafetensors(out).at("samples");
  };
  const at::Tensor own = sample(""), given = sample(" --timesteps 99,60,25"), evenly = sample(" --steps 3");
  EXPECT_TRUE(own.equal(given));
  EXPECT_FALSE(own.equal(evenly));  // 99, 50, 0
  // TensorBoard: the generator's and the critic's losses, the evaluation, and each grid as
  // an image of its size, every record accepted by the independent reader.
  const auto tb = tessera::test::readTensorBoard(sharded + "/tb");
  ASSERT_TRUE(tb.ok) << tb.output;
  for (const char* tag : {"train/loss", "train/critic_loss", "train/lr", "train/critic_lr", "train/grad_norm",
                          "perf/images_per_sec", "perf/mfu", "perf/tflops_per_rank", "comm/comm_wait_ms",
                          "memory/mem_total_mib",
                          "eval/eval_loss", "samples/generator_ema", "samples/generator"}) {
    EXPECT_TRUE(tb.tags().count(tag)) << tag << "\n" << tb.output;
  }
  for (const auto& v : tb.values) {
    if (!v.contains("image")) continue;
    EXPECT_EQ(v["step"], 8);
    EXPECT_GT(v["image"]["height"].get<int>(), 0);
    EXPECT_GT(v["image"]["png_bytes"].get<int>(), 0);
  }
}

// A velocity teacher on a schedule that ends in pure noise: the one-step generator starts at
// the last timestep (abar = 0, its estimate -v there, finite), sharded as in one process;
// its export says how to read it. A frozen teacher read as a noise predictor is refused.
TEST(DitE2ETest, DmdFromPureNoiseWithAVelocityTeacher) {
  const std::string dir = ditScratch("dmd_v");
  const std::string velocity =
      " --set model.prediction=v --set model.zero_terminal_snr=true --set model.noise_schedule=cosine";
  const std::string config = ditConfig(dir) + velocity;
  const std::string teacher = dir + "/teacher";
  mustRun(trainCommand(1) + config + " --set run.dir=" + teacher);
  const std::string teacherExport = teacher + "/export/generator_ema.safetensors";
  std::ofstream(dir + "/models.yaml") << "recipe: {critic_steps: 1, guidance: 2.0, guidance_interval: [0, 60],"
                                         " regression_weight: 1.0, regression_pairs: 8, pair_steps: 4}\n"
                                         "models:\n"
                                         "  generator: {sharding: {strategy: zero3}, ema: {enabled: true, decays: [0.9]}}\n"
                                         "  critic: {sharding: {strategy: zero2}, ema: {enabled: false}}\n"
                                         "  teacher: {trainable: false, sharding: {strategy: zero3}}\n";
  std::ifstream base(dir + "/dit.yaml");
  std::stringstream merged;
  merged << base.rdbuf() << std::ifstream(dir + "/models.yaml").rdbuf();
  std::ofstream(dir + "/dmd.yaml") << merged.str();
  const std::string args = " --config " + dir + "/dmd.yaml --set run.recipe=dmd --set model.init_from=" +
                           teacherExport + " --set eval.sample_per_class=2 --set checkpoint.export=[generator_ema]"
                           " --set optim.lr=0.0002 --set run.steps=4";
  const std::string single = dir + "/single", sharded = dir + "/sharded";
  mustRun(trainCommand(1) + args + velocity + " --set run.dir=" + single);
  mustRun(trainCommand(2) + args + velocity + " --set run.dir=" + sharded);
  expectSameLosses(single, sharded, "dmd from pure noise on 2 ranks");
  expectCloseExports(single, sharded, "dmd generator_ema (velocity)");
  const std::string exported = sharded + "/export/generator_ema.safetensors";
  const std::string out = dir + "/samples.safetensors";
  mustRun(kBin + "/tessera-sample --weights " + exported + " --per-class 2 --seed 4 --out-tensors " + out);
  EXPECT_TRUE(tessera::checkpoint::loadSafetensors(out).at("samples").isfinite().all().item<bool>());
  const std::string described = mustRun(std::string(TESSERA_PYTHON3) + " " + TESSERA_SOURCE_DIR +
                                        "/python/tessera_models.py describe --weights " + exported);
  EXPECT_NE(described.find("prediction v"), std::string::npos) << described;
  const auto metadata = nlohmann::json::parse(
      tessera::checkpoint::SafetensorsReader(exported).header().metadata.at("tessera.model"));
  EXPECT_EQ(metadata.at("sample_timesteps"), nlohmann::json::array({99})) << metadata.dump();  // pure noise
  EXPECT_EQ(metadata.at("zero_terminal_snr"), true) << metadata.dump();
  // The same teacher read as a noise predictor: refused, naming the keys.
  const tessera::test::CommandResult refused =
      tessera::test::runCommand(trainCommand(1) + args + " --set run.dir=" + dir + "/eps", 120);
  EXPECT_EQ(refused.status, 2) << refused.output;
  EXPECT_NE(refused.output.find("models.teacher.init_from"), std::string::npos) << refused.output;
  EXPECT_NE(refused.output.find("prediction: v in the file, eps here"), std::string::npos) << refused.output;
}

TEST(DitE2ETest, BadSampleRequestsAreRefusedNamingWhatIsWrong) {
  const std::string dir = ditScratch("refused");
  const std::string runDir = dir + "/run";
  mustRun(trainCommand(1) + ditConfig(dir) + " --set run.steps=2 --set run.dir=" + runDir);
  const std::string weights = runDir + "/export/generator_ema.safetensors";
  const std::string noLabels = dir + "/plain.safetensors";
  tessera::checkpoint::saveSafetensors(noLabels, {{"x", at::zeros({2})}});  // no tessera.model metadata
  const std::string sample = kBin + "/tessera-sample ";
  // Starting noise that is not noise, and an index whose shard an output would overwrite.
  const std::string nanNoise = dir + "/nan_noise.safetensors", hugeNoise = dir + "/huge_noise.safetensors";
  tessera::checkpoint::saveSafetensors(nanNoise, {{"noise", at::full({2, 4}, std::nan(""))}});
  tessera::checkpoint::saveSafetensors(hugeNoise, {{"noise", at::full({2, 4}, 1e30)}});
  const std::string index = dir + "/split.safetensors.index.json", shard = dir + "/split-00001-of-00002.safetensors";
  std::ofstream(index) << R"({"metadata": {}, "weight_map": {"a": "split-00001-of-00002.safetensors"}})";
  std::ofstream(shard) << "the shard";
  // The export's own metadata made to lie about sizes: refused before a model is built.
  auto lying = [&](const std::string& tag, const std::function<void(nlohmann::json&)>& change) {
    const tessera::checkpoint::SafetensorsReader reader(weights);
    auto metadata = reader.header().metadata;
    nlohmann::json model = nlohmann::json::parse(metadata.at("tessera.model"));
    change(model);
    metadata["tessera.model"] = model.dump();
    const std::string path = dir + "/" + tag + ".safetensors";
    tessera::checkpoint::saveSafetensors(path, tessera::checkpoint::loadSafetensors(weights), metadata);
    return path;
  };
  const std::string deep = lying("deep", [](nlohmann::json& m) { m["layers"] = 65536; });
  const std::string wide = lying("wide", [](nlohmann::json& m) { m["embed_dim"] = 1 << 20; m["heads"] = 4; });
  const std::string vast = lying("vast", [](nlohmann::json& m) { m["data"]["input_shape"] = {4, 1 << 20, 1 << 20}; });
  const std::string fine = lying("fine", [](nlohmann::json& m) { m["patch_size"] = 1; m["data"]["input_shape"] = {1, 4096, 4096}; });
  struct Case {
    std::string args, expected;
  };
  for (const Case& c : {
           Case{"--weights " + deep + " --out " + dir + "/g.png", "says layers 65536, but the file holds only"},
           Case{"--weights " + wide + " --out " + dir + "/g.png", "embed_dim 1048576, wider than any tensor"},
           Case{"--weights " + vast + " --out " + dir + "/g.png", "data.input_shape"},
           Case{"--weights " + fine + " --out " + dir + "/g.png", "more than the"},
           Case{"--weights " + weights + " --classes 0,7 --out " + dir + "/g.png", "'7' is not a class"},
           Case{"--weights " + weights + " --classes x --out " + dir + "/g.png", "'x' is not a class"},
           Case{"--weights " + weights + " --out " + weights, "must end in .png"},
           Case{"--weights " + weights + " --out-tensors " + weights, "would be overwritten"},
           Case{"--weights " + weights, "nothing to do"},
           Case{"--weights " + weights + " --out " + dir + "/missing/g.png", "no directory"},
           Case{"--weights " + noLabels + " --out " + dir + "/g.png", "no 'tessera.model' metadata"},
           Case{"--weights " + dir + "/absent.safetensors --out " + dir + "/g.png", "absent.safetensors"},
           Case{"--weights " + weights + " --noise " + noLabels + " --out " + dir + "/g.png", "no tensor 'noise'"},
           Case{"--weights " + weights + " --steps 0 --out " + dir + "/g.png", "--steps"},
           Case{"--weights " + weights + " --steps 101 --out " + dir + "/g.png", "101 steps for 100 timesteps"},
           Case{"--checkpoint " + dir + " --out " + dir + "/g.png", "neither a complete checkpoint"},
           Case{"--weights " + weights + " --timesteps 100 --out " + dir + "/g.png", "timestep 100 is outside"},
           Case{"--weights " + weights + " --timesteps 10,20 --out " + dir + "/g.png", "must decrease (10 then 20)"},
           Case{"--weights " + weights + " --timesteps 50,x --out " + dir + "/g.png", "--timesteps"},
           Case{"--weights " + weights + " --timesteps 50 --steps 4 --out " + dir + "/g.png", "excludes"},
           Case{"--weights " + weights + " --timesteps 50 --sampler ddpm --out " + dir + "/g.png", "are DDIM's"},
           Case{"--weights " + weights + " --noise " + nanNoise + " --out " + dir + "/g.png", "NaN or Inf"},
           Case{"--weights " + weights + " --noise " + hugeNoise + " --out " + dir + "/g.png", "not standard normal"},
           Case{"--weights " + weights + " --cfg nan --out " + dir + "/g.png", "--cfg"},
           Case{"--weights " + weights + " --cfg-interval 50,10 --out " + dir + "/g.png",
                "--cfg-interval: [50,10] is not FIRST,LAST with 0 <= FIRST <= LAST <= 99"},
           Case{"--weights " + weights + " --cfg-interval 0,100 --out " + dir + "/g.png", "--cfg-interval"},
           Case{"--weights " + weights + " --cfg-interval 5 --out " + dir + "/g.png", "--cfg-interval"},
           Case{"--weights " + weights + " --timesteps= --out " + dir + "/g.png", "--timesteps"},
           Case{"--weights " + weights + " --steps 5000 --out " + dir + "/g.png", "5000 steps for 100 timesteps"},
           Case{"--weights " + index + " --out-tensors " + shard, "would be overwritten"},
       }) {
    const auto r = tessera::test::runCommand(sample + c.args, 120);
    EXPECT_TRUE(r.refused()) << c.args << " -> status " << r.status << "\n" << r.output;
    // A bad argument (not a bad file) is a usage error: exit 2.
    const bool argument = c.args.find("--cfg") != std::string::npos || c.args.find("--steps") != std::string::npos ||
                          c.args.find("--timesteps") != std::string::npos || c.args.find("--noise") != std::string::npos;
    if (argument) {
      EXPECT_EQ(r.status, 2) << c.args << "\n" << r.output;
    }
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << c.args << "\n" << r.output;
  }
  EXPECT_FALSE(fs::exists(dir + "/g.png"));
  std::ifstream kept(shard);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(kept), {}), "the shard");
}

}  // namespace
