// tessera-train's command line: every kind of bad config or argument exits with
// status 2 and a message naming the key and the YAML line:column.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "tests/support/run_command.h"
#include "tests/support/scratch_path.h"

namespace {

namespace fs = std::filesystem;

using tessera::test::runCommand;

std::string writeConfig(const std::string& text) {
  static int written = 0;  // a test may write several
  const fs::path path = tessera::test::scratchPath("tessera_cli", "config" + std::to_string(++written) + ".yaml");
  std::ofstream(path) << text;
  return path.string();
}

using tessera::test::kTrain;
const std::string kGood = "data:\n  path: /usr/share/common-licenses/GPL-3\n";

void expectConfigError(const std::string& yaml, const std::string& extraArgs, const std::string& expected) {
  const std::string file = writeConfig(yaml);
  tessera::test::CommandResult r = runCommand(kTrain + " --config " + file + " " + extraArgs);
  EXPECT_EQ(r.status, 2) << r.output;
  // ".yaml:L:C: ..." stands for "<the config file>:L:C: ...".
  const std::string want = expected.rfind(".yaml:", 0) == 0 ? file + expected.substr(5) : expected;
  EXPECT_NE(r.output.find(want), std::string::npos) << "expected '" << want << "' in:\n" << r.output;
}

TEST(TrainCliTest, UnknownKeyWithSuggestion) {
  expectConfigError(kGood + "optim:\n  lrr: 0.1\n", "",
                    ".yaml:4:3: optim.lrr: unknown key (did you mean 'optim.lr'?)");
}

// Without a usable GPU (CPU CI), run.device: cuda is a config error naming the key.
TEST(TrainCliTest, CudaDeviceWithoutAGpu) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a GPU is usable here";
  expectConfigError(kGood + "run:\n  device: cuda\n", "--set run.steps=2",
                    ".yaml:4:11: run.device: cuda, but no CUDA device is usable here");
}

// Checks made once the run starts (a data file that is not there) and checks across keys
// name where each key involved was written: its line, or the --set that set it.
TEST(TrainCliTest, LateAndCrossKeyChecksNameWhereEachKeyWasSet) {
  expectConfigError(kGood, "--set data.path=/nonexistent/tokens.bin",
                    "--set data.path=/nonexistent/tokens.bin: data.path: no file at '/nonexistent/tokens.bin'");
  expectConfigError(kGood + "profile:\n  steps: 3\n", "--set run.steps=5 --set profile.start_step=4",
                    "--set profile.start_step=4: profile.start_step: 4 + profile.steps (3) - 1 is past run.steps (5) "
                    "(profile.steps: ");
  expectConfigError(kGood + "profile:\n  steps: 3\n", "--set run.steps=5 --set profile.start_step=4",
                    ".yaml:4:10; run.steps: --set run.steps=5)");
}

TEST(TrainCliTest, WrongType) {
  expectConfigError(kGood + "optim:\n  lr: fast\n", "", ".yaml:4:7: optim.lr: expected a number, got 'fast'");
}

TEST(TrainCliTest, OutOfRange) {
  expectConfigError(kGood + "run:\n  steps: -1\n", "", ".yaml:4:10: run.steps: value -1 is out of range");
  expectConfigError(kGood + "optim:\n  betas: [0.9, 1.5]\n", "",
                    ".yaml:4:16: optim.betas[1]: value 1.5 is out of range: must be < 1");
}

TEST(TrainCliTest, MissingRequiredKey) {
  expectConfigError("run:\n  steps: 3\n", "", "data.path: missing required key");
}

TEST(TrainCliTest, MalformedYaml) {
  expectConfigError(kGood + "run: {steps: 3\n", "", ".yaml:");
  expectConfigError(kGood + "run: {steps: 3\n", "", "malformed YAML");
}

TEST(TrainCliTest, UnreadableFile) {
  tessera::test::CommandResult r = runCommand(kTrain + " --config /nonexistent/run.yaml");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("/nonexistent/run.yaml: cannot read config file"), std::string::npos) << r.output;
}

TEST(TrainCliTest, BadOverrides) {
  expectConfigError(kGood, "--set optim.lrate=1", "--set optim.lrate=1: optim.lrate: unknown key (did you mean 'optim.lr'?)");
  expectConfigError(kGood, "--set run.steps=many", "--set run.steps=many: run.steps: expected an integer, got 'many'");
}

TEST(TrainCliTest, BadArguments) {
  tessera::test::CommandResult r = runCommand(kTrain + " --no-such-flag");
  EXPECT_EQ(r.status, 2) << r.output;
  r = runCommand(kTrain);  // --config is required
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--config"), std::string::npos) << r.output;
}

TEST(TrainCliTest, PrintConfigShowsOverrides) {
  const std::string file = writeConfig(kGood);
  tessera::test::CommandResult r = runCommand(kTrain + " --config " + file + " --set run.steps=7 --set model.hidden=[8,4] --print-config");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("steps: 7"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("hidden: [8, 4]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("path: /usr/share/common-licenses/GPL-3"), std::string::npos) << r.output;
}

}  // namespace
