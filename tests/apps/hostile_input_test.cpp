// Damaged and crafted input, as a careless user or someone handing over a file would
// produce it: every program refuses it with exit status 1 or 2 (never a signal), within
// seconds (never a hang), naming the file or key — and writes nothing outside the run.
// One test per class of damage (issue "Hostile and damaged input"); each builds the damaged
// input from a real run's files.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <map>
#include <sstream>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/format.h"
#include "checkpoint/metadata.h"
#include "checkpoint/safetensors.h"
#include "common/errors.h"
#include "datasets/shard_manifest.h"
#include "datasets/tar_file.h"
#include "imaging/image_io.h"
#include "kernels/cpu_matmul.h"
#include "tests/support/idx_images.h"
#include "tests/support/run_command.h"
#include "tests/support/run_files.h"
#include "tests/support/scratch_path.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using tessera::test::CommandResult;
using tessera::test::runCommand;
using tessera::test::shellQuote;

using tessera::test::kBin;
using tessera::test::kTrain;
const std::string kConfig = std::string(TESSERA_SOURCE_DIR) + "/configs/default.yaml";
// One process, two steps, a synchronous checkpoint at the end and the default exports.
const std::string kShortRun = " --set run.steps=2 --set run.log_every=1 --set checkpoint.async=false"
                              " --set log.per_rank_files=false --set optim.schedule.kind=constant";
// A refusal comes in seconds; a hang runs into runCommand's timeout.
constexpr double kPromptSeconds = 30;
constexpr int kTimeoutSeconds = 60;

using tessera::test::readText;

void writeText(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

json readJson(const fs::path& path) { return json::parse(readText(path)); }
void writeJson(const fs::path& path, const json& j) { writeText(path, j.dump(1)); }
// An edited metadata.json, resealed as a forger would: its metadata_checksum holds.
void writeMetadata(const fs::path& path, const json& j) {
  writeText(path, tessera::checkpoint::resealMetadata(j.dump()));
}

void makeFifo(const fs::path& path) { ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << path; }

bool isFifo(const fs::path& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISFIFO(st.st_mode);
}

// `command` must be refused: exit status `status` (1 or 2; 0 = either), promptly, with
// each of `names` in its output. Returns the output.
std::string expectRefused(const std::string& command, std::initializer_list<std::string> names, int status = 0) {
  const CommandResult r = runCommand(command, kTimeoutSeconds);
  if (status == 0) {
    EXPECT_TRUE(r.refused()) << "status " << r.status << " (124: hung; >128: a signal) for\n  " << command << "\n"
                             << r.output;
  } else {
    EXPECT_EQ(r.status, status) << command << "\n" << r.output;
  }
  EXPECT_LT(r.seconds, kPromptSeconds) << command;
  for (const auto& name : names) {
    EXPECT_NE(r.output.find(name), std::string::npos) << "expected '" << name << "' in the output of\n  " << command
                                                      << "\n" << r.output;
  }
  return r.output;
}

// `command` must succeed; returns its output.
std::string expectSuccess(const std::string& command) {
  const CommandResult r = runCommand(command, 300);
  EXPECT_EQ(r.status, 0) << command << "\n" << r.output;
  return r.output;
}

class HostileInputTest : public ::testing::Test {
 protected:
  // A scratch path for this test, removed when it passes.
  std::string scratch(const std::string& tag) { return tessera::test::scratchPath("tessera_hostile", tag); }

  // A config file holding `yaml`.
  std::string config(const std::string& yaml) {
    const std::string path = scratch("config" + std::to_string(++configs_) + ".yaml");
    writeText(path, yaml);
    return path;
  }

  // Trains the short run into a fresh run directory; returns the run directory (the
  // checkpoint is <run>/checkpoints/step_00000002, the exports under <run>/export/).
  std::string trainedRun(const std::string& extra = "") {
    const std::string dir = scratch("run" + std::to_string(++runs_));
    expectSuccess(kTrain + " --config " + kConfig + kShortRun + " --set run.dir=" + dir + extra);
    return dir;
  }

  static std::string stepDir(const std::string& run) { return run + "/checkpoints/step_00000002"; }

  int configs_ = 0;
  int runs_ = 0;
};

// Writes `text` as the checkpoint's trainer_state.json and records its size and checksum
// in metadata.json, as a forger would: the checksums hold, only the values are wrong.
void forgeTrainerState(const std::string& step, const std::string& text) {
  writeText(step + "/trainer_state.json", text);
  json md = readJson(step + "/metadata.json");
  md["trainer_state"]["bytes"] = text.size();
  md["trainer_state"]["checksum"] =
      tessera::checkpoint::checksumHex(tessera::checkpoint::checksum(text.data(), text.size()));
  writeMetadata(step + "/metadata.json", md);
}

// Class 1: sizes whose products would wrap are refused with the key named.
TEST_F(HostileInputTest, ConfigSizesThatWouldOverflowNameTheKey) {
  const std::string base = kTrain + " --config " + kConfig + " --set run.dir=" + scratch("run");
  expectRefused(base + " --set data.micro_batch=4611686018427387904", {"data.micro_batch", "out of range"}, 2);
  expectRefused(base + " --set data.global_batch=9223372036854775807", {"data.global_batch", "out of range"}, 2);
  expectRefused(base + " --set sharding.bucket_mb=1e300", {"sharding.bucket_mb", "out of range"}, 2);
  expectRefused(base + " --set sharding.bucket_mb=1e-300", {"sharding.bucket_mb", "less than one byte"}, 2);
  expectRefused(base + " --set run.steps=1099511627776 --set data.global_batch=1048576 --set data.micro_batch=1",
                {"run.steps", "samples a run can count"}, 2);
  expectRefused(base + " --set model.vocab_size=4294967296", {"model.vocab_size", "out of range"}, 2);
  // Within the bounds but more than memory: the allocation fails with the model's keys
  // named and no C++ backtrace (ulimit: the same on a machine that overcommits).
  const std::string out = expectRefused("ulimit -v 16000000; " + base + " --set model.vocab_size=2147483648",
                                        {"model (arch mlp, vocab_size 2147483648", "cannot be built"}, 2);
  EXPECT_EQ(out.find("frame #"), std::string::npos) << out;
  // tessera-run: nnodes x nproc-per-node wrapped to a negative RANK.
  expectRefused(kBin + "/tessera-run --nnodes 2147483647 --node-rank 2147483646 --nproc-per-node 2 /bin/true",
                {"--nnodes 2147483647 x --nproc-per-node 2"}, 2);
  expectRefused(kBin + "/tessera-run --standalone --nproc-per-node 100000 /bin/true", {"--nproc-per-node 100000"}, 2);
}

// Class 2: every counter read back from trainer_state.json is range- and type-checked.
TEST_F(HostileInputTest, TrainerStateIsCheckedWithFileAndKeyNamed) {
  const std::string run = trainedRun();
  const std::string step = stepDir(run);
  const json good = readJson(step + "/trainer_state.json");
  const std::string resume = kTrain + " --config " + kConfig + kShortRun + " --set run.steps=4 --set run.dir=" + run +
                             " --resume " + step;
  for (const auto& [key, value] : std::initializer_list<std::pair<std::string, json>>{
           {"step", -521}, {"step", 1.5}, {"ema_updates", -1}, {"ema_updates", 3}, {"skipped_steps", 3},
           {"world_size", 1e12}, {"world_size", 0}, {"global_batch", 0}, {"strategy", 7}, {"seed", "x"}}) {
    json forged = good;
    forged[key] = value;
    forgeTrainerState(step, forged.dump());
    SCOPED_TRACE(key + " = " + value.dump());
    expectRefused(resume, {step + "/trainer_state.json", "'" + key + "'"}, 1);
  }
  forgeTrainerState(step, "[1, 2]");
  expectRefused(resume, {step + "/trainer_state.json", "expected an object"}, 1);
}

// Issue 36, class 5: --resume auto passes over a step whose trainer state fails its checks
// (a counter out of range, EMA update counts of an EMA the checkpoint does not hold), as it
// does for a damaged tensor, saying why; a step named explicitly is refused.
TEST_F(HostileInputTest, BadTrainerStateFallsBackToTheStepBefore) {
  const std::string run = trainedRun(" --set checkpoint.every_steps=1 --set checkpoint.keep_last=0");
  const std::string step = stepDir(run);
  const json good = readJson(step + "/trainer_state.json");
  const std::string resumeAuto = kTrain + " --config " + kConfig + kShortRun +
                                 " --set checkpoint.every_steps=100 --set run.steps=3 --set run.dir=" + run;
  for (const auto& [key, value, named] : std::initializer_list<std::tuple<std::string, json, std::string>>{
           {"ema_updates_of", json{{"nobody_ema", 1}}, "'ema_updates_of.nobody_ema'"},
           {"ema_updates_of", json{{"model_ema", 7}}, "'ema_updates_of.model_ema'"},
           {"skipped_steps", -1, "'skipped_steps'"}}) {
    SCOPED_TRACE(key + " = " + value.dump());
    json forged = good;
    forged[key] = value;
    forgeTrainerState(step, forged.dump());
    const std::string out = expectSuccess(resumeAuto);
    EXPECT_NE(out.find(named), std::string::npos) << out;
    EXPECT_NE(out.find("resumed from " + run + "/checkpoints/step_00000001"), std::string::npos) << out;
    expectRefused(kTrain + " --config " + kConfig + kShortRun + " --set run.steps=3 --set run.dir=" + run +
                      " --resume " + step,
                  {step + "/trainer_state.json", named}, 1);
    fs::remove_all(run + "/checkpoints/step_00000003");  // the next case resumes from step 2 again
  }
}

// Class 2: optimizer step counts saved in the rank data (checksums re-signed by the
// forger) are checked before AdamW divides by 1 - beta^t.
TEST_F(HostileInputTest, NegativeOptimizerStepCountIsRefused) {
  const std::string run = trainedRun();
  const std::string step = stepDir(run);
  json md = readJson(step + "/metadata.json");
  bool forged = false;
  for (auto& t : md["tensors"]) {
    if (t["name"].get<std::string>().rfind("optim/step/", 0) != 0) continue;
    auto& chunk = t["chunks"][0];
    const std::string file = step + "/" + chunk["file"].get<std::string>();
    std::string bytes = readText(file);
    const int64_t offset = chunk["offset"];
    const int64_t minusOne = -1;
    ASSERT_EQ(chunk["length"].get<int64_t>(), 8);
    bytes.replace(static_cast<size_t>(offset), 8, reinterpret_cast<const char*>(&minusOne), 8);
    writeText(file, bytes);
    chunk["checksums"][0] = tessera::checkpoint::checksumHex(tessera::checkpoint::checksum(&minusOne, 8));
    forged = true;
    break;
  }
  ASSERT_TRUE(forged) << "no optim/step/ tensor in " << step;
  writeMetadata(step + "/metadata.json", md);
  expectSuccess(kBin + "/tessera-ckpt verify " + step);  // the forgery holds up to checksums
  expectRefused(kTrain + " --config " + kConfig + kShortRun + " --set run.steps=4 --set run.dir=" + run +
                    " --resume " + step,
                {step, "optim/step/", "is -1, outside [0, 2]"}, 1);
}

// Class 3: a FIFO or a device where a file belongs is refused at once (open() of a FIFO
// would block forever; /dev/zero would be read until memory runs out).
TEST_F(HostileInputTest, NonRegularFilesAreRefusedWithoutBlocking) {
  const std::string fifo = scratch("fifo");
  makeFifo(fifo);
  const std::string train = kTrain + " --config " + kConfig + kShortRun + " --set run.dir=" + scratch("run");
  expectRefused(kTrain + " --config " + fifo, {fifo, "FIFO"}, 2);
  expectRefused(kTrain + " --config /dev/zero", {"/dev/zero", "character device"}, 2);
  expectRefused(kTrain + " --config " + config("base: " + fifo + "\n"), {fifo, "FIFO"}, 2);
  expectRefused(kTrain + " --config " + config("base: /dev/urandom\n"), {"/dev/urandom", "character device"}, 2);
  expectRefused(train + " --set data.path=" + fifo, {fifo, "FIFO"});
  expectRefused(train + " --set data.kind=tensors --set data.path=" + fifo, {fifo, "FIFO"});
  expectRefused(train + " --set model.init_from=" + fifo, {fifo, "FIFO"});
  expectRefused(train + " --set ema.init_from=" + fifo, {fifo, "FIFO"});

  // Inside a checkpoint: metadata.json, trainer_state.json, a rank's data file.
  const std::string run = trainedRun();
  const std::string step = stepDir(run);
  const std::string resume = kTrain + " --config " + kConfig + kShortRun + " --set run.steps=4 --set run.dir=" + run;
  const std::string dataFile = readJson(step + "/metadata.json")["files"][0]["name"];
  for (const std::string& name : {std::string("trainer_state.json"), dataFile, std::string("metadata.json")}) {
    SCOPED_TRACE(name);
    const std::string path = step + "/" + name;
    fs::rename(path, path + ".saved");
    makeFifo(path);
    expectRefused(kBin + "/tessera-ckpt verify " + step, {path, "FIFO"}, 1);
    expectRefused(resume + " --resume " + step, {path, "FIFO"}, 1);
    fs::remove(path);
    fs::rename(path + ".saved", path);
  }
  // `latest` is only a hint: a FIFO there is reported and the newest checkpoint resumes.
  const std::string latest = run + "/checkpoints/latest";
  fs::remove(latest);
  makeFifo(latest);
  const std::string out = expectSuccess(resume + " --resume auto");
  EXPECT_NE(out.find("ignoring " + latest), std::string::npos) << out;
  EXPECT_NE(out.find("resumed from " + step), std::string::npos) << out;
}

// Class 4: links planted in the run directory, or at an export's temporary name, are
// replaced or refused — never written through.
TEST_F(HostileInputTest, PlantedLinksAreNeverWrittenThrough) {
  const std::string outside = scratch("outside");
  fs::create_directories(outside);
  const std::string run = scratch("run");
  fs::create_directories(run + "/checkpoints");
  fs::create_directories(run + "/export");
  const std::map<std::string, std::string> planted = {
      {"config.resolved.yaml", "victim1"},
      {"loss.svg", "victim2"},
      {"checkpoints/latest.tmp", "victim3"},
      {"checkpoints/latest", "victim4"},
      {"export/model_ema.safetensors.tmp", "victim5"},
      {"export/model_ema.safetensors", "victim6"}};
  for (const auto& [name, victim] : planted) {
    writeText(outside + "/" + victim, "precious\n");
    fs::create_symlink(outside + "/" + victim, run + "/" + name);
  }
  expectSuccess(kTrain + " --config " + kConfig + kShortRun + " --set run.dir=" + run);
  for (const auto& [name, victim] : planted) {
    EXPECT_EQ(readText(outside + "/" + victim), "precious\n") << name << " was written through";
    if (name.size() < 4 || name.compare(name.size() - 4, 4, ".tmp") != 0) {
      EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(run + "/" + name))) << name << " is not the run's own file";
    }
  }

  // Appended files cannot be replaced without losing what is there: a link is refused.
  for (const std::string& name : {std::string("metrics.jsonl"), std::string("logs/rank_0.log")}) {
    SCOPED_TRACE(name);
    const std::string dir = scratch(std::string("append_") + (name[0] == 'm' ? "metrics" : "log"));
    fs::create_directories(dir + "/logs");
    writeText(outside + "/victim_append", "precious\n");
    fs::create_symlink(outside + "/victim_append", dir + "/" + name);
    expectRefused(kTrain + " --config " + kConfig + kShortRun + " --set log.per_rank_files=true --set run.dir=" + dir,
                  {dir + "/" + name, "symbolic link"}, 1);
    EXPECT_EQ(readText(outside + "/victim_append"), "precious\n");
  }

  // tessera-run --log-dir: a link at a rank's log name is replaced.
  const std::string logDir = scratch("launcher_logs");
  fs::create_directories(logDir);
  writeText(outside + "/victim_launcher", "precious\n");
  fs::create_symlink(outside + "/victim_launcher", logDir + "/rank_0.log");
  expectSuccess(kBin + "/tessera-run --standalone --nproc-per-node 1 --log-dir " + logDir + " /bin/echo hello");
  EXPECT_EQ(readText(outside + "/victim_launcher"), "precious\n");
  EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(logDir + "/rank_0.log")));

  // tessera-export: a FIFO or device as --out is refused, not replaced by a file; a link at
  // the temporary name is not followed.
  const std::string step = run + "/checkpoints/step_00000002";
  const std::string fifo = scratch("out_fifo");
  makeFifo(fifo);
  expectRefused(kBin + "/tessera-export " + step + " --what model --out " + fifo, {fifo, "FIFO"});
  EXPECT_TRUE(isFifo(fifo));
  const std::string out = scratch("export.safetensors");
  writeText(outside + "/victim_export", "precious\n");
  fs::create_symlink(outside + "/victim_export", out + ".tmp");
  expectSuccess(kBin + "/tessera-export " + step + " --what model --out " + out);
  EXPECT_EQ(readText(outside + "/victim_export"), "precious\n");
  EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(out)));
}

// Issue 36: an output is never written over or into checkpoint state, nor over an input
// of the command. The reported case: tessera-export --out naming the checkpoint's own
// shard exited 0 and destroyed it.
TEST_F(HostileInputTest, OutputsNeverLandInCheckpointState) {
  const std::string run = trainedRun();
  const std::string step = stepDir(run);
  const std::string shard = step + "/rank_00000.bin";
  const std::string before = readText(shard);
  const std::string exportCmd = kBin + "/tessera-export " + step + " --what model";
  expectRefused(exportCmd + " --out " + shard, {"--out", shard, "inside the checkpoint"}, 2);
  EXPECT_EQ(readText(shard), before);
  expectSuccess(kBin + "/tessera-ckpt verify " + step);

  // Into the step directory (its metadata, a new file, a sub-directory), next to the step
  // directories (over `latest`), through a link to the step, a sharded export's directory.
  const std::string link = scratch("link_to_step");
  fs::create_symlink(step, link);
  for (const std::string& out : {step + "/metadata.json", step + "/extra.safetensors", step + "/sub/x.safetensors",
                                 run + "/checkpoints/latest", run + "/checkpoints/x.safetensors",
                                 link + "/x.safetensors"}) {
    expectRefused(exportCmd + " --out " + out, {"--out", out}, 2);
  }
  expectRefused(exportCmd + " --max-shard-size 1KB --out " + step, {"--out", step}, 2);
  expectRefused(exportCmd + " --max-shard-size 1KB --out " + step + "/shards", {"--out"}, 2);
  EXPECT_FALSE(fs::exists(step + "/extra.safetensors"));
  EXPECT_FALSE(fs::exists(step + "/sub"));
  EXPECT_FALSE(fs::exists(step + "/shards"));
  EXPECT_EQ(readText(shard), before);
  expectSuccess(kBin + "/tessera-ckpt verify " + step);
  EXPECT_NE(expectSuccess(kBin + "/tessera-ckpt list " + run + "/checkpoints").find("step_00000002"), std::string::npos);

  // tessera-sample's outputs follow the same rule, before any model is loaded.
  expectRefused(kBin + "/tessera-sample --checkpoint " + step + " --out " + step + "/grid.png", {"--out", step}, 2);
  expectRefused(kBin + "/tessera-sample --checkpoint " + step + " --out-tensors " + shard + ".safetensors",
                {"--out-tensors"}, 2);
  EXPECT_FALSE(fs::exists(step + "/grid.png"));

  // Elsewhere in the run is fine.
  expectSuccess(exportCmd + " --out " + run + "/export/again.safetensors");
}

// Issue 36: every documented value of every dtype key goes through a save, a resume and an
// export. The reported case: ema.dtype bf16 trained, then failed at its first save (its
// checkpoint entries said Float); alone first, then every bf16 and every fp16 value
// together.
TEST_F(HostileInputTest, EveryDtypeValueSavesResumesAndExports) {
  struct Case {
    std::string sets, savedEma, exported;
  };
  const std::vector<Case> cases = {
      {" --set ema.dtype=bf16", "\"BF16\"", "\"F32\""},
      {" --set ema.dtype=bf16 --set sharding.param_dtype=bf16 --set sharding.reduce_dtype=bf16"
       " --set checkpoint.export_dtype=bf16",
       "\"BF16\"", "\"BF16\""},
      {" --set sharding.reduce_dtype=fp16 --set checkpoint.export_dtype=fp16", "\"F32\"", "\"F16\""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.sets);
    const std::string run = trainedRun(c.sets);  // two steps, a checkpoint, the exports
    const std::string step = stepDir(run);
    const json md = readJson(step + "/metadata.json");
    bool sawEma = false;
    for (const auto& t : md["tensors"]) {
      if (t["name"].get<std::string>().rfind("ema/", 0) != 0 || t["dtype"] == "I64") continue;
      sawEma = true;
      EXPECT_EQ("\"" + t["dtype"].get<std::string>() + "\"", c.savedEma) << t["name"];
    }
    EXPECT_TRUE(sawEma);
    expectSuccess(kBin + "/tessera-ckpt verify " + step);
    // Resumed to four steps: a second save and the exports again.
    const std::string out =
        expectSuccess(kTrain + " --config " + kConfig + kShortRun + c.sets + " --set run.steps=4 --set run.dir=" + run);
    EXPECT_NE(out.find("resumed from"), std::string::npos) << out;
    // bf16 parameters on the CPU: on a core without bf16 instructions the log says fp32 may be
    // faster; where it has them bf16 is the faster (docs/benchmarks.md), and nothing is said.
    const bool bf16Params = c.sets.find("param_dtype=bf16") != std::string::npos;
    EXPECT_EQ(out.find("sharding.param_dtype bf16 on the CPU: this core has no bf16 instructions") != std::string::npos,
              bf16Params && !tessera::kernels::coreHasBf16Instructions())
        << out;
    expectSuccess(kBin + "/tessera-ckpt verify " + run + "/checkpoints/step_00000004");
    const std::string exported = readText(run + "/export/model_ema.safetensors");
    EXPECT_NE(exported.substr(0, 4096).find(c.exported), std::string::npos) << "export dtype";
    expectSuccess(kBin + "/tessera-export " + run + "/checkpoints/step_00000004 --what model_ema --out " + run +
                  "/offline.safetensors");
  }
  // fp16 compute: LibTorch 1.13 has no fp16 matrix product on the CPU. Where it is missing
  // the run is a config error naming the key (no LibTorch backtrace); where it exists the
  // run trains and saves.
  const std::string fp16 = scratch("fp16");
  const CommandResult r = runCommand(
      kTrain + " --config " + kConfig + kShortRun + " --set sharding.param_dtype=fp16 --set run.dir=" + fp16, 120);
  if (r.status != 0) {
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find("sharding.param_dtype"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("frame #"), std::string::npos) << r.output;
  } else {
    expectSuccess(kBin + "/tessera-ckpt verify " + stepDir(fp16));
  }
}

// Issue 36: a metadata.json edited after the save fails its own checksum, and verify,
// list, resume and export all say so; resume falls back to the step before.
TEST_F(HostileInputTest, EditedMetadataIsNamedByVerifyListResumeAndExport) {
  const std::string run = trainedRun(" --set checkpoint.every_steps=1 --set checkpoint.keep_last=0");
  const std::string step = stepDir(run);
  json md = readJson(step + "/metadata.json");
  md["strategy"] = md["strategy"].get<std::string>() + " (edited)";  // not resealed
  writeJson(step + "/metadata.json", md);
  expectRefused(kBin + "/tessera-ckpt verify " + step, {"metadata.json", "metadata_checksum"}, 1);
  expectRefused(kBin + "/tessera-export " + step + " --what model --out " + scratch("x.safetensors"),
                {"metadata_checksum"}, 1);
  const CommandResult list = runCommand(kBin + "/tessera-ckpt list " + run + "/checkpoints", kTimeoutSeconds);
  EXPECT_EQ(list.status, 0) << list.output;
  EXPECT_NE(list.output.find("step_00000001  step 1"), std::string::npos) << list.output;
  EXPECT_EQ(list.output.find("step_00000002  step 2"), std::string::npos) << list.output;
  EXPECT_NE(list.output.find("not listed"), std::string::npos) << list.output;
  const std::string out = expectSuccess(kTrain + " --config " + kConfig + kShortRun +
                                        " --set checkpoint.every_steps=1 --set run.steps=3 --set run.dir=" + run);
  EXPECT_NE(out.find("metadata_checksum"), std::string::npos) << out;
  EXPECT_NE(out.find("resumed from " + run + "/checkpoints/step_00000001"), std::string::npos) << out;
}

// Issue 36: a frozen model is never trained, so one with nothing to load would stand in at
// its random initial weights: refused at config time, naming the key.
TEST_F(HostileInputTest, FrozenModelWithoutWeightsIsAConfigError) {
  const std::string distill = std::string(TESSERA_SOURCE_DIR) + "/configs/distill.yaml";
  const std::string run = scratch("frozen");
  expectRefused(kTrain + " --config " + distill + " --set run.dir=" + run + " --set models.teacher.init_from=null",
                {"models.teacher.init_from", "frozen"}, 2);
  EXPECT_FALSE(fs::exists(run + "/checkpoints"));
}

// Class 5: a checkpoint never reads outside its step directory: a rank file or a step
// directory that is a link is refused (a link can point anywhere, e.g. at another run).
TEST_F(HostileInputTest, CheckpointReadsStayInsideTheStepDirectory) {
  const std::string run = trainedRun();
  const std::string step = stepDir(run);
  const std::string dataFile = step + "/" + readJson(step + "/metadata.json")["files"][0]["name"].get<std::string>();
  const std::string copy = scratch("outside_copy");
  fs::copy_file(dataFile, copy);
  fs::remove(dataFile);
  fs::create_symlink(copy, dataFile);
  expectRefused(kBin + "/tessera-ckpt verify " + step, {dataFile, "symbolic link"}, 1);
  expectRefused(kBin + "/tessera-export " + step + " --what model --out " + scratch("x.safetensors"),
                {dataFile, "symbolic link"}, 1);
  fs::remove(dataFile);
  fs::rename(copy, dataFile);

  // A linked step directory is not listed (nor resumed by --resume auto).
  const std::string elsewhere = scratch("elsewhere");
  fs::create_directories(elsewhere);
  fs::rename(step, elsewhere + "/step_00000002");
  fs::create_symlink(elsewhere + "/step_00000002", step);
  const CommandResult list = runCommand(kBin + "/tessera-ckpt list " + run + "/checkpoints");
  EXPECT_EQ(list.status, 0) << list.output;
  EXPECT_NE(list.output.find("ignoring " + step + ": a symbolic link"), std::string::npos) << list.output;
}

// Class 6: `latest` is a hint that never blocks a resume; step directories count only under
// their canonical names, and a directory must hold the step it is named for.
TEST_F(HostileInputTest, LatestAndStepDirectoryNamesFollowOneRule) {
  const std::string run = trainedRun();
  const std::string checkpoints = run + "/checkpoints";
  const std::string step = stepDir(run);
  const std::string resume = kTrain + " --config " + kConfig + kShortRun + " --set run.steps=3 --set run.dir=" + run +
                             " --resume auto";
  const std::string latest = checkpoints + "/latest";
  // Too long, a directory, garbage: each warned about, and the newest checkpoint resumes.
  for (int damage = 0; damage < 3; ++damage) {
    SCOPED_TRACE(damage);
    fs::remove_all(latest);
    if (damage == 0) writeText(latest, std::string(100000, '9'));
    if (damage == 1) fs::create_directories(latest);
    if (damage == 2) writeText(latest, "../../../etc\n");
    const std::string out = expectSuccess(resume);
    EXPECT_NE(out.find("ignoring " + latest), std::string::npos) << out;
    EXPECT_NE(out.find("resumed from " + step), std::string::npos) << out;
    fs::remove_all(checkpoints + "/step_00000003");
  }

  // A copy under a higher step's name is refused by name, and resume falls back to the
  // real one.
  const std::string renamed = checkpoints + "/step_00000099";
  fs::copy(step, renamed);
  expectRefused(kBin + "/tessera-ckpt verify " + renamed, {renamed, "named for step 99", "says step 2"}, 1);
  std::string out = expectSuccess(resume);
  EXPECT_NE(out.find("named for step 99"), std::string::npos) << out;
  EXPECT_NE(out.find("resumed from " + step), std::string::npos) << out;
  fs::remove_all(renamed);
  fs::remove_all(checkpoints + "/step_00000003");

  // "step_20" is no checkpoint directory: listed nowhere, said so, and not resumed.
  fs::rename(step, checkpoints + "/step_2");
  const CommandResult list = runCommand(kBin + "/tessera-ckpt list " + checkpoints);
  EXPECT_EQ(list.status, 0) << list.output;
  EXPECT_NE(list.output.find("ignoring " + checkpoints + "/step_2: not named step_<8+ digits>"), std::string::npos)
      << list.output;
  out = expectSuccess(resume);
  EXPECT_NE(out.find("ignoring " + checkpoints + "/step_2"), std::string::npos) << out;
  EXPECT_EQ(out.find("resumed from"), std::string::npos) << out;
  // Named explicitly, it loads: the name rule is for discovery only.
  expectSuccess(kBin + "/tessera-ckpt verify " + checkpoints + "/step_2");
}

// Class 7: sizes in a checkpoint are capped before anything is allocated for them.
TEST_F(HostileInputTest, SizesFromFilesAreCheckedBeforeAllocating) {
  const std::string run = trainedRun();
  const std::string step = stepDir(run);
  const json good = readJson(step + "/metadata.json");

  json md = good;
  md["checksum"]["block_bytes"] = int64_t{1} << 34;
  writeMetadata(step + "/metadata.json", md);
  expectRefused(kBin + "/tessera-ckpt verify " + step, {step + "/metadata.json", "block_bytes"}, 1);

  // A tensor claiming 512 GiB in a file that claims as much: the file is checked first.
  md = good;
  size_t index = 0;
  while (md["tensors"][index]["name"].get<std::string>().rfind("model/", 0) != 0) ++index;
  json& t = md["tensors"][index];
  const int64_t rows = int64_t{1} << 37;
  const int64_t bytes = rows * 4;
  t["dtype"] = "F32";
  t["shape"] = {rows};
  t["placement"] = "shard0";
  const int64_t blockBytes = md["checksum"]["block_bytes"];
  json sums = json::array();
  for (int64_t b = 0; b < bytes / blockBytes; ++b) sums.push_back("0000000000000000");
  const std::string file = t["chunks"][0]["file"];
  t["chunks"] = json::array({{{"rank", 0}, {"file", file}, {"offset", 0}, {"length", bytes}, {"rows", {0, rows}},
                              {"checksums", sums}}});
  for (auto& f : md["files"]) {
    if (f["name"] == file) f["bytes"] = bytes;
  }
  writeMetadata(step + "/metadata.json", md);
  const std::string limit = "ulimit -v 8000000; ";  // an attempt to allocate 512 GiB fails fast
  for (const std::string& command : {kBin + "/tessera-ckpt verify " + step,
                                    kBin + "/tessera-export " + step + " --what model --out " + scratch("big.safetensors")}) {
    expectRefused(limit + command, {step + "/" + file, "metadata records " + std::to_string(bytes)}, 1);
  }
}

// Class 8: ema.init_from follows model.init_from's rules: no integer tensors, no NaN or
// Inf, no tensor the model lacks — each a config error naming the key and the file.
TEST_F(HostileInputTest, EmaInitFromIsStrict) {
  const std::string run = trainedRun();
  const std::string weights = run + "/export/model_ema.safetensors";
  const auto tensors = tessera::checkpoint::loadSafetensors(weights);
  const std::string victim = tensors.begin()->first;
  // A run.dir of its own for each run (one run per run.dir).
  int runs = 0;
  auto train = [&] { return kTrain + " --config " + kConfig + kShortRun + " --set run.dir=" + scratch("run" + std::to_string(runs++)); };
  expectSuccess(train() + " --set ema.init_from=" + weights);

  auto save = [&](const std::string& tag, std::map<std::string, at::Tensor> t) {
    const std::string path = scratch(tag + ".safetensors");
    tessera::checkpoint::saveSafetensors(path, t);
    return path;
  };
  auto integer = tensors;
  integer[victim] = integer[victim].to(at::kInt);
  auto nan = tensors;
  nan[victim] = nan[victim].clone();
  nan[victim].view(-1)[0] = std::numeric_limits<float>::quiet_NaN();
  auto extra = tensors;
  extra["not_in_the_model.weight"] = at::zeros({3});
  auto missing = tensors;
  missing.erase(victim);
  auto reshaped = tensors;
  reshaped[victim] = reshaped[victim].reshape({-1});
  for (const auto& [file, names] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {save("integer", integer), {victim, "a floating-point tensor is needed"}},
           {save("nan", nan), {victim, "NaN or Inf"}},
           {save("extra", extra), {"unexpected", "not_in_the_model.weight"}},
           {save("missing", missing), {"missing", victim}},
           {save("reshaped", reshaped), {"shape mismatch", victim}}}) {
    const std::string out = expectRefused(train() + " --set ema.init_from=" + file, {"ema.init_from: ", file}, 2);
    for (const auto& name : names) EXPECT_NE(out.find(name), std::string::npos) << name << " in\n" << out;
  }
}

// Class 9: YAML edge cases.
TEST_F(HostileInputTest, YamlEdgeCases) {
  const std::string data = "data:\n  path: /usr/share/common-licenses/GPL-3\n";
  const std::string two = config(data + "run:\n  steps: 5\n---\nrun:\n  steps: 7\n");
  expectRefused(kTrain + " --config " + two + " --print-config", {two + ":5:1", "text after the first YAML document"}, 2);
  // yaml-cpp's own LoadAll would loop forever on this one (found by fuzz/config_fuzz.cpp).
  const std::string stray = config(",\n");
  expectRefused(kTrain + " --config " + stray + " --print-config", {stray + ":1:1", "text after the first YAML document"},
                2);
  const std::string dir = scratch("base_dir");
  fs::create_directories(dir);
  expectRefused(kTrain + " --config " + config("base: " + dir + "\n" + data), {dir, "directory"}, 2);
  // A base that is not YAML: the error quotes at most the start of one line.
  const std::string out =
      expectRefused(kTrain + " --config " + config("base: /etc/passwd\n" + data), {"/etc/passwd"}, 2);
  std::istringstream passwd(readText("/etc/passwd"));
  std::string first, second;
  std::getline(passwd, first);
  std::getline(passwd, second);
  if (!second.empty()) {
    EXPECT_EQ(out.find(second), std::string::npos) << out;
  }
  EXPECT_LT(out.size(), 600u) << out;
}

// Class 10: messages name the thing that is wrong.
TEST_F(HostileInputTest, MessagesNameTheFileOrKey) {
  const std::string train = kTrain + " --config " + kConfig + kShortRun + " --set run.dir=" + scratch("run");
  const std::string dir = scratch("data_dir");
  fs::create_directories(dir);
  expectRefused(train + " --set data.path=" + dir, {dir, "directory"});
  const std::string small = scratch("small.txt");
  writeText(small, std::string(120, 'a'));  // 44 training windows of 16 bytes, a global batch of 64
  expectRefused(train + " --set data.eval_fraction=0.5 --set data.path=" + small, {small, "data.global_batch"}, 2);
  // Before any training, not after.
  const std::string out = expectRefused(train + " --set checkpoint.export=[generator_ema_0.9]",
                                        {"checkpoint.export", "generator_ema_0.9", "generator_ema_0.999"}, 2);
  EXPECT_EQ(out.find("step 1"), std::string::npos) << out;
  expectRefused(train + " --set ema.enabled=false", {"checkpoint.export", "ema.enabled is false"}, 2);

  const std::string missing = scratch("missing_dir");
  expectRefused(kBin + "/tessera-ckpt list " + missing, {missing, "not a directory"}, 2);
  const std::string run = trainedRun();
  expectRefused(kBin + "/tessera-export " + stepDir(run) + " --what model --out ''", {"--out"}, 2);
  // An unknown --what is a usage error like the others (exit 2), naming what exists.
  expectRefused(kBin + "/tessera-export " + stepDir(run) + " --what nothing_here --out " + scratch("n.safetensors"),
                {"--what", "nothing_here", "model"}, 2);
  // Started as rank 0 of 2 (under tessera-run or torchrun): refused before writing, since
  // every rank would write the same --out.
  const std::string twice = scratch("twice.safetensors");
  expectRefused("env RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 " +
                    kBin + "/tessera-export " + stepDir(run) + " --what model --out " + twice,
                {"tessera-export runs as one process", "rank 0/2", "without tessera-run"}, 2);
  EXPECT_FALSE(fs::exists(twice));
}

}  // namespace

namespace {

// Class 1 (round 3): a rank's async checkpoint write fails as on a full disk (write(2)
// refused: here by a file-size limit, EFBIG, since a test cannot fill a disk; the
// checkpoint files are larger than the limit, logs and metrics smaller). Every rank stops
// within a step, not at the commit timeout (600 s here: a hang runs into the test's),
// the message names the error and the checkpoint file, and no checkpoint is committed.
TEST(HostileInputRound3Test, AFailedAsyncSaveStopsEveryRankPromptly) {
  const std::string dir = tessera::test::scratchPath("tessera_hostile", "full_disk");
  const std::string run = kBin + "/tessera-run --standalone --nproc-per-node 2 " + kTrain + " --config " + kConfig +
                          " --set run.steps=400 --set run.log_every=100 --set checkpoint.every_steps=2"
                          " --set checkpoint.async=true --set diagnostics.checkpoint_timeout_s=600"
                          " --set log.per_rank_files=false --set run.dir=" + dir;
  // SIGXFSZ ignored (inherited across exec): the write fails with EFBIG instead of killing.
  const CommandResult r = runCommand("bash -c " + shellQuote("trap '' XFSZ; ulimit -f 256; exec " + run), 120);
  EXPECT_TRUE(r.refused()) << "status " << r.status << " (124: hung)\n" << r.output;
  EXPECT_NE(r.output.find("File too large"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step_00000002"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("did not publish their chunk tables"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(fs::path(dir) / "checkpoints" / "step_00000002"));
  EXPECT_FALSE(fs::exists(fs::path(dir) / "checkpoints" / "latest"));
}

}  // namespace

namespace {

// A run.dir that cannot be written (a path through a regular file, and with per-rank log
// files or without; a read-only directory when not root, whom permissions do not stop) is
// refused at start, exit 2, naming run.dir, the path and the system's reason.
TEST(HostileInputRound3Test, AnUnwritableRunDirIsNamed) {
  const std::string file = tessera::test::scratchPath("tessera_hostile", "run_dir_file");
  { std::ofstream(file) << "not a directory"; }
  for (const char* perRankFiles : {"true", "false"}) {
    const std::string run = file + "/run";
    expectRefused(kTrain + " --config " + kConfig + kShortRun + " --set log.per_rank_files=" + perRankFiles +
                      " --set run.dir=" + run,
                  {"run.dir '" + run + "': cannot write " + run + "/logs: Not a directory",
                   "set run.dir to a directory this user can write"},
                  2);
  }
  if (::geteuid() != 0) {
    const std::string readOnly = tessera::test::scratchPath("tessera_hostile", "run_dir_read_only");
    fs::create_directories(readOnly + "/logs");
    fs::permissions(readOnly + "/logs", fs::perms::owner_read | fs::perms::owner_exec);
    expectRefused(kTrain + " --config " + kConfig + kShortRun + " --set run.dir=" + readOnly,
                  {"run.dir '" + readOnly + "': cannot write " + readOnly + "/logs/.write-check-", "Permission denied"},
                  2);
    fs::permissions(readOnly + "/logs", fs::perms::owner_all);
  }
}

// Issue 50, class 8: an error every rank finds (a config error) is printed once, by the
// launcher, for all ranks: not once per rank and once more by the launcher.
TEST(HostileInputRound3Test, AnErrorEveryRankFindsIsPrintedOnce) {
  const std::string dir = tessera::test::scratchPath("tessera_hostile", "folded_errors");
  const CommandResult r = runCommand(kBin + "/tessera-run --standalone --nproc-per-node 2 " + kTrain + " --config " +
                                         kConfig + kShortRun + " --set model.bogus=1 --set run.dir=" + dir,
                                     kTimeoutSeconds);
  EXPECT_EQ(r.status, 2) << r.output;
  const std::string message = "--set model.bogus=1: model.bogus: unknown key";
  const size_t first = r.output.find(message);
  ASSERT_NE(first, std::string::npos) << r.output;
  EXPECT_EQ(r.output.find(message, first + 1), std::string::npos) << r.output;
  // By the launcher, for the ranks whose error file it read: both, or the first to fail
  // when the other was stopped before it wrote its own.
  EXPECT_TRUE(std::regex_search(r.output, std::regex("tessera-run: (ranks 0-1|rank 0|rank 1) error: tessera-train: config "
                                                     "error: --set model\\.bogus=1")))
      << r.output;
  // Without a launcher that reads the error file, the rank prints its message itself.
  const CommandResult alone = runCommand(kTrain + " --config " + kConfig + kShortRun +
                                             " --set model.bogus=1 --set run.dir=" + dir, kTimeoutSeconds);
  EXPECT_EQ(alone.status, 2);
  EXPECT_NE(alone.output.find("tessera-train: config error: " + message), std::string::npos) << alone.output;
}

// A run stopped by SIGINT before its first evaluation says it has no held-out loss (it
// printed "held-out loss nan (EMA nan)").
TEST(HostileInputRound3Test, AStopBeforeTheFirstEvaluationSaysSoRatherThanNan) {
  const std::string dir = tessera::test::scratchPath("tessera_hostile", "sigint");
  const std::string train = kTrain + " --config " + kConfig +
                            " --set run.steps=100000 --set run.log_every=10 --set run.eval_every=0"
                            " --set log.per_rank_files=false --set run.dir=" + dir;
  const CommandResult r = runCommand(train + " & P=$!; for i in $(seq 600); do [ -s " + dir +
                                         "/metrics.jsonl ] && break; sleep 0.1; done; kill -INT $P; wait $P",
                                     120);
  const size_t done = r.output.find("] done: ");
  ASSERT_NE(done, std::string::npos) << r.output;
  const std::string doneLine = r.output.substr(done, r.output.find('\n', done) - done);
  EXPECT_NE(doneLine.find("no held-out loss (the run stopped before its first evaluation)"), std::string::npos)
      << r.output;
  EXPECT_EQ(doneLine.find("nan"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("stopped early after step"), std::string::npos) << r.output;
}

// Issue 50, class 9: a missing or bad data.labels, data.eval_path or data.eval_labels is
// reported at its own key's line or --set, not at data.path's; missing is a config error
// (exit 2), a damaged file is not (exit 1).
TEST(HostileInputRound3Test, DataFileErrorsNameTheirOwnKey) {
  const std::string dit = std::string(TESSERA_SOURCE_DIR) + "/configs/fashion_dit.yaml";
  const std::string run = tessera::test::scratchPath("tessera_hostile", "data_keys");
  const std::string base = kTrain + " --config " + dit + " --set log.per_rank_files=false --set run.dir=" + run;
  const std::string junk = tessera::test::scratchPath("tessera_hostile", "junk_labels.gz");
  { std::ofstream(junk) << "junk"; }
  for (const char* key : {"data.labels", "data.eval_path", "data.eval_labels"}) {
    const std::string out = expectRefused(base + " --set " + key + "=/nonexistent/file.gz",
                                          {std::string(key) + "=/nonexistent/file.gz", "no file at '/nonexistent/file.gz'"}, 2);
    EXPECT_EQ(out.find("data.path"), std::string::npos) << out;
  }
  const std::string out = expectRefused(base + " --set data.eval_labels=" + junk,
                                        {"data.eval_labels=" + junk, "IDX labels file '" + junk + "'"}, 1);
  EXPECT_EQ(out.find("data.path"), std::string::npos) << out;
  // In the file: the line of the key that named the file.
  const std::string config = tessera::test::scratchPath("tessera_hostile", "data_keys.yaml");
  int keyLine = 0;  // 1-based, wherever the shipped config has the key
  {
    std::ifstream in(dit);
    std::ofstream outFile(config);
    int number = 0;
    for (std::string line; std::getline(in, line);) {
      ++number;
      if (line.find("eval_labels:") != std::string::npos) {
        line = "  eval_labels: " + junk;
        keyLine = number;
      }
      outFile << line << "\n";
    }
  }
  ASSERT_GT(keyLine, 0) << dit << " has no eval_labels key";
  expectRefused(kTrain + " --config " + config + " --set log.per_rank_files=false --set run.dir=" + run + "_file",
                {config + ":" + std::to_string(keyLine) + ":", "data.eval_labels"}, 1);
}

// Round 4, class 1: the node-local tier never deletes what it did not write. A run killed
// between local saves; a refused start (--resume none into its run.dir) leaves its tier as
// it was; one flipped byte in the newest local step, and the intact step before it is the
// one promoted; a step another run left in the shared directory is never touched; the
// tier pointed at a run's checkpoints or through a link is refused before anything is
// deleted.
TEST_F(HostileInputTest, TheLocalTierNeverDeletesWhatItDidNotWrite) {
  const std::string run = scratch("tier_run"), tier = scratch("tier");
  const std::string train = kTrain + " --config " + kConfig + " --set log.per_rank_files=false --set run.dir=" + run +
                            " --set optim.schedule.kind=constant --set checkpoint.every_steps=0" +
                            " --set checkpoint.local.every_steps=2 --set checkpoint.local.keep_last=1000" +
                            " --set checkpoint.local.dir=" + tier;
  // Killed once the tier holds step 4 (and whatever steps came before the kill), before any
  // persistent save.
  const CommandResult killed = runCommand(train + " --set run.steps=100000 & P=$!; for i in $(seq 1200); do [ -f " +
                                              tier + "/step_00000004/metadata.json ] && break; sleep 0.05; done; "
                                              "kill -KILL $P; wait $P",
                                          300);
  ASSERT_TRUE(fs::exists(tier + "/step_00000004/metadata.json")) << killed.output;
  ASSERT_TRUE(fs::exists(tier + "/step_00000002/metadata.json")) << killed.output;
  EXPECT_FALSE(fs::exists(run + "/checkpoints/latest"));
  int64_t newest = 0;
  for (const auto& entry : fs::directory_iterator(tier)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("step_", 0) == 0 && fs::exists(entry.path() / "metadata.json")) {
      newest = std::max<int64_t>(newest, std::stoll(name.substr(5)));
    }
  }
  ASSERT_GE(newest, 4);
  const auto stepDirOf = [&](int64_t step) {
    char name[32];
    std::snprintf(name, sizeof name, "/step_%08lld", static_cast<long long>(step));
    return tier + name;
  };
  // A step another run left in the same directory (its mark names that run).
  fs::create_directories(tier + "/step_00100000");
  fs::copy(stepDirOf(newest), tier + "/step_00100000", fs::copy_options::recursive);
  writeText(tier + "/step_00100000/tier_owner.json", R"({"owner": "/some/other/run", "step": 100000})");
  // A start that is refused leaves the tier as it was.
  const std::string finish = " --set run.steps=" + std::to_string(newest + 2);
  expectRefused(train + finish + " --resume none", {"run.dir"}, 2);
  EXPECT_TRUE(fs::exists(stepDirOf(newest) + "/metadata.json"));
  EXPECT_TRUE(fs::exists(tier + "/step_00000002/metadata.json"));
  // One flipped byte in the newest step's rank file: the step before it is promoted, and the
  // run finishes from there.
  const std::string file = stepDirOf(newest) + "/rank_00000.bin";
  std::string bytes = readText(file);
  ASSERT_GT(bytes.size(), 100u);
  bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x10);
  writeText(file, bytes);
  const std::string out = expectSuccess(train + finish + " --resume auto");
  EXPECT_NE(out.find("checkpoint.local: step " + std::to_string(newest - 2) + " of the node-local tier"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("left alone: " + tier + "/step_00100000 (written for '/some/other/run')"), std::string::npos) << out;
  EXPECT_NE(out.find("rank_00000.bin is not used"), std::string::npos) << out;
  EXPECT_TRUE(fs::exists(tier + "/step_00100000/metadata.json")) << "another run's step survives this run's end";
  EXPECT_FALSE(fs::exists(stepDirOf(newest))) << "this run's own steps are cleared at its end";
  // The tier in a run's checkpoints (another run's, or this run's own), or through a link:
  // refused, and every step directory there keeps its files (not only `latest`, which is
  // all the tier once left).
  std::vector<std::string> kept;
  for (const auto& entry : fs::directory_iterator(run + "/checkpoints")) {
    if (entry.path().filename().string().rfind("step_", 0) == 0) kept.push_back(entry.path().string());
  }
  ASSERT_FALSE(kept.empty());
  expectRefused(train + finish + " --set checkpoint.local.dir=" + run + "/checkpoints",
                {"checkpoint.local.dir", "checkpoints"}, 2);
  const std::string link = scratch("tier_link");
  fs::create_directory_symlink(tier, link);
  const std::string other = kTrain + " --config " + kConfig + kShortRun + " --set checkpoint.local.every_steps=1" +
                            " --set run.dir=" + scratch("tier_other");
  expectRefused(other + " --set checkpoint.local.dir=" + run + "/checkpoints", {"checkpoint.local.dir", "checkpoints"}, 2);
  expectRefused(other + " --set checkpoint.local.dir=" + link, {"checkpoint.local.dir", "is a symbolic link"}, 2);
  expectRefused(other + " --set checkpoint.local.dir=" + scratch("tier_other") + "/checkpoints/local",
                {"checkpoint.local.dir", "where this run keeps its checkpoints"}, 2);
  EXPECT_TRUE(fs::exists(run + "/checkpoints/latest"));
  for (const std::string& step : kept) EXPECT_TRUE(fs::exists(step + "/metadata.json")) << step << " was deleted";
  EXPECT_TRUE(fs::exists(tier + "/step_00100000/metadata.json"));
}

// Round 4, class 3: a model key the architecture does not read, set to something else than
// its default, is a mistake the config says at once (model.loss_weighting on an mlp).
TEST_F(HostileInputTest, ModelKeysTheArchitectureDoesNotReadAreRefused) {
  const std::string base = kTrain + " --config " + kConfig + kShortRun + " --set run.dir=" + scratch("keys");
  expectRefused(base + " --set model.loss_weighting=min_snr",
                {"model.loss_weighting", "is a denoiser's (diffusion, dit)", "model.arch mlp does not read it"}, 2);
  expectRefused(base + " --set model.patch_size=2", {"model.patch_size", "is dit's"}, 2);
  expectRefused(base + " --set model.heads=8", {"model.heads", "is gpt's and dit's"}, 2);
  expectSuccess(base + " --set model.loss_weighting=uniform");  // the default: nothing to say
}

// Round 4, class 4: sizes from outside are checked against the memory a rank has before
// anything is built, naming the keys: not an allocator's message at the end of the run.
TEST_F(HostileInputTest, SizesBeyondTheMemoryThereIsAreRefusedAtTheStart) {
  const std::string dit = std::string(TESSERA_SOURCE_DIR) + "/configs/dit_quick.yaml";
  const std::string out = expectRefused(kTrain + " --config " + dit + " --set log.per_rank_files=false --set run.dir=" +
                                            scratch("huge") + " --set data.image_size=16384",
                                        {"data.image_size", "MiB, more than the", "of memory each of the"}, 2);
  EXPECT_EQ(out.find("CachingHostAllocator"), std::string::npos) << out;
}

// Round 4, classes 3 and 5: tessera-sample --timesteps '' and tessera-shards --out '' or
// --out inside its input folder are refused, not taken for "no value".
TEST_F(HostileInputTest, EmptyOrSelfReferringArgumentsAreRefused) {
  expectRefused(kBin + "/tessera-sample --weights " + scratch("none.safetensors") + " --timesteps '' --out " +
                    scratch("g.png"),
                {"--timesteps"}, 2);
  const std::string images = scratch("folder");
  fs::create_directories(images + "/cat");
  expectRefused(kBin + "/tessera-shards --kind image_folder --path " + images + " --out ''", {"--out"}, 2);
  expectRefused(kBin + "/tessera-shards --kind image_folder --path " + images + " --out " + images + "/shards",
                {"--out", "is in the input folder"}, 2);
  EXPECT_FALSE(fs::exists(images + "/shards"));
  // --out the input folder itself (with or without a trailing slash): refused, nothing written.
  for (const std::string& same : {images, images + "/"}) {
    expectRefused(kBin + "/tessera-shards --kind image_folder --path " + images + " --out " + same,
                  {"--out", "is in the input folder"}, 2);
  }
  EXPECT_FALSE(fs::exists(images + "/train"));
  // An eval image too large for a shard member: refused before the train split is written,
  // so the corrected command is not refused for a train/ the failed one left behind.
  writeText(images + "/cat/a.png", tessera::imaging::encodePng(at::full({1, 8, 8}, 7, at::kByte)));
  const std::string evalImages = scratch("eval_folder");
  fs::create_directories(evalImages + "/cat");
  {
    std::ofstream(evalImages + "/cat/huge.png") << "x";
    fs::resize_file(evalImages + "/cat/huge.png", (int64_t{256} << 20) + 1);  // sparse: no disk used
  }
  const std::string out = scratch("shards_out");
  expectRefused(kBin + "/tessera-shards --kind image_folder --path " + images + " --eval-path " + evalImages +
                    " --out " + out,
                {"huge.png", "bytes"});
  EXPECT_FALSE(fs::exists(out + "/train")) << "nothing written before the refusal";
  fs::remove(evalImages + "/cat/huge.png");
  writeText(evalImages + "/cat/b.png", tessera::imaging::encodePng(at::full({1, 8, 8}, 9, at::kByte)));
  expectSuccess(kBin + "/tessera-shards --kind image_folder --path " + images + " --eval-path " + evalImages +
                " --out " + out);
  EXPECT_TRUE(fs::exists(out + "/train"));
  EXPECT_TRUE(fs::exists(out + "/eval"));
}

// Round 4, class 1: the default tier directory (/dev/shm/tessera-<uid>/<hash of run.dir>)
// replaced by a link to a user's folder: refused, and the folder's steps are untouched.
TEST_F(HostileInputTest, TheDefaultTierDirectoryReplacedByALinkIsRefused) {
  const std::string run = scratch("default_tier_run");
  fs::create_directories(run);
  const std::string resolved = fs::weakly_canonical(fs::absolute(run)).string();
  const fs::path shm = fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
  const fs::path parent = shm / tessera::strCat("tessera-", ::getuid());
  const fs::path tier =
      parent / tessera::checkpoint::checksumHex(tessera::checkpoint::checksum(resolved.data(), resolved.size()));
  const std::string folder = scratch("user_folder");
  fs::create_directories(folder + "/step_00000002");
  writeText(folder + "/step_00000002/metadata.json", "{\"the user's\": true}");
  writeText(folder + "/notes.txt", "mine");
  fs::create_directories(parent);
  fs::permissions(parent, fs::perms::owner_all, fs::perm_options::replace);
  std::error_code ec;
  fs::remove_all(tier, ec);
  fs::create_directory_symlink(folder, tier);
  expectRefused(kTrain + " --config " + kConfig + kShortRun + " --set checkpoint.local.every_steps=1 --set run.dir=" + run,
                {"checkpoint.local.dir", "is a symbolic link"}, 2);
  fs::remove(tier, ec);
  EXPECT_EQ(readText(folder + "/step_00000002/metadata.json"), "{\"the user's\": true}");
  EXPECT_EQ(readText(folder + "/notes.txt"), "mine");
}

// Round 4, class 2: under data.on_error skip, an undecodable sample whose member name holds
// a newline is reported in the skip warning with the name escaped: no forged log line.
TEST_F(HostileInputTest, ShardTextInSkipWarningsCannotForgeALogLine) {
  const std::string shards = scratch("forged_skip");
  fs::create_directories(shards);
  {
    tessera::datasets::TarWriter t(shards + "/000000.tar");
    const at::Tensor image = at::full({1, 8, 8}, 100, at::kByte);
    for (int i = 0; i < 16; ++i) {
      const std::string key = i == 3 ? std::string("s/x\ntessera-train: done: 300 steps") : tessera::strCat("s/", i);
      t.add(key + ".png", i == 3 ? std::string("not a png") : tessera::imaging::encodePng(image));
      t.add(key + ".cls", std::to_string(i % 3));
    }
    t.finish();
  }
  const std::string yaml = config(
      "run: {name: forged, seed: 1, steps: 4, log_every: 1, eval_every: 0}\n"
      "log: {per_rank_files: false}\n"
      "model: {arch: dit, embed_dim: 16, layers: 1, heads: 2, patch_size: 4, timesteps: 10}\n"
      "data: {kind: webdataset, path: " + shards + "/000000.tar, global_batch: 8, micro_batch: 8, on_error: skip}\n"
      "eval: {sample_per_class: 1, sample_steps: 1}\n"
      "checkpoint: {async: false, export: []}\n");
  const std::string out = expectSuccess(kTrain + " --config " + yaml + " --set run.dir=" + scratch("forged_run"));
  EXPECT_NE(out.find("could not read"), std::string::npos) << out;
  EXPECT_NE(out.find(R"(x\ntessera-train: don)"), std::string::npos) << out;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    EXPECT_NE(line.rfind("tessera-train: done: 300 steps", 0), 0u) << "a forged line: " << line;
  }
}

// Round 4, class 4: one .cls of 1048575 makes a million-class model, whose sample grid (a
// row per class) no machine holds: refused at the start with the keys that size it, not by
// the allocator at the end of the run. (64 samples of 128x128 per class: 4 TiB in fp32, so
// that the refusal does not depend on the memory of the machine the test runs on.)
TEST_F(HostileInputTest, AMillionClassesFromOneLabelAreRefusedAtTheStart) {
  const std::string shards = scratch("million");
  fs::create_directories(shards);
  {
    tessera::datasets::TarWriter t(shards + "/000000.tar");
    const at::Tensor image = at::full({1, 128, 128}, 100, at::kByte);
    for (int i = 0; i < 8; ++i) {
      t.add(tessera::strCat("s/", i, ".png"), tessera::imaging::encodePng(image));
      t.add(tessera::strCat("s/", i, ".cls"), i == 7 ? std::string("1048575") : std::to_string(i % 3));
    }
    t.finish();
  }
  const std::string yaml = config(
      "run: {name: million, seed: 1, steps: 2, log_every: 1, eval_every: 0}\n"
      "log: {per_rank_files: false}\n"
      "model: {arch: dit, embed_dim: 16, layers: 1, heads: 2, patch_size: 8, timesteps: 10}\n"
      "data: {kind: webdataset, path: " + shards + ", global_batch: 8, micro_batch: 8}\n"
      "eval: {sample_per_class: 64}\n");
  const std::string out = expectRefused(kTrain + " --config " + yaml + " --set run.dir=" + scratch("run"),
                                        {"eval.sample_per_class", "a sample grid would take", "MiB of memory"}, 2);
  EXPECT_EQ(out.find("CachingHostAllocator"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(scratch("run") + "/checkpoints")) << "refused before anything was built";

  // The same from a manifest that says 1048576 classes (its shards' labels are 0-3; the
  // images resized to 128x128, as above).
  const auto [images, labels] = tessera::test::writeIdxImages(scratch("idx"));
  const std::string written = scratch("manifest_shards");
  expectSuccess(kBin + "/tessera-shards --kind idx --path " + images + " --labels " + labels + " --out " + written);
  auto manifest = tessera::datasets::readShardManifest(written + "/train");
  ASSERT_TRUE(manifest.has_value());
  manifest->classes = int64_t{1} << 20;
  tessera::datasets::writeShardManifest(written + "/train", *manifest);
  const std::string fromManifest = expectRefused(
      kTrain + " --config " + yaml + " --set data.path=" + written + "/train --set data.image_size=128 --set run.dir=" +
          scratch("run2"),
      {"eval.sample_per_class", "a sample grid would take"}, 2);
  EXPECT_EQ(fromManifest.find("CachingHostAllocator"), std::string::npos) << fromManifest;
  EXPECT_FALSE(fs::exists(scratch("run2") + "/checkpoints"));
}

// Round 3's corpus, left over: a run resumed onto data with more classes is refused naming
// the classes of each, not a tensor's shape.
TEST_F(HostileInputTest, ResumingOntoDataWithMoreClassesNamesTheClasses) {
  const auto [images, labels] = tessera::test::writeIdxImages(scratch("idx"));
  std::string more = readText(labels);
  more[8] = 4;  // the first label: a fifth class
  const std::string moreLabels = scratch("labels-5-classes");
  writeText(moreLabels, more);
  const std::string yaml = config(
      "run: {name: classes, seed: 1, steps: 2, log_every: 1, eval_every: 0}\n"
      "log: {per_rank_files: false}\n"
      "model: {arch: dit, embed_dim: 16, layers: 1, heads: 2, patch_size: 4, timesteps: 10}\n"
      "data: {kind: idx, path: " + images + ", labels: " + labels + ", global_batch: 8, micro_batch: 8}\n"
      "eval: {sample_per_class: 1, sample_steps: 1}\n"
      "checkpoint: {async: false, export: []}\n");
  const std::string run = scratch("run");
  expectSuccess(kTrain + " --config " + yaml + " --set run.dir=" + run);
  expectRefused(kTrain + " --config " + yaml + " --set run.dir=" + run + " --set run.steps=4 --set data.labels=" +
                    moreLabels,
                {"the data has 5 classes (data.path)", "was trained on 4"});
}

}  // namespace
