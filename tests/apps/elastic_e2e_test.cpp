// Elastic runs, end to end on loopback: two launchers of 2 ranks meet with --nnodes 1:2;
// one is SIGKILLed mid-run; the other rendezvouses again without it, resumes the 4-rank
// checkpoint on 2 ranks with the same global batch, finishes, and its final export equals
// an uninterrupted 4-rank run's (within float tolerance: the sums of another world size).
// The same under the real torchrun (--nnodes 1:2 --rdzv_backend c10d), when python3-torch
// is installed. Also the launcher's refusals of elastic options.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <regex>

#include "checkpoint/safetensors.h"
#include "common/errors.h"
#include "tests/support/free_port.h"
#include "tests/apps/train_runs.h"
#include "tests/support/run_command.h"
#include "tests/support/scratch_path.h"

namespace {

namespace fs = std::filesystem;
using tessera::strCat;
using tessera::test::CommandResult;
using tessera::test::runCommand;
using tessera::test::shellQuote;

using tessera::test::kBin;
// 4 ranks: 2 micro-batches of 4 each; 2 ranks: 4. A checkpoint every 20 steps.
const std::string kTrainArgs = strCat(" --config ", TESSERA_SOURCE_DIR,
                                      "/configs/default.yaml --set run.steps=300 --set model.hidden=[48]"
                                      " --set data.global_batch=32 --set data.micro_batch=4 --set checkpoint.every_steps=20"
                                      " --set log.per_rank_files=false --set run.log_every=20");

using tessera::test::exportOf;

// This test's block of seven ports (each test of the suite uses its own offset in it).
int freePort() {
  static const int base = tessera::test::freePorts(7);
  return base;
}

// How a node is lost: what each node's trainer gets besides kTrainArgs, the checkpoint
// directory (under the test's directory) whose first 4-rank step at or after killAtStep
// sets off the kill, and what follows the kill. Waiting for a 4-rank step, not a step
// number, matters on a loaded machine: node B's launcher can join after A's last call,
// and A then trains alone first and writes early steps on 2 ranks.
struct NodeLoss {
  std::string argsA, argsB;
  std::string killWhenStepIn = "/run/checkpoints";
  int killAtStep = 40;
  std::string afterKill;
};

// A shell test, true once `stepsDir` holds a step >= minStep whose metadata is written and
// that has rank 3's file (a 4-rank step; a node-local directory holds it as a replica).
std::string fourRankStepScript(const std::string& stepsDir, int minStep) {
  return strCat("ready=; for m in ", shellQuote(stepsDir), "/step_*/metadata.json; do s=${m%/metadata.json}; ",
                "[ -e \"$s/rank_00003.bin\" ] && [ $(expr \"${s##*/step_}\" + 0) -ge ", minStep,
                " ] && ready=1; done; [ -n \"$ready\" ]");
}

// Starts node A, then node B once A hosts the rendezvous on `port` (each `launch` + the
// trainer), waits for a 4-rank step in loss.killWhenStepIn, SIGKILLs what `killB` names,
// and waits for A. A's output goes to a.log. B must not host: the store would go with it.
CommandResult loseANode(const std::string& dir, const std::string& launch, int port, const std::string& killB,
                        const NodeLoss& loss = {}) {
  const std::string d = shellQuote(dir);
  const std::string train = kBin + "/tessera-train" + kTrainArgs + " --set run.dir=" + d + "/run";
  const std::string script =
      "mkdir -p " + d + "; " + launch + " " + train + loss.argsA + " > " + d + "/a.log 2>&1 & A=$!; " +
      tessera::test::waitForListenerScript(port, 60) + launch + " " + train + loss.argsB + " > " + d +
      "/b.log 2>&1 & B=$!; " + "for i in $(seq 1200); do " + fourRankStepScript(dir + loss.killWhenStepIn, loss.killAtStep) +
      " && break; sleep 0.1; done; " + killB + "; " + (loss.afterKill.empty() ? "" : loss.afterKill + "; ") + "wait $A; echo \"node A exit $?\"; "
      "cat " + d + "/a.log";
  return runCommand(script, 280);
}

void expectSameExportAsUninterrupted(const std::string& dir) {
  const std::string full = dir + "/full";
  const CommandResult r = runCommand(kBin + "/tessera-run --standalone --nproc-per-node 4 " + kBin + "/tessera-train" +
                                     kTrainArgs + " --set run.dir=" + shellQuote(full));
  ASSERT_EQ(r.status, 0) << r.output;
  const auto reference = exportOf(full);
  const auto elastic = exportOf(dir + "/run");
  ASSERT_EQ(reference.size(), elastic.size());
  for (const auto& [name, tensor] : reference) {
    ASSERT_TRUE(elastic.count(name)) << name;
    EXPECT_TRUE(at::allclose(tensor, elastic.at(name), 1e-5, 1e-6))
        << name << ": max difference " << (tensor - elastic.at(name)).abs().max().item<double>();
  }
}

TEST(ElasticE2ETest, TesseraRunGoesOnWithoutALostNode) {
  const std::string dir = tessera::test::scratchPath("tessera_elastic", "tessera_run");
  const int port = freePort();
  const std::string launch = strCat(kBin, "/tessera-run --nnodes 1:2 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:", port,
                                    " --rdzv-id elastic_test --rdzv-conf last_call_timeout=2 --max-restarts 3");
  const CommandResult r = loseANode(dir, launch, port, "kill -s KILL $B");
  EXPECT_NE(r.output.find("node A exit 0"), std::string::npos) << r.output;
  // Round 1 when B joins within A's last call; on a loaded machine A may train alone first.
  // Node ranks go by the order the nodes joined in, so A, the host, may be node rank 1.
  EXPECT_TRUE(std::regex_search(r.output, std::regex("rendezvous round [0-9]+: 2 nodes of 1:2, this one node rank [01]"
                                                     "(, world 4 ranks|: world 2 -> 4 ranks)")))
      << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("rendezvous round [0-9]+: 1 node of 1:2, this one node rank 0: "
                                                     "world 4 -> 2 ranks")))
      << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("world 4 -> 2 ranks, resumed from step [0-9]+ with the same "
                                                     "global batch \\(32\\)")))
      << r.output;
  EXPECT_NE(r.output.find("done: 300 steps"), std::string::npos) << r.output;
  expectSameExportAsUninterrupted(dir);
}

// checkpoint.local (docs/checkpoint.md, "Node-local tier"): persistent checkpoints every
// 100 steps, the node-local tier every 5, each node with a directory of its own. Node B
// is killed once node A's directory holds step 30, and its directory deleted (the node's
// memory is gone): the survivors resume from the newest local step, long before the
// first persistent checkpoint, with B's rank files from their replicas on A, and end
// equal to the uninterrupted run. A's directory is empty at the end.
TEST(ElasticE2ETest, ALostNodeCostsOnlyTheStepsSinceTheLastLocalCheckpoint) {
  const std::string dir = tessera::test::scratchPath("tessera_elastic", "local_tier");
  const int port = freePort() + 6;
  const std::string launch = strCat(kBin, "/tessera-run --nnodes 1:2 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:", port,
                                    " --rdzv-id local_tier --rdzv-conf last_call_timeout=2 --max-restarts 3");
  NodeLoss loss;
  const std::string local = " --set checkpoint.every_steps=100 --set checkpoint.local.every_steps=5 --set run.log_every=1";
  loss.argsA = local + " --set checkpoint.local.dir=" + shellQuote(dir + "/local_a");
  loss.argsB = local + " --set checkpoint.local.dir=" + shellQuote(dir + "/local_b");
  loss.killWhenStepIn = "/local_a";
  loss.killAtStep = 30;
  loss.afterKill = "rm -rf " + shellQuote(dir + "/local_b");
  // The node's ranks and launcher killed at once, as a power loss would (each rank is in a
  // process group of its own, and a launcher killed alone has them stop with a checkpoint).
  const CommandResult r =
      loseANode(dir, launch, port, "kill -s KILL $(cat /proc/$B/task/*/children 2>/dev/null) $B", loss);
  EXPECT_NE(r.output.find("node A exit 0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("checkpoint.local: every 5 steps to " + dir + "/local_a on each of 2 nodes, 1 replica(s)"),
            std::string::npos)
      << r.output;
  std::smatch promoted;
  ASSERT_TRUE(std::regex_search(r.output, promoted,
                                std::regex("checkpoint.local: step ([0-9]+) of the node-local tier \\(held on 1 of the "
                                           "nodes now running\\) copied to [^ ]*/run/checkpoints/step_0*\\1 ")))
      << r.output;
  const int step = std::stoi(promoted[1]);
  EXPECT_GE(step, 30) << r.output;
  EXPECT_NE(step % 100, 0) << "a step of the node-local tier, newer than the last persistent one\n" << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("world 4 -> 2 ranks, resumed from step " + std::to_string(step))))
      << r.output;
  EXPECT_NE(r.output.find("done: 300 steps"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::is_empty(dir + "/local_a")) << "the local tier is cleared at the end";
  expectSameExportAsUninterrupted(dir);
}

// A node that comes later: node A trains alone (round 1: 2 ranks); node B arrives and
// waits; A sees it waiting, stops its ranks (they save a checkpoint) and both start round
// 2 on 4 ranks, resumed from that checkpoint. A global batch of 24 and micro-batches of at
// most 8: 12 samples per rank on 2 ranks (micro-batches of 6, chosen automatically), 6 on 4.
// A's ranks are paused (SIGSTOP) from its checkpoint at step 40 until A's launcher has seen B
// waiting: on a fast machine the 300 steps were otherwise over before B had started.
TEST(ElasticE2ETest, ANodeThatComesLaterJoinsAtARestart) {
  const std::string dir = tessera::test::scratchPath("tessera_elastic", "joins");
  const std::string d = shellQuote(dir);
  const std::string launch = strCat(kBin, "/tessera-run --nnodes 1:2 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:",
                                    freePort() + 3, " --rdzv-id joins --rdzv-conf last_call_timeout=1 --max-restarts 1");
  const std::string args = " --set data.global_batch=24 --set data.micro_batch=8";
  const std::string train = kBin + "/tessera-train" + kTrainArgs + args + " --set run.dir=" + d + "/run";
  const CommandResult r = runCommand(
      "mkdir -p " + d + "; " + launch + " " + train + " > " + d + "/a.log 2>&1 & A=$!; " + "for i in $(seq 6000); do [ -d " +
          d + "/run/checkpoints/step_00000040 ] && break; sleep 0.02; done; R=$(pgrep -P $A); kill -STOP $R; " + launch +
          " " + train + " > " + d + "/b.log 2>&1 & B=$!; for i in $(seq 300); do grep -q 'waits to join' " + d +
          "/a.log && break; sleep 0.1; done; kill -CONT $R; wait $A; echo \"node A exit $?\"; wait $B; "
          "echo \"node B exit $?\"; cat " + d + "/a.log " + d + "/b.log",
      280);
  EXPECT_NE(r.output.find("node A exit 0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("node B exit 0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rendezvous round 1: 1 node of 1:2, this one node rank 0, world 2 ranks"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("another node restarted, left or waits to join"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rendezvous round 2: 2 nodes of 1:2, this one node rank 1: world 2 -> 4 ranks"),
            std::string::npos)
      << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("world 2 -> 4 ranks, resumed from step [0-9]+")))
      << r.output;
  EXPECT_NE(r.output.find("data.micro_batch 8 does not divide the 12 samples each of 2 ranks gets per step "
                          "(data.global_batch 24): micro-batches of 6 instead"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("done: 300 steps"), std::string::npos) << r.output;

  const std::string full = dir + "/full";
  const CommandResult uninterrupted = runCommand(kBin + "/tessera-run --standalone --nproc-per-node 4 " + kBin +
                                                 "/tessera-train" + kTrainArgs + args + " --set run.dir=" +
                                                 shellQuote(full));
  ASSERT_EQ(uninterrupted.status, 0) << uninterrupted.output;
  const auto reference = exportOf(full);
  const auto joined = exportOf(dir + "/run");
  for (const auto& [name, tensor] : reference) {
    ASSERT_TRUE(joined.count(name)) << name;
    EXPECT_TRUE(at::allclose(tensor, joined.at(name), 1e-5, 1e-6)) << name;
  }
}

// A python3 that can run torchrun ("" when none).
std::string torchrunPython() {
  for (const std::string candidate : {"/usr/bin/python3", "python3"}) {
    if (runCommand(candidate + " -c 'import torch.distributed.run' >/dev/null 2>&1").status == 0) return candidate;
  }
  return "";
}

TEST(ElasticE2ETest, TorchrunGoesOnWithoutALostNode) {
  const std::string python = torchrunPython();
  if (python.empty()) GTEST_SKIP() << "no python3 with torch (apt install python3-torch)";
  const std::string dir = tessera::test::scratchPath("tessera_elastic", "torchrun");
  // Each agent in a session of its own: losing the node kills the agent and its workers.
  // Debian's torchrun 1.13 on Python 3.11 needs --redirects/--tee given.
  const int port = freePort() + 1;
  const std::string launch = strCat("setsid ", python, " -m torch.distributed.run --nnodes 1:2 --nproc_per_node 2",
                                    " --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:", port,
                                    " --rdzv_id elastic_test --rdzv_conf last_call_timeout=2 --max_restarts 3",
                                    " --monitor_interval 0.5 --redirects 1 --tee 1 --no_python");
  const CommandResult r = loseANode(dir, launch, port, "kill -s KILL -- -$B");
  EXPECT_NE(r.output.find("node A exit 0"), std::string::npos) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("world 4 -> 2 ranks, resumed from step [0-9]+")))
      << r.output;
  EXPECT_NE(r.output.find("done: 300 steps"), std::string::npos) << r.output;
  expectSameExportAsUninterrupted(dir);
}

TEST(ElasticE2ETest, ElasticOptionsAreChecked) {
  const std::string run = kBin + "/tessera-run ";
  const auto refused = [&](const std::string& args, const std::string& message) {
    const CommandResult r = runCommand(run + args + " true");
    EXPECT_EQ(r.status, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << args << "\n" << r.output;
  };
  refused("--nnodes 2:1 --rdzv-endpoint h:1", "--nnodes '2:1': MAX (1) is below MIN (2)");
  refused("--nnodes 1:x --rdzv-endpoint h:1", "--nnodes '1:x' must be N or MIN:MAX");
  refused("--nnodes 0 --rdzv-endpoint h:1", "--nnodes '0' must be N or MIN:MAX");
  refused("--nnodes 1:2 --rdzv-endpoint localhost", "--rdzv-endpoint 'localhost' must be HOST:PORT");
  refused("--nnodes 1:2 --rdzv-endpoint h:70000", "--rdzv-endpoint 'h:70000' must be HOST:PORT");
  refused("--nnodes 1:2 --rdzv-endpoint h:1 --rdzv-backend etcd", "--rdzv-backend 'etcd'");
  refused("--nnodes 1:2 --rdzv-endpoint h:1 --node-rank 1", "--node-rank: an elastic run");
  refused("--nnodes 1:2 --rdzv-endpoint h:1 --rdzv-conf last_call_timeout=x", "--rdzv-conf 'last_call_timeout=x'");
  refused("--nnodes 1:2 --rdzv-endpoint h:1 --rdzv-conf wait=1", "--rdzv-conf: unknown key 'wait'");
  refused("--nnodes 1:2 --rdzv-endpoint h:1 --standalone", "--standalone");
}

// The verdict of a two-node run sees both nodes' dumps (sent through the rendezvous): rank
// 3, on node B, hangs in compute; node A's launcher names it and says what it was doing.
TEST(ElasticE2ETest, VerdictGathersTheOtherNodesDumps) {
  const std::string dir = tessera::test::scratchPath("tessera_elastic", "verdict");
  const int port = freePort() + 4;
  const std::string launch = strCat(kBin, "/tessera-run --nnodes 2 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:", port, " --rdzv-id verdict --grace-period-s 2 ", kBin,
                                    "/tessera-fault-worker --dir ", shellQuote(dir), " --fault sleep --fault-rank 3",
                                    " --fault-step 3 --timeout-s 3");
  const CommandResult r = runCommand(launch + " > " + shellQuote(dir + ".a") + " 2>&1 & A=$!; " + tessera::test::waitForListenerScript(port, 60) + launch +
                                         " > " + shellQuote(dir + ".b") + " 2>&1; wait $A; echo \"node A exit $?\"; cat " +
                                         shellQuote(dir + ".a"),
                                     120);
  EXPECT_NE(r.output.find("node A exit 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 3 is behind: ranks 0, 1, 2 waited in collective #2 all_reduce Float x256 'layers.1' "
                          "at step 3"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("it was doing: main: step 3 > forward layers.1"), std::string::npos) << r.output;
  fs::remove(dir + ".a");
  fs::remove(dir + ".b");
}

// --nnodes MIN:MAX alone, as with torchrun: the launchers meet on this machine (port 29400).
TEST(ElasticE2ETest, NnodesRangeAloneMeetsOnThisMachine) {
  const CommandResult r = runCommand(kBin + "/tessera-run --nnodes 1:2 --rdzv-conf last_call_timeout=0.2 true", 60);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("without --rdzv-endpoint: the launchers meet at 127.0.0.1:29400"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("rendezvous round 1: 1 node of 1:2, this one node rank 0, world 1 ranks"), std::string::npos)
      << r.output;
}

// Whatever reaches the rendezvous port gets an error answer, and the launcher that hosts it
// goes on: junk, JSON of the wrong shape or types, a join with no id or a bad port or rank
// count, 100 kB of random bytes.
TEST(ElasticE2ETest, RendezvousAnswersBadRequestsWithErrors) {
  const int port = freePort() + 5;
  const std::string send = strCat("exec 3<>/dev/tcp/127.0.0.1/", port, "; printf '%s\\n' \"$1\" >&3; timeout 6 head -c 300 <&3; echo; exec 3>&-");
  std::string script = strCat(kBin, "/tessera-run --nnodes 2 --rdzv-endpoint 127.0.0.1:", port,
                              " --rdzv-timeout 30 true > /dev/null 2>&1 & L=$!; sleep 0.5; ");
  for (const std::string msg :
       {"garbage", "[1,2]", "{\"op\":\"join\"}", "{\"op\":\"join\",\"run_id\":\"none\",\"node\":\"x\",\"store_port\":\"p\",\"nproc\":1}",
        "{\"op\":\"join\",\"run_id\":\"none\",\"node\":\"\",\"store_port\":1,\"nproc\":1}",
        "{\"op\":\"join\",\"run_id\":\"none\",\"node\":\"x\",\"store_port\":1,\"nproc\":-5}",
        "{\"op\":\"fly\",\"run_id\":\"none\",\"node\":\"x\"}"}) {
    script += strCat("bash -c ", shellQuote(send), " _ ", shellQuote(msg), "; ");
  }
  script += strCat("head -c 100000 /dev/urandom | tr -d '\\n' > /dev/tcp/127.0.0.1/", port,
                   " 2>/dev/null; sleep 0.3; kill -0 $L && echo 'launcher alive'; kill $L; wait $L");
  const CommandResult r = runCommand("bash -c " + shellQuote(script), 60);
  for (const std::string answer :
       {"{\"error\":\"bad request: request: not a JSON object ([json.exception.parse_error.101]",
        "request: not a JSON object (a JSON array)", "request lacks a string 'run_id'",
        "request lacks an integer 'store_port'", "request's 'node' is not 1 to 256 printable characters",
        "request's 'nproc' is -5, outside [1, 1024]", "unknown request 'fly'", "launcher alive"}) {
    EXPECT_NE(r.output.find(answer), std::string::npos) << answer << "\n" << r.output;
  }
}

// Two launchers of different runs at one endpoint: the second is refused by run id.
TEST(ElasticE2ETest, AnotherRunIdIsRefused) {
  const int port = freePort() + 2;
  const std::string base = strCat(kBin, "/tessera-run --nnodes 2 --nproc-per-node 1 --rdzv-endpoint 127.0.0.1:", port,
                                  " --rdzv-timeout 10 --rdzv-conf last_call_timeout=1");
  const CommandResult r = runCommand(base + " --rdzv-id first sleep 30 > /dev/null 2>&1 & A=$!; sleep 0.5; " + base +
                                         " --rdzv-id second true; echo \"second exit $?\"; kill $A; wait $A",
                                     60);
  EXPECT_NE(r.output.find("this rendezvous belongs to run id 'first', not 'second' (--rdzv-id)"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("second exit 1"), std::string::npos) << r.output;
}

}  // namespace
