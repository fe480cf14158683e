// Training from WebDataset shards end to end: tessera-shards writes the tests' IDX images
// as tar shards; a DiT trained from them (a global batch that ends epochs mid-step) has the
// one-process losses at 3 ranks, and a run stopped at step 4 on 2 ranks with zero3 and
// resumed on 3 with zero2 ends equal to the uninterrupted run; a truncated shard is named
// (exit 1) unless data.on_error skip leaves it out; a resume onto another shard set says so;
// tessera-shards refuses to write over shards and bad arguments.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "tests/apps/train_runs.h"
#include "tests/support/idx_images.h"
#include "tests/support/run_command.h"
#include "tests/support/run_files.h"
#include "tests/support/scratch_path.h"

namespace {

namespace fs = std::filesystem;
using tessera::test::expectCloseExports;
using tessera::test::expectSameLosses;
using tessera::test::mustRun;
using tessera::test::readMetrics;
using tessera::test::trainCommand;
using tessera::test::runCommand;

using tessera::test::kBin;

std::string wdsScratch(const std::string& tag) { return tessera::test::scratchPath("tessera_wds_e2e", tag); }

// The tests' 96 IDX images as shards of 10 under dir/shards (train/ and eval/).
std::string writeShards(const std::string& dir) {
  const auto [images, labels] = tessera::test::writeIdxImages(dir + "/idx");
  const std::string out = dir + "/shards";
  const std::string output = mustRun(kBin + "/tessera-shards --kind idx --path " + images + " --labels " + labels +
                                     " --eval-path " + images + " --eval-labels " + labels + " --out " + out +
                                     " --samples-per-shard 10");
  EXPECT_NE(output.find(out + "/train: 10 shards, 96 samples"), std::string::npos) << output;
  return out;
}

// A small DiT on the shards (data.path a brace list): global batch 36, so the 96 samples end
// an epoch inside step 3; a shuffle buffer of 16 over shards of 10.
std::string ditConfig(const std::string& dir, const std::string& shards) {
  const std::string path = dir + "/dit.yaml";
  std::ofstream(path) << "run: {name: wds, seed: 5, steps: 8, log_every: 4, eval_every: 8}\n"
                         "log: {per_rank_files: false}\n"
                         "model: {arch: dit, embed_dim: 20, layers: 2, heads: 2, patch_size: 4, mlp_ratio: 2.5,\n"
                         "        timesteps: 100, class_dropout: 0.25}\n"
                         "data: {kind: webdataset, path: '"
                      << shards << "/train/train-{000000..000009}.tar', eval_path: " << shards
                      << "/eval,\n"
                         "       shuffle_buffer: 16, global_batch: 36, micro_batch: 6, hflip: true}\n"
                         "optim: {name: adamw, lr: 0.002, weight_decay: 0.01, schedule: {kind: constant}}\n"
                         "ema: {enabled: true, decays: [0.9]}\n"
                         "checkpoint: {every_steps: 4, async: false, export: [generator_ema]}\n";
  return " --config " + path;
}

TEST(WebDatasetE2ETest, TrainsTheSameOnAnyWorldSizeAndResumesOnAnother) {
  const std::string dir = wdsScratch("runs");
  const std::string args = ditConfig(dir, writeShards(dir));
  const std::string single = dir + "/single", three = dir + "/three", cut = dir + "/cut";
  const std::string log = mustRun(trainCommand(1) + args + " --set sharding.strategy=no_shard --set run.dir=" + single);
  EXPECT_NE(log.find("10 shards (96 samples)"), std::string::npos) << log;
  ASSERT_TRUE(readMetrics(single).back().contains("eval_loss_ema"));
  mustRun(trainCommand(3) + args + " --set sharding.strategy=zero2 --set run.dir=" + three);
  expectSameLosses(single, three, "3 ranks zero2");
  expectCloseExports(single, three, "3 ranks zero2");
  mustRun(trainCommand(2) + args + " --set sharding.strategy=zero3 --set run.stop_after_steps=4 --set run.dir=" + cut);
  const std::string out = mustRun(trainCommand(3) + args + " --set sharding.strategy=zero2 --set run.dir=" + cut);
  EXPECT_NE(out.find("saved by 2 ranks with zero3; now 3 ranks with zero2"), std::string::npos) << out;
  expectSameLosses(single, cut, "stopped at 4 on 2 ranks zero3, resumed on 3 ranks zero2");
  expectCloseExports(single, cut, "stopped at 4 on 2 ranks zero3, resumed on 3 ranks zero2");
}

TEST(WebDatasetE2ETest, ATruncatedShardIsNamedUnlessSkipLeavesItOut) {
  const std::string dir = wdsScratch("truncated");
  const std::string shards = writeShards(dir);
  const std::string args = ditConfig(dir, shards) + " --set run.steps=2";
  const std::string victim = shards + "/train/train-000004.tar";
  fs::resize_file(victim, 3000);
  auto r = runCommand(trainCommand(1) + args + " --set run.dir=" + dir + "/fail", 300);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("shard '" + victim + "' is 3000 bytes"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("truncated at byte 3000"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("data.path"), std::string::npos) << r.output;
  r = runCommand(trainCommand(2) + args + " --set data.on_error=skip --set run.dir=" + dir + "/skip", 300);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("10 shards (86 samples)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("data.on_error skip: shard '" + victim + "'"), std::string::npos) << r.output;
  // A shard list that names a missing shard is the config's mistake (exit 2), at its key.
  r = runCommand(trainCommand(1) + args + " --set data.path=" + shards + "/train/train-{000000..000010}.tar --set run.dir=" +
                     dir + "/missing",
                 300);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("train-000010.tar': no such file"), std::string::npos) << r.output;
  // An idx config switched to shards with its label file still set: the key and the fix.
  r = runCommand(trainCommand(1) + args + " --set data.labels=" + dir + "/idx/labels-idx1-ubyte --set run.dir=" + dir +
                 "/labels");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("data.labels: applies to data.kind idx, not webdataset (clear it: --set data.labels=)"),
            std::string::npos)
      << r.output;
}

// The shard set is part of the data position: a resume onto other shards (one left out
// here) goes on, saying that the samples from there are not the uninterrupted run's.
TEST(WebDatasetE2ETest, AResumeOntoAnotherShardSetSaysSo) {
  const std::string dir = wdsScratch("changed");
  const std::string shards = writeShards(dir);
  const std::string args = ditConfig(dir, shards) + " --set run.dir=" + dir + "/run --set checkpoint.every_steps=2";
  mustRun(trainCommand(1) + args + " --set run.steps=4 --set run.stop_after_steps=2");
  const std::string same = mustRun(trainCommand(1) + args + " --set run.steps=4");
  EXPECT_EQ(same.find("the data differs"), std::string::npos) << same;
  const std::string out = mustRun(trainCommand(1) + args + " --set run.steps=6 --set data.path=" + shards +
                                  "/train/train-{000000..000008}.tar");
  EXPECT_NE(out.find("the data differs from what it was trained on (10 shards, 96 samples, names and counts XXH3 "),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("9 shards, 90 samples"), std::string::npos) << out;

  // A shard replaced between stop and resume by another of the same name and sample count
  // (shards without a manifest, whose checksums would say so first): noticed on resume.
  const std::string bare = wdsScratch("replaced");
  const std::string bareShards = writeShards(bare);
  fs::remove(bareShards + "/train/manifest.json");
  const std::string bareArgs = ditConfig(bare, bareShards) + " --set run.dir=" + bare + "/run --set checkpoint.every_steps=2";
  mustRun(trainCommand(1) + bareArgs + " --set run.steps=4 --set run.stop_after_steps=2");
  fs::copy_file(bareShards + "/train/train-000001.tar", bareShards + "/train/train-000000.tar",
                fs::copy_options::overwrite_existing);
  const std::string replaced = mustRun(trainCommand(1) + bareArgs + " --set run.steps=4");
  EXPECT_NE(replaced.find("the data differs from what it was trained on"), std::string::npos) << replaced;
}

TEST(WebDatasetE2ETest, TheShardToolRefusesToWriteOverShardsAndBadArguments) {
  const std::string dir = wdsScratch("tool");
  const std::string shards = writeShards(dir);
  const std::string images = dir + "/idx/images-idx3-ubyte", labels = dir + "/idx/labels-idx1-ubyte";
  auto r = runCommand(kBin + "/tessera-shards --kind idx --path " + images + " --labels " + labels + " --out " + shards);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("already holds shards"), std::string::npos) << r.output;
  r = runCommand(kBin + "/tessera-shards --kind idx --path " + images + " --out " + dir + "/other");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--labels"), std::string::npos) << r.output;
  r = runCommand(kBin + "/tessera-shards --kind tensors --path x --out " + dir + "/other");
  EXPECT_EQ(r.status, 2) << r.output;
  r = runCommand(kBin + "/tessera-shards --kind idx --path " + dir + "/nothing --labels " + labels + " --out " + dir +
                 "/other");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find(dir + "/nothing"), std::string::npos) << r.output;
}

}  // namespace
