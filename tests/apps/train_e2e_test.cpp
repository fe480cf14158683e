// End-to-end runs of tessera-train: a 2-rank run under tessera-run (each strategy)
// reproduces the single-process run's losses on the same global batch, and the
// trainer also runs under the real torchrun (python3 -m torch.distributed.run); resume,
// restart after SIGKILL and SIGTERM equal uninterrupted runs; the diffusion generator and
// the tensor classifier train the same sharded as in one process, and the shipped
// diffusion config learns its data.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "common/filesystem.h"
#include "tests/apps/train_runs.h"
#include "tests/support/run_command.h"
#include "tests/support/run_files.h"
#include "tests/support/scratch_path.h"
#include "trainer/metrics.h"

namespace {

namespace fs = std::filesystem;

using tessera::test::kBin;

// A fresh path in the temporary directory for this test (a run directory, or a file),
// removed once the test passed.
std::string uniqueDir(const std::string& tag) { return tessera::test::scratchPath("tessera_e2e", tag); }

int run(const std::string& command, std::string* output = nullptr) {
  const tessera::test::CommandResult r = tessera::test::runCommand(command, 300);
  if (output) *output = r.output;
  return r.status;
}

using tessera::test::readMetrics;

const std::string kArgs =
    " --config " + std::string(TESSERA_SOURCE_DIR) +
    "/configs/default.yaml --set run.steps=12 --set run.log_every=4 --set run.eval_every=12"
    " --set model.hidden=[48] --set data.global_batch=24 --set data.micro_batch=4"
    " --set log.per_rank_files=false --set optim.schedule.warmup_steps=3";

// tessera-train on 2 local ranks under tessera-run (append its arguments).
const std::string kLaunch2 = kBin + "/tessera-run --standalone --nproc-per-node 2 " + kBin + "/tessera-train";

void expectSameLosses(const std::vector<nlohmann::json>& a, const std::vector<nlohmann::json>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  ASSERT_FALSE(a.empty()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["step"], b[i]["step"]);
    for (const char* key : {"loss", "eval_loss", "eval_loss_ema"}) {
      if (!a[i].contains(key)) continue;
      ASSERT_TRUE(b[i].contains(key)) << what << " " << key;
      const double x = a[i][key], y = b[i][key];
      EXPECT_NEAR(x, y, 1e-5 * std::abs(x)) << what << ": " << key << " at step " << a[i]["step"];
    }
  }
}

TEST(TrainE2ETest, TwoRanksMatchOneProcessForEveryStrategy) {
  const std::string single = uniqueDir("single");
  std::string out;
  ASSERT_EQ(run(kBin + "/tessera-train" + kArgs + " --set run.dir=" + single, &out), 0) << out;
  const auto reference = readMetrics(single);
  ASSERT_TRUE(reference.back().contains("eval_loss_ema")) << out;
  EXPECT_TRUE(fs::exists(fs::path(single) / "loss.svg"));
  EXPECT_TRUE(fs::exists(fs::path(single) / "config.resolved.yaml"));
  for (const std::string strategy : {"no_shard", "zero1", "zero2", "zero3", "hybrid"}) {
    const std::string dir = uniqueDir(strategy);
    // hybrid on 2 ranks: shard groups of 1, replicated twice (shard_size 0 would be zero3).
    const std::string extra = strategy == "hybrid" ? " --set sharding.shard_size=1" : "";
    ASSERT_EQ(run(kBin + "/tessera-run --standalone --nproc-per-node 2 " + kBin + "/tessera-train" + kArgs +
                      " --set run.dir=" + dir + " --set sharding.strategy=" + strategy + extra,
                  &out),
              0)
        << out;
    expectSameLosses(reference, readMetrics(dir), strategy);
  }
  // zero3 with the gradients of the 3 micro-batches per rank reduced once, at the last
  // (every wrapped layer a unit, however small: two units to count).
  const std::string once = uniqueDir("zero3_reduce_once");
  ASSERT_EQ(run(kLaunch2 + kArgs + " --set run.dir=" + once +
                    " --set sharding.strategy=zero3 --set sharding.reduce_every_micro_batch=false --set log.level=debug"
                    " --set sharding.min_unit_params=0",
                &out),
            0)
      << out;
  expectSameLosses(reference, readMetrics(once), "zero3, reduced once per step");
  // Per log window of 4 steps: 2 units (layers.0, the root) x 4 steps, not x 3 micro-batches.
  EXPECT_NE(out.find("reduce_scatter 8 calls"), std::string::npos)
      << out;
}

// On one host the ranks exchange through shared memory (run.backend auto -> shm): the
// same bits as gloo's TCP loopback at two ranks (sums of two in either order), and the
// log names the backend.
TEST(TrainE2ETest, SharedMemoryAndGlooTrainTheSameBits) {
  const std::string shmDir = uniqueDir("shm"), glooDir = uniqueDir("gloo");
  std::string shmLog, glooLog;
  ASSERT_EQ(run(kLaunch2 + kArgs + " --set run.dir=" + shmDir, &shmLog), 0) << shmLog;
  ASSERT_EQ(run(kLaunch2 + kArgs + " --set run.dir=" + glooDir + " --set run.backend=gloo", &glooLog), 0) << glooLog;
  EXPECT_NE(shmLog.find("over 2 ranks (shm)"), std::string::npos) << shmLog;
  EXPECT_NE(glooLog.find("over 2 ranks (gloo)"), std::string::npos) << glooLog;
  const auto a = readMetrics(shmDir), b = readMetrics(glooDir);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    for (const char* key : {"loss", "eval_loss", "eval_loss_ema", "grad_norm"}) {
      if (!a[i].contains(key)) continue;
      ASSERT_TRUE(b[i].contains(key)) << key;
      EXPECT_EQ(a[i][key].get<double>(), b[i][key].get<double>()) << key << " at step " << a[i]["step"];
    }
  }
}

// data.kind tokens: the GPL-3 text rewritten as uint16 token ids trains exactly like
// the text itself (same samples, same order, same losses).
// fp32 products go through oneDNN (kernels/cpu_matmul.h), named at start with their speed;
// TESSERA_CPU_MATMUL=aten sends them to LibTorch's BLAS, and both train alike (the sums of
// the same products in another order); a value that is neither is refused at start.
TEST(TrainE2ETest, MatrixProductPathIsNamedAndEitherPathTrainsAlike) {
  const std::string oneDnnDir = uniqueDir("onednn"), atenDir = uniqueDir("aten");
  std::string oneDnnLog, atenLog, badLog;
  ASSERT_EQ(run(kBin + "/tessera-train" + kArgs + " --set run.dir=" + oneDnnDir, &oneDnnLog), 0) << oneDnnLog;
  ASSERT_EQ(run("TESSERA_CPU_MATMUL=aten " + kBin + "/tessera-train" + kArgs + " --set run.dir=" + atenDir, &atenLog), 0)
      << atenLog;
  EXPECT_NE(oneDnnLog.find("matrix products: oneDNN sgemm, "), std::string::npos) << oneDnnLog;
  EXPECT_NE(atenLog.find("matrix products: LibTorch ("), std::string::npos) << atenLog;
  expectSameLosses(readMetrics(oneDnnDir), readMetrics(atenDir), "oneDNN against LibTorch's BLAS");
  EXPECT_EQ(run("TESSERA_CPU_MATMUL=mkl " + kBin + "/tessera-train" + kArgs + " --set run.dir=" + uniqueDir("bad"), &badLog),
            2)
      << badLog;
  EXPECT_NE(badLog.find("TESSERA_CPU_MATMUL='mkl': expected onednn or aten"), std::string::npos) << badLog;
}

TEST(TrainE2ETest, TokenFileTrainsLikeTheSameTextFile) {
  std::ifstream text("/usr/share/common-licenses/GPL-3", std::ios::binary);
  ASSERT_TRUE(text.good());
  const std::string bytes{std::istreambuf_iterator<char>(text), std::istreambuf_iterator<char>()};
  const std::string tokenFile = uniqueDir("tokens.u16");
  {
    std::ofstream out(tokenFile, std::ios::binary);
    for (unsigned char c : bytes) out.put(static_cast<char>(c)).put('\0');  // little-endian uint16
  }
  const std::string textDir = uniqueDir("as_text"), tokenDir = uniqueDir("as_tokens");
  std::string out;
  const std::string args = kArgs + " --set run.steps=6 --set run.eval_every=6 --set checkpoint.every_steps=0";
  ASSERT_EQ(run(kBin + "/tessera-train" + args + " --set run.dir=" + textDir, &out), 0) << out;
  ASSERT_EQ(run(kBin + "/tessera-train" + args + " --set data.kind=tokens --set data.token_dtype=uint16 --set data.path=" +
                    tokenFile + " --set run.dir=" + tokenDir,
                &out),
            0)
      << out;
  const auto a = readMetrics(textDir), b = readMetrics(tokenDir);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i]["loss"], b[i]["loss"]) << "step " << a[i]["step"];
  // Read as uint32 the same file is wrong either way (an odd number of uint16 ids, or
  // ids beyond the vocabulary): a clear error naming the file, exit status 1.
  EXPECT_EQ(run(kBin + "/tessera-train" + args + " --set data.kind=tokens --set data.token_dtype=uint32 --set data.path=" +
                    tokenFile + " --set run.dir=" + uniqueDir("bad_tokens"),
                &out),
            1)
      << out;
  EXPECT_NE(out.find("dataset '" + tokenFile + "'"), std::string::npos) << out;
  std::remove(tokenFile.c_str());
}

TEST(TrainE2ETest, RunsUnderRealTorchrun) {
  const std::string python = TESSERA_PYTHON3;
  if (run(python + " -c 'import torch.distributed.run'") != 0) GTEST_SKIP() << python << " has no torch";
  const std::string dir = uniqueDir("torchrun");
  std::string out;
  // Debian's torch 1.13 on Python 3.11 mis-parses the default --redirects/--tee value 0
  // (IntFlag iteration changed in 3.11); 1 (stdout) parses correctly.
  const int status = run(python + " -m torch.distributed.run --nproc_per_node 2 --redirects 1 --tee 1 --no_python " +
                             kBin + "/tessera-train" + kArgs + " --set run.dir=" + dir,
                         &out);
  ASSERT_EQ(status, 0) << out;
  const auto metrics = readMetrics(dir);
  ASSERT_FALSE(metrics.empty()) << out;
  EXPECT_EQ(metrics.back()["step"], 12);
  EXPECT_NE(out.find("done: 12 steps"), std::string::npos) << out;
}

TEST(TrainE2ETest, FailingRankIsReportedByTheLauncher) {
  std::string out;
  const int status = run(kBin + "/tessera-run --standalone --nproc-per-node 2 " + kBin +
                             "/tessera-train --config " + std::string(TESSERA_SOURCE_DIR) +
                             "/configs/default.yaml --set data.path=/nonexistent/corpus.txt --set run.dir=" +
                             uniqueDir("fail"),
                         &out);
  EXPECT_NE(status, 0) << out;
  EXPECT_NE(out.find("/nonexistent/corpus.txt"), std::string::npos) << out;
}

}  // namespace

#include "checkpoint/safetensors.h"

namespace {

using tessera::test::exportOf;

// The GPT decoder (tied head, so the root unit holds the shared embedding) trains the
// same on 2 ranks under zero3 (blocks as units) as in one process.
TEST(TrainE2ETest, GptUnderZero3MatchesOneProcess) {
  const std::string args = kArgs +
                           " --set model.arch=gpt --set model.embed_dim=24 --set model.layers=2 --set model.heads=4"
                           " --set model.tie_head=true --set run.steps=8 --set run.eval_every=8 --set checkpoint.every_steps=0";
  const std::string single = uniqueDir("gpt_single"), sharded = uniqueDir("gpt_zero3");
  std::string out;
  ASSERT_EQ(run(kBin + "/tessera-train" + args + " --set sharding.strategy=no_shard --set run.dir=" + single, &out), 0)
      << out;
  ASSERT_EQ(run(kBin + "/tessera-run --standalone --nproc-per-node 2 " + kBin + "/tessera-train" + args +
                    " --set sharding.strategy=zero3 --set run.dir=" + sharded,
                &out),
            0)
      << out;
  expectSameLosses(readMetrics(single), readMetrics(sharded), "gpt zero3");
  const auto exported = exportOf(sharded);
  EXPECT_TRUE(exported.count("h.1.attn.c_attn.weight") && exported.count("wte.weight") && !exported.count("lm_head.weight"));

  // TensorBoard: the independent reader accepts every record, and every figure of every
  // metrics.jsonl line is there under its tag at its step, with its value (as a float).
  const auto tb = tessera::test::readTensorBoard(sharded + "/tb");
  ASSERT_TRUE(tb.ok) << tb.output;
  for (const char* tag : {"train/loss", "train/lr", "train/grad_norm", "perf/step_time_ms", "perf/samples_per_sec",
                          "perf/tokens_per_sec", "perf/tokens_per_sec_per_rank", "perf/tflops_per_rank", "perf/mfu",
                          "memory/peak_rss_mib", "comm/comm_mib", "comm/collectives_per_step", "comm/comm_wait_ms",
                          "memory/mem_total_mib", "memory/mem_optimizer_mib", "eval/eval_loss"}) {
    EXPECT_TRUE(tb.tags().count(tag)) << tag << "\n" << tb.output;
  }
  size_t figures = 0;
  for (const auto& line : readMetrics(sharded)) {
    // `time` is the row's clock, as every TensorBoard event's own wall_time is: not a figure.
    EXPECT_TRUE(line.contains("time")) << line.dump();
    for (const auto& [name, value] : line.items()) {
      if (name == "step" || name == "time") continue;
      ++figures;
      const std::string tag = tessera::trainer::tensorBoardTag(name);
      bool found = false;
      for (const auto& v : tb.values) {
        if (v["tag"] != tag || v["step"] != line["step"] || !v.contains("value")) continue;
        found = true;
        EXPECT_FLOAT_EQ(v["value"].get<float>(), static_cast<float>(value.get<double>())) << tag;
      }
      EXPECT_TRUE(found) << tag << " at step " << line["step"];
    }
  }
  EXPECT_EQ(tb.values.size(), figures);
}


// A constant LR: the first part of the interrupted run is started with run.steps=6, and
// a cosine schedule depends on run.steps.
const std::string kResumeArgs = kArgs + " --set checkpoint.async=false --set optim.schedule.kind=constant";


// The whole text of a file ("" if it cannot be read).
using tessera::test::readText;

// The model_ema exports of two runs are bitwise equal, tensor by tensor.
void expectBitwiseEqualExports(const std::string& referenceDir, const std::string& otherDir, const std::string& what) {
  const auto reference = exportOf(referenceDir);
  const auto other = exportOf(otherDir);
  ASSERT_EQ(reference.size(), other.size()) << what;
  for (const auto& [name, tensor] : reference) {
    ASSERT_TRUE(other.count(name)) << name << " (" << what << ")";
    EXPECT_TRUE(at::equal(tensor, other.at(name))) << name << " differs " << what;
  }
}

// Resume = uninterrupted: on the same world size bitwise, and at another world size
// with another strategy (2 ranks zero2 -> 3 ranks zero1) within float tolerance. The
// export also reads back in Python (python3-torch + the standard library).
TEST(TrainE2ETest, ResumeEqualsUninterruptedRun) {
  std::string out;
  const std::string& launch2 = kLaunch2;
  const std::string launch3 = kBin + "/tessera-run --standalone --nproc-per-node 3 " + kBin + "/tessera-train";
  const std::string full = uniqueDir("full");
  ASSERT_EQ(run(launch2 + kResumeArgs + " --set sharding.strategy=zero2 --set run.dir=" + full, &out), 0) << out;

  const std::string same = uniqueDir("same");
  ASSERT_EQ(run(launch2 + kResumeArgs + " --set sharding.strategy=zero2 --set run.steps=6 --set run.dir=" + same, &out), 0)
      << out;
  ASSERT_EQ(run(launch2 + kResumeArgs + " --set sharding.strategy=zero2 --set run.dir=" + same, &out), 0) << out;
  EXPECT_NE(out.find("resumed from"), std::string::npos) << out;

  const std::string other = uniqueDir("other");
  ASSERT_EQ(run(launch2 + kResumeArgs + " --set sharding.strategy=zero2 --set run.steps=6 --set run.dir=" + other, &out), 0)
      << out;
  ASSERT_EQ(run(launch3 + kResumeArgs + " --set sharding.strategy=zero1 --set run.dir=" + other, &out), 0) << out;
  EXPECT_NE(out.find("saved by 2 ranks with zero2; now 3 ranks with zero1"), std::string::npos) << out;

  // Saved by zero3 (parameters sharded in units) on 2 ranks, resumed by zero2 on 3.
  const std::string fromZero3 = uniqueDir("from_zero3");
  ASSERT_EQ(run(launch2 + kResumeArgs + " --set sharding.strategy=zero3 --set run.steps=6 --set run.dir=" + fromZero3,
                &out),
            0)
      << out;
  ASSERT_EQ(run(launch3 + kResumeArgs + " --set sharding.strategy=zero2 --set run.dir=" + fromZero3, &out), 0) << out;
  EXPECT_NE(out.find("saved by 2 ranks with zero3; now 3 ranks with zero2"), std::string::npos) << out;

  // Saved by hybrid (shard groups of 1, replicated twice: the first group writes) on 2
  // ranks, resumed by zero3 on 2.
  const std::string fromHybrid = uniqueDir("from_hybrid");
  ASSERT_EQ(run(launch2 + kResumeArgs + " --set sharding.strategy=hybrid --set sharding.shard_size=1"
                    " --set run.steps=6 --set run.dir=" + fromHybrid,
                &out),
            0)
      << out;
  ASSERT_EQ(run(launch2 + kResumeArgs + " --set sharding.strategy=zero3 --set run.dir=" + fromHybrid, &out), 0) << out;
  EXPECT_NE(out.find("saved by 2 ranks with hybrid; now 2 ranks with zero3"), std::string::npos) << out;
  const auto hybridWorld = exportOf(fromHybrid);

  const auto reference = exportOf(full);
  const auto sameWorld = exportOf(same);
  const auto otherWorld = exportOf(other);
  const auto zero3World = exportOf(fromZero3);
  ASSERT_EQ(reference.size(), 5u);  // embed.weight, layers.0.{weight,bias}, head.{weight,bias}
  for (const auto& [name, tensor] : reference) {
    ASSERT_TRUE(sameWorld.count(name) && otherWorld.count(name) && zero3World.count(name)) << name;
    EXPECT_TRUE(at::equal(tensor, sameWorld.at(name))) << name << ": same-world resume is not bitwise equal";
    EXPECT_TRUE(at::allclose(tensor, otherWorld.at(name), 1e-5, 1e-6)) << name;
    EXPECT_TRUE(at::allclose(tensor, zero3World.at(name), 1e-5, 1e-6)) << name << ": zero3 -> zero2 resume";
    ASSERT_TRUE(hybridWorld.count(name)) << name;
    EXPECT_TRUE(at::allclose(tensor, hybridWorld.at(name), 1e-5, 1e-6)) << name << ": hybrid -> zero3 resume";
  }

  // An independent reader: Python's standard library for the format, torch for values.
  const std::string python = TESSERA_PYTHON3;
  if (run(python + " -c 'import torch'") != 0) GTEST_SKIP() << python << " has no torch";
  const fs::path script = uniqueDir("read_safetensors.py");
  std::ofstream(script) << R"PY(
import json, struct, sys, torch
data = open(sys.argv[1], 'rb').read()
n = struct.unpack('<Q', data[:8])[0]
assert n % 8 == 0, n
header = json.loads(data[8:8 + n])
assert header['__metadata__']['format'] == 'pt'
body = data[8 + n:]
end = 0
for name, info in sorted(((k, v) for k, v in header.items() if k != '__metadata__'), key=lambda kv: kv[1]['data_offsets']):
    begin, stop = info['data_offsets']
    assert begin == end, (name, begin, end)
    end = stop
    assert info['dtype'] == 'F32'
    t = torch.frombuffer(bytearray(body[begin:stop]), dtype=torch.float32).reshape(info['shape'])
    print(name, list(t.shape), repr(float(t.double().sum())))
assert end == len(body)
)PY";
  // The export of the run saved at world size 2 with zero3 and resumed at 3 with zero2.
  ASSERT_EQ(run(python + " " + script.string() + " " + (fs::path(fromZero3) / "export" / "model_ema.safetensors").string(),
                &out),
            0)
      << out;
  for (const auto& [name, tensor] : zero3World) {
    std::ostringstream shape;
    shape << "[";
    for (int64_t i = 0; i < tensor.dim(); ++i) shape << (i ? ", " : "") << tensor.size(i);
    shape << "]";
    const auto pos = out.find(name + " " + shape.str() + " ");
    ASSERT_NE(pos, std::string::npos) << name << " " << shape.str() << " not in:\n" << out;
    const double pythonSum = std::stod(out.substr(pos + name.size() + shape.str().size() + 2));
    EXPECT_NEAR(pythonSum, tensor.to(at::kDouble).sum().item<double>(), 1e-9) << name;
  }
}

}  // namespace

namespace {

// A rank SIGKILLed in the middle of a run: tessera-run --max-restarts 1 restarts both
// ranks, they resume from the latest complete checkpoint, and the final generator_ema
// equals that of a run that was never interrupted.
TEST(TrainE2ETest, KilledRankIsRestartedAndResumes) {
  const std::string args = kResumeArgs + " --set run.steps=150 --set run.log_every=50 --set run.eval_every=0" +
                           " --set checkpoint.every_steps=5 --set checkpoint.keep_last=2";
  std::string out;
  const std::string full = uniqueDir("uninterrupted");
  ASSERT_EQ(run(kLaunch2 + args + " --set run.dir=" + full, &out), 0) << out;

  const std::string dir = uniqueDir("killed");
  const fs::path log = uniqueDir("killed.log");
  const fs::path rcPath = uniqueDir("killed.rc");
  // Start the run in the background, wait for its step-10 checkpoint, SIGKILL the newest
  // tessera-train process of this run (one rank), then wait for the launcher.
  const std::string script =
      "( " + kBin + "/tessera-run --standalone --max-restarts 1 --nproc-per-node 2 " + kBin + "/tessera-train" + args +
      " --set run.dir=" + dir + " > " + log.string() + " 2>&1; echo $? > " + rcPath.string() + " ) & " +
      "for i in $(seq 1 3000); do [ -d " + dir + "/checkpoints/step_00000010 ] && break; sleep 0.01; done; " +
      "pkill -KILL -n -f 'tessera-train.*" + dir + "' && echo killed; wait";
  const fs::path scriptFile = uniqueDir("killed.sh");
  std::ofstream(scriptFile) << script << "\n";
  ASSERT_EQ(run("bash " + scriptFile.string(), &out), 0) << out;
  EXPECT_NE(out.find("killed"), std::string::npos) << "the run finished before a rank could be killed";
  std::ifstream rcFile(rcPath);
  int rc = -1;
  rcFile >> rc;
  const std::string logText = readText(log);
  EXPECT_EQ(rc, 0) << logText;
  EXPECT_NE(logText.find("SIGKILL"), std::string::npos) << logText;
  EXPECT_NE(logText.find("resumed from"), std::string::npos) << logText;
  expectBitwiseEqualExports(full, dir, "after the restart");
}

}  // namespace

namespace {

// SIGTERM to the launcher (a preempted job): the ranks stop at the same step, save a
// checkpoint of that very step, and a resumed run ends where an uninterrupted one does.
TEST(TrainE2ETest, SigtermSavesTheCurrentStepAndResumes) {
  const std::string args = kResumeArgs + " --set run.steps=200 --set run.log_every=50 --set run.eval_every=0" +
                           " --set checkpoint.every_steps=0";
  std::string out;
  const std::string full = uniqueDir("uninterrupted");
  ASSERT_EQ(run(kLaunch2 + args + " --set run.dir=" + full, &out), 0) << out;

  const std::string dir = uniqueDir("preempted");
  const fs::path log = uniqueDir("term.log");
  // Wait until training logs its first metrics line, then SIGTERM the launcher.
  const std::string script =
      kBin + "/tessera-run --standalone --nproc-per-node 2 " + kBin + "/tessera-train" + args + " --set run.dir=" + dir +
      " > " + log.string() + " 2>&1 & pid=$!\n" +
      "for i in $(seq 1 3000); do [ -s " + dir + "/metrics.jsonl ] && break; sleep 0.01; done\n" +
      "kill -TERM $pid; wait $pid; echo launcher exit $?\n";
  const fs::path scriptFile = uniqueDir("term.sh");
  std::ofstream(scriptFile) << script;
  ASSERT_EQ(run("bash " + scriptFile.string(), &out), 0) << out;
  const std::string logText = readText(log);
  ASSERT_NE(logText.find("stopping at step"), std::string::npos) << out << logText;
  const auto checkpoints = [&] {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(fs::path(dir) / "checkpoints")) names.push_back(e.path().filename());
    return names;
  }();
  bool found = false;
  for (const auto& n : checkpoints) found |= n.rfind("step_", 0) == 0 && n.find(".tmp") == std::string::npos;
  ASSERT_TRUE(found) << "no complete checkpoint after SIGTERM:\n" << logText;

  ASSERT_EQ(run(kLaunch2 + args + " --set run.dir=" + dir, &out), 0) << out;
  EXPECT_NE(out.find("resumed from"), std::string::npos) << out;
  expectBitwiseEqualExports(full, dir, "after the preemption");
}

// model.init_from: a run starts from another run's exported weights — one file, or a
// sharded export (*.index.json) — each of its 2 zero3 ranks reading its own rows, and its
// EMA starts there too; a file that does not fit the model is refused (exit 1, the file
// and the problem named).
TEST(TrainE2ETest, ModelInitFromAnExport) {
  std::string out;
  const std::string source = uniqueDir("source");
  ASSERT_EQ(run(kBin + "/tessera-train" + kResumeArgs + " --set run.steps=6 --set checkpoint.export=[model]" +
                    " --set run.dir=" + source,
                &out),
            0)
      << out;
  const std::string file = (fs::path(source) / "export" / "model.safetensors").string();
  const std::string shardedDir = uniqueDir("sharded_export");
  ASSERT_EQ(run(kBin + "/tessera-export " + source + "/checkpoints --what model --max-shard-size 40KB --out " + shardedDir,
                &out),
            0)
      << out;
  const std::string index = (fs::path(shardedDir) / "model.safetensors.index.json").string();
  ASSERT_TRUE(fs::exists(index)) << out;
  const auto weights = tessera::checkpoint::loadSafetensors(file);

  // One step at a learning rate too small to move an fp32 weight by more than 1e-9: the
  // exported model is the file's weights, and the EMA too (within the rounding of one
  // blend of equal values); a fresh init differs by ~1e-2.
  const std::string still = " --set run.steps=1 --set optim.lr=1e-12 --set optim.weight_decay=0"
                            " --set optim.schedule.warmup_steps=0 --set optim.schedule.min_lr=0"
                            " --set checkpoint.export=[model,generator_ema]";
  for (const std::string& from : {file, index}) {
    const std::string dir = uniqueDir("started");
    ASSERT_EQ(run(kLaunch2 + kResumeArgs + still + " --set sharding.strategy=zero3 --set model.init_from=" + from +
                      " --set run.dir=" + dir,
                  &out),
              0)
        << out;
    EXPECT_NE(out.find("model initialised from " + from), std::string::npos) << out;
    for (const char* what : {"model", "generator_ema"}) {
      const auto got = tessera::checkpoint::loadSafetensors((fs::path(dir) / "export" / (std::string(what) + ".safetensors")).string());
      ASSERT_EQ(got.size(), weights.size()) << what;
      for (const auto& [name, w] : weights) {
        const double tolerance = std::string(what) == "model" ? 1e-9 : 1e-6 * w.abs().max().item<double>();
        EXPECT_LE((got.at(name) - w).abs().max().item<double>(), tolerance) << what << " " << name << " from " << from;
      }
    }
  }

  // A resumed run keeps the checkpoint's weights: model.init_from is not even opened.
  const std::string resumed = uniqueDir("resumed");
  ASSERT_EQ(run(kBin + "/tessera-train" + kResumeArgs + " --set run.steps=4 --set run.stop_after_steps=2 --set run.dir=" +
                    resumed,
                &out),
            0)
      << out;
  ASSERT_EQ(run(kBin + "/tessera-train" + kResumeArgs + " --set run.steps=4 --set model.init_from=" + file + ".missing" +
                    " --set run.dir=" + resumed,
                &out),
            0)
      << out;
  EXPECT_NE(out.find("resumed from"), std::string::npos) << out;
  EXPECT_EQ(out.find("initialised from"), std::string::npos) << out;

  // A model of another size: a config error naming the key, every mismatched shape listed,
  // the file named, exit 2.
  const std::string bad = uniqueDir("bad");
  EXPECT_EQ(run(kBin + "/tessera-train" + kResumeArgs + still + " --set model.hidden=[40] --set model.init_from=" + file +
                    " --set run.dir=" + bad,
                &out),
            2)
      << out;
  EXPECT_NE(out.find("model.init_from: importSafetensors: " + file + " does not match the model"), std::string::npos)
      << out;
  EXPECT_NE(out.find("layers.0.weight: file has [48, 512], expected [40, 512]"), std::string::npos) << out;
  EXPECT_EQ(run(kBin + "/tessera-train" + kResumeArgs + still + " --set model.init_from=" + file + ".missing" +
                    " --set run.dir=" + bad,
                &out),
            2)
      << out;
  EXPECT_NE(out.find(file + ".missing"), std::string::npos) << out;
}

// How often step `step` was saved, from rank 0's log lines (sync or async saves).
int savesOf(const std::string& log, int64_t step) {
  int count = 0;
  for (const std::string& line :
       {"checkpoint step " + std::to_string(step) + ": async save started", "checkpoint step " + std::to_string(step) + " saved in"}) {
    for (size_t at = log.find(line); at != std::string::npos; at = log.find(line, at + 1)) ++count;
  }
  return count;
}

// A periodic save on the step where the run stops (run.stop_after_steps, SIGTERM) or
// ends (checkpoint.at_end) saves that step once.
TEST(TrainE2ETest, EveryStepIsSavedOnceWhateverFallsOnIt) {
  std::string out;
  const std::string args = kArgs + " --set run.log_every=1 --set checkpoint.every_steps=3 --set checkpoint.keep_last=0";
  // stop_after_steps on a periodic step, then the end on one.
  const std::string dir = uniqueDir("stop_after");
  ASSERT_EQ(run(kBin + "/tessera-train" + args + " --set run.stop_after_steps=6 --set run.dir=" + dir, &out), 0) << out;
  EXPECT_EQ(savesOf(out, 3), 1) << out;
  EXPECT_EQ(savesOf(out, 6), 1) << out;
  ASSERT_EQ(run(kBin + "/tessera-train" + args + " --set run.dir=" + dir, &out), 0) << out;
  EXPECT_EQ(savesOf(out, 9), 1) << out;
  EXPECT_EQ(savesOf(out, 12), 1) << out;

  // SIGTERM while every step is saved: the stop's save is that step's periodic save.
  const std::string termDir = uniqueDir("sigterm");
  const std::string termArgs = kResumeArgs + " --set run.steps=400 --set run.log_every=1 --set checkpoint.every_steps=1" +
                               " --set checkpoint.keep_last=2 --set run.dir=" + termDir;
  const fs::path log = fs::temp_directory_path() / ("tessera_saves_" + std::to_string(::getpid()) + ".log");
  const std::string script = kLaunch2 + termArgs + " > " + log.string() + " 2>&1 & pid=$!\n" +
                             "for i in $(seq 1 3000); do [ -s " + termDir +
                             "/metrics.jsonl ] && break; sleep 0.01; done\n" + "kill -TERM $pid; wait $pid; echo launcher exit $?\n";
  const fs::path scriptFile = fs::temp_directory_path() / ("tessera_saves_" + std::to_string(::getpid()) + ".sh");
  std::ofstream(scriptFile) << script;
  ASSERT_EQ(run("bash " + scriptFile.string(), &out), 0) << out;
  const std::string logText = readText(log);
  const size_t stop = logText.find("stopping at step ");
  ASSERT_NE(stop, std::string::npos) << logText;
  const int64_t stoppedAt = std::stoll(logText.substr(stop + std::string("stopping at step ").size()));
  ASSERT_LT(stoppedAt, 400) << logText;
  for (int64_t step = 1; step <= stoppedAt; ++step) EXPECT_EQ(savesOf(logText, step), 1) << "step " << step << "\n" << logText;
  fs::remove(log);
  fs::remove(scriptFile);
}

}  // namespace

namespace {

using tessera::test::kSource;

// configs/diffusion.yaml, shortened: few steps and noise levels, a width (31) and a
// global batch whose shards do not divide evenly over 3 ranks.
const std::string kDiffusionArgs =
    " --config " + kSource + "/configs/diffusion.yaml --set data.path=" + kSource + "/data/rings.safetensors" +
    " --set run.steps=10 --set run.log_every=5 --set run.eval_every=10 --set model.embed_dim=31"
    " --set model.timesteps=40 --set model.samples=50 --set data.global_batch=24 --set data.micro_batch=4"
    " --set checkpoint.every_steps=0 --set log.per_rank_files=false --set optim.schedule.warmup_steps=3";

// The diffusion generator trains the same on 3 ranks under zero3 and on 4 under hybrid as
// in one process (the noise each sample draws does not depend on the rank or the
// micro-batch); both EMA
// decays are exported under the denoiser's names, and the samples drawn with
// generator_ema at the end agree.
TEST(TrainE2ETest, DiffusionShardedMatchesOneProcess) {
  const std::string single = uniqueDir("single"), sharded = uniqueDir("zero3");
  std::string out;
  ASSERT_EQ(run(kBin + "/tessera-train" + kDiffusionArgs + " --set sharding.strategy=no_shard --set run.dir=" + single,
                &out),
            0)
      << out;
  ASSERT_EQ(run(kBin + "/tessera-run --standalone --nproc-per-node 3 " + kBin + "/tessera-train" + kDiffusionArgs +
                    " --set sharding.strategy=zero3 --set run.dir=" + sharded,
                &out),
            0)
      << out;
  EXPECT_NE(out.find("samples: 50 drawn with generator_ema"), std::string::npos) << out;
  const auto reference = readMetrics(single);
  ASSERT_TRUE(reference.back().contains("eval_loss_ema")) << out;
  expectSameLosses(reference, readMetrics(sharded), "diffusion zero3 on 3 ranks");
  // 4 ranks as 2 x 2 hybrid, with micro-batches of 2 instead of 4: other ranks and other
  // micro-batches hold each sample, and it still draws the same noise.
  const std::string hybrid = uniqueDir("hybrid");
  ASSERT_EQ(run(kBin + "/tessera-run --standalone --nproc-per-node 4 " + kBin + "/tessera-train" + kDiffusionArgs +
                    " --set sharding.strategy=hybrid --set sharding.shard_size=2 --set data.micro_batch=2 --set run.dir=" +
                    hybrid,
                &out),
            0)
      << out;
  expectSameLosses(reference, readMetrics(hybrid), "diffusion hybrid 2 x 2, other micro-batches");

  for (const std::string name : {"generator_ema", "generator_ema_0.999"}) {
    const auto path = [&](const std::string& dir) { return (fs::path(dir) / "export" / (name + ".safetensors")).string(); };
    const auto a = tessera::checkpoint::loadSafetensors(path(single));
    const auto b = tessera::checkpoint::loadSafetensors(path(sharded));
    ASSERT_EQ(a.size(), 10u + 3u * 8u) << name;  // time_embed x4, input_proj x2, 3 blocks x 8, out_norm x2, output_proj x2
    ASSERT_TRUE(a.count("blocks.2.fc1.weight")) << name;
    EXPECT_EQ(a.at("blocks.2.fc1.weight").sizes(), (c10::IntArrayRef{124, 31}));
    EXPECT_EQ(a.at("input_proj.weight").sizes(), (c10::IntArrayRef{31, 2}));
    for (const auto& [tensor, value] : a) {
      ASSERT_TRUE(b.count(tensor)) << name << " " << tensor;
      EXPECT_TRUE(at::allclose(value, b.at(tensor), 1e-5, 1e-6)) << name << " " << tensor;
    }
  }
  const auto fast = tessera::checkpoint::loadSafetensors((fs::path(single) / "export" / "generator_ema.safetensors").string());
  const auto slow =
      tessera::checkpoint::loadSafetensors((fs::path(single) / "export" / "generator_ema_0.999.safetensors").string());
  EXPECT_FALSE(at::equal(fast.at("output_proj.weight"), slow.at("output_proj.weight")));  // two decays, two EMAs

  const at::Tensor samples =
      tessera::checkpoint::loadSafetensors((fs::path(single) / "samples.safetensors").string()).at("samples");
  EXPECT_EQ(samples.sizes(), (c10::IntArrayRef{50, 2}));
  EXPECT_TRUE(samples.isfinite().all().item<bool>());
  const at::Tensor shardedSamples =
      tessera::checkpoint::loadSafetensors((fs::path(sharded) / "samples.safetensors").string()).at("samples");
  EXPECT_TRUE(at::allclose(samples, shardedSamples, 1e-4, 1e-4)) << (samples - shardedSamples).abs().max();
}

// The shipped diffusion config (run from another directory, so with data.path made
// absolute) learns the data:
// the radii of the points generator_ema samples are distributed like the data's
// (1-Wasserstein distance between the radius distributions well below that of the
// Gaussian the sampler starts from: ~0.14 against ~0.32 when this test was written; a
// second draw of the data itself scores ~0.03), every ring gets its share, and the cloud
// is centred. A small model after 600 steps: blurred rings, not sharp ones.
TEST(TrainE2ETest, DiffusionConfigLearnsTheRings) {
  const std::string dir = uniqueDir("rings");
  std::string out;
  ASSERT_EQ(run(kBin + "/tessera-run --standalone --nproc-per-node 2 " + kBin + "/tessera-train --config " + kSource +
                    "/configs/diffusion.yaml --set data.path=" + kSource +
                    "/data/rings.safetensors --set log.per_rank_files=false --set run.dir=" + dir,
                &out),
            0)
      << out;
  const at::Tensor samples =
      tessera::checkpoint::loadSafetensors((fs::path(dir) / "samples.safetensors").string()).at("samples");
  ASSERT_EQ(samples.sizes(), (c10::IntArrayRef{512, 2}));
  const at::Tensor data = tessera::checkpoint::loadSafetensors(kSource + "/data/rings.safetensors").at("inputs");
  const at::Tensor dataRadii = std::get<0>(data.norm(2, 1).sort());
  // Mean |r_i - q_i| over the sorted radii r and the data's radius quantiles q at the same ranks.
  const auto radiusDistance = [&](const at::Tensor& points) {
    const at::Tensor radii = std::get<0>(points.norm(2, 1).sort());
    const at::Tensor ranks = (at::linspace(0, 1, radii.size(0)) * (dataRadii.size(0) - 1)).round().to(at::kLong);
    return (radii - dataRadii.index_select(0, ranks)).abs().mean().item<double>();
  };
  const double learned = radiusDistance(samples);
  const double gaussian = radiusDistance(at::randn({512, 2}, at::make_generator<at::CPUGeneratorImpl>(1)));
  EXPECT_LT(learned, 0.2) << "radius distance of the samples " << learned << " (the starting Gaussian's: " << gaussian
                          << ")";
  EXPECT_GT(gaussian, 0.25);
  const at::Tensor radius = samples.norm(2, 1);
  for (double ring : {0.5, 1.0, 1.5}) {
    EXPECT_GT(((radius - ring).abs() < 0.15).to(at::kDouble).mean().item<double>(), 0.08) << "ring " << ring;
  }
  EXPECT_LT(samples.mean(0).abs().max().item<double>(), 0.15) << samples.mean(0);
  EXPECT_TRUE(fs::exists(fs::path(dir) / "export" / "generator_ema_0.999.safetensors"));
}

// An MLP classifier on the rings' class ids (data.kind tensors, integer targets,
// cross-entropy), file order: 2 ranks under zero2 equal one process.
TEST(TrainE2ETest, TensorClassifierOnTwoRanksMatchesOneProcess) {
  const std::string args = kArgs + " --set model.arch=mlp --set data.kind=tensors --set data.path=" + kSource +
                           "/data/rings.safetensors --set data.shuffle=false --set checkpoint.every_steps=0";
  const std::string single = uniqueDir("single"), sharded = uniqueDir("zero2");
  std::string out;
  ASSERT_EQ(run(kBin + "/tessera-train" + args + " --set sharding.strategy=no_shard --set run.dir=" + single, &out), 0)
      << out;
  EXPECT_NE(out.find("class targets (3 classes)"), std::string::npos) << out;
  ASSERT_EQ(run(kLaunch2 + args + " --set sharding.strategy=zero2 --set run.dir=" + sharded, &out), 0) << out;
  expectSameLosses(readMetrics(single), readMetrics(sharded), "tensor classifier zero2");
  const auto exported = exportOf(sharded);
  ASSERT_TRUE(exported.count("layers.0.weight") && exported.count("head.weight"));
  EXPECT_EQ(exported.at("layers.0.weight").sizes(), (c10::IntArrayRef{48, 2}));
  EXPECT_EQ(exported.at("head.weight").sizes(), (c10::IntArrayRef{3, 48}));
  EXPECT_FALSE(exported.count("embed.weight"));
}

}  // namespace

// ema.posthoc through the programs: a 2-rank zero3 run snapshots its power-function
// profiles, `tessera-export --list` shows them, `--posthoc-ema` at a tracked sigma_rel
// gives back the profile the run's checkpoint holds, a run resumed on another world size
// and strategy reconstructs like the uninterrupted one, and bad requests and a config
// without snapshots are refused naming the key.
TEST(TrainE2ETest, PosthocEmaSnapshotsReconstructOffline) {
  const std::string dir = uniqueDir("posthoc");
  std::string out;
  ASSERT_EQ(run(kLaunch2 + kArgs + " --set run.dir=" + dir +
                    " --set sharding.strategy=zero3 --set ema.posthoc.stds=[0.05,0.1] --set ema.posthoc.snapshot_every=5",
                &out),
            0)
      << out;
  // Every 5 steps and the last (12): the reconstruction below is at the run's end.
  ASSERT_EQ(run(kBin + "/tessera-export " + dir + " --list", &out), 0) << out;
  EXPECT_NE(out.find("3 snapshots, steps 5 to 12"), std::string::npos) << out;
  EXPECT_NE(out.find("[0.05, 0.1]"), std::string::npos) << out;
  const std::string posthoc = dir + "/phema0.1.safetensors", tracked = dir + "/tracked.safetensors";
  ASSERT_EQ(run(kBin + "/tessera-export " + dir + " --posthoc-ema 0.1 --out " + posthoc, &out), 0) << out;
  ASSERT_EQ(run(kBin + "/tessera-export " + dir + "/checkpoints --what generator_ema_phema0.1 --out " + tracked, &out), 0)
      << out;
  const auto a = tessera::checkpoint::loadSafetensors(posthoc), b = tessera::checkpoint::loadSafetensors(tracked);
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : b) {
    ASSERT_TRUE(a.count(name)) << name;
    EXPECT_TRUE(at::allclose(a.at(name), t, 1e-5, 1e-7)) << name;
  }
  // Resumed on another world size with another strategy (2 ranks zero3 -> 1 process
  // zero2), the profiles continue from the checkpoint and the snapshots go on: the
  // reconstruction equals the uninterrupted run's.
  const std::string posthocArgs = kResumeArgs + " --set ema.posthoc.stds=[0.05,0.1] --set ema.posthoc.snapshot_every=2";
  const std::string full = uniqueDir("posthoc_full"), resumed = uniqueDir("posthoc_resumed");
  ASSERT_EQ(run(kLaunch2 + posthocArgs + " --set sharding.strategy=zero3 --set run.dir=" + full, &out), 0) << out;
  ASSERT_EQ(run(kLaunch2 + posthocArgs + " --set sharding.strategy=zero3 --set run.steps=6 --set run.dir=" + resumed, &out),
            0)
      << out;
  ASSERT_EQ(run(kBin + "/tessera-train" + posthocArgs + " --set sharding.strategy=zero2 --set run.dir=" + resumed, &out), 0)
      << out;
  EXPECT_NE(out.find("saved by 2 ranks with zero3; now 1 ranks with zero2"), std::string::npos) << out;
  for (const std::string& d : {full, resumed}) {
    ASSERT_EQ(run(kBin + "/tessera-export " + d + " --posthoc-ema 0.07 --out " + d + "/phema0.07.safetensors", &out), 0)
        << out;
    EXPECT_NE(out.find("from 6 snapshots"), std::string::npos) << out;
  }
  const auto fullPosthoc = tessera::checkpoint::loadSafetensors(full + "/phema0.07.safetensors");
  const auto resumedPosthoc = tessera::checkpoint::loadSafetensors(resumed + "/phema0.07.safetensors");
  for (const auto& [name, t] : fullPosthoc) {
    EXPECT_TRUE(at::allclose(resumedPosthoc.at(name), t, 1e-5, 1e-6)) << name;
  }

  // Bad requests: exit 2 with the reason; a config tracking profiles without snapshots.
  EXPECT_EQ(run(kBin + "/tessera-export " + dir + " --posthoc-ema 0.5 --out " + dir + "/x.safetensors", &out), 2) << out;
  EXPECT_NE(out.find("sigma_rel must be in [1e-06, 0.28)"), std::string::npos) << out;
  EXPECT_EQ(run(kBin + "/tessera-export " + dir + " --posthoc-ema 1e-160 --out " + dir + "/x.safetensors", &out), 2) << out;
  // A profile whose sigma_rel^-2 overflows would train an all-NaN EMA: refused at the key.
  EXPECT_EQ(run(kBin + "/tessera-train" + kArgs + " --set run.dir=" + dir + "_tiny --set ema.posthoc.stds=[1e-160]" +
                    " --set ema.posthoc.snapshot_every=2", &out),
            2)
      << out;
  EXPECT_NE(out.find("ema.posthoc.stds"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(dir + "_tiny/export"));
  EXPECT_EQ(run(kBin + "/tessera-export " + dir + " --posthoc-ema 0.1 --at-step 1 --out " + dir + "/x.safetensors", &out),
            2)
      << out;
  EXPECT_EQ(run(kBin + "/tessera-train" + kArgs + " --set run.dir=" + dir + "_bad --set ema.posthoc.stds=[0.05]", &out), 2)
      << out;
  EXPECT_NE(out.find("ema.posthoc.snapshot_every"), std::string::npos) << out;
  // A run with checkpoints and no snapshots: the one reason, not a warning about the
  // snapshots' model before it.
  const std::string noSnapshots = dir + "_nosnap";
  fs::create_directories(noSnapshots);
  fs::copy(dir + "/checkpoints", noSnapshots + "/checkpoints", fs::copy_options::recursive);
  EXPECT_EQ(run(kBin + "/tessera-export " + noSnapshots + " --posthoc-ema 0.1 --out " + noSnapshots + "/x.safetensors",
                &out),
            2)
      << out;
  EXPECT_NE(out.find("no post-hoc EMA snapshots in " + noSnapshots), std::string::npos) << out;
  EXPECT_EQ(out.find("warning"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(noSnapshots + "/x.safetensors"));
}
