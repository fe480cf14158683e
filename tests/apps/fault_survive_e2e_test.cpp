// fault.survive, end to end: tessera-run nodes of 2 ranks on this machine (static
// --nnodes), each node a replica group of a hybrid run (zero3 inside the node, replicated
// across nodes), or of no_shard/zero1/zero2 (what they shard, sharded inside the node). A rank of another node kills itself (TESSERA_TEST_KILL) at a chosen point
// of a chosen step; its node's launcher ends, and node 0's ranks go on in-process, without
// a restart or a checkpoint read, to the export an uninterrupted run writes: bit for bit
// under run.deterministic, within float tolerance without it. When the group of rank 0 (the
// store's host) is the one that lost a rank, every rank stops with the reason.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "common/errors.h"
#include "tests/apps/train_runs.h"
#include "tests/support/free_port.h"
#include "tests/support/run_files.h"
#include "tests/support/run_command.h"
#include "tests/support/scratch_path.h"

// Named: the apps' tests are one unity build, where anonymous namespaces meet.
namespace fault_survive_test {

using tessera::strCat;
using tessera::test::CommandResult;
using tessera::test::exportOf;
using tessera::test::kBin;
using tessera::test::readText;
using tessera::test::runCommand;
using tessera::test::shellQuote;

// 8 micro-batches of 4 a step: whole micro-batches on 6, 4 or 2 ranks.
const std::string kTrainArgs =
    strCat(" --config ", TESSERA_SOURCE_DIR,
           "/configs/default.yaml --set run.steps=60 --set model.hidden=[48] --set data.global_batch=32"
           " --set data.micro_batch=4 --set checkpoint.every_steps=20 --set log.per_rank_files=false"
           " --set run.log_every=1 --set run.backend=auto --set sharding.strategy=hybrid"
           " --set sharding.shard_size=2 --set fault.survive=true"
           // ctest runs two tests at once on CI's 2 cores: a live rank may answer late.
           " --set fault.quorum_wait_s=2");
const std::string kDeterministic = " --set run.deterministic=true";
// Long enough for a lost group's restart and rejoin (the launcher's failure report waits up
// to 5 s for the others').
const std::string kRejoinRun =
    kDeterministic + " --set run.steps=3000 --set checkpoint.every_steps=500 --set run.log_every=10";

struct Nodes {
  std::vector<int> status;             // each launcher's exit status
  std::vector<std::string> logs;       // each launcher's output
};

// `nodes` launchers of 2 ranks, each with the trainer and `extra`; TESSERA_TEST_KILL=`kill`;
// the launchers of nodes 1.. get `launcherExtra` too. `elastic`: the launchers of an elastic
// run (--nnodes N:N --rdzv-endpoint), every one with `launcherExtra`; node ranks go by the
// order they joined in, so launcher n need not be node n.
Nodes runNodes(const std::string& dir, int nodes, const std::string& extra, const std::string& kill = "",
               const std::string& launcherExtra = "", bool elastic = false) {
  const int port = tessera::test::freePort();
  const std::string d = shellQuote(dir);
  std::string script = strCat("rm -rf ", d, "; mkdir -p ", d, "; export TESSERA_TEST_KILL=", shellQuote(kill), "; ");
  for (int n = 0; n < nodes; ++n) {
    const std::string launcher =
        elastic ? strCat(" --nnodes ", nodes, ":", nodes, " --rdzv-endpoint 127.0.0.1:", port,
                         " --rdzv-id fault_survive --rdzv-conf last_call_timeout=1 ", launcherExtra)
                : strCat(" --nnodes ", nodes, " --node-rank ", n, " --master-port ", port,
                         n > 0 ? " " + launcherExtra : std::string());
    script += strCat("(", kBin, "/tessera-run --nproc-per-node 2", launcher, " ", kBin, "/tessera-train", kTrainArgs,
                     extra, " --set run.dir=", d, "/run > ", d, "/node", n, ".log 2>&1; echo $? > ", d, "/node", n,
                     ".status) & ");
  }
  script += "wait";
  const CommandResult r = runCommand(script, 400);
  EXPECT_EQ(r.status, 0) << r.output;
  Nodes out;
  for (int n = 0; n < nodes; ++n) {
    std::ifstream status(strCat(dir, "/node", n, ".status"));
    int s = -1;
    status >> s;
    out.status.push_back(s);
    std::ifstream log(strCat(dir, "/node", n, ".log"));
    out.logs.emplace_back(std::istreambuf_iterator<char>(log), std::istreambuf_iterator<char>());
  }
  return out;
}

// The uninterrupted run of `nodes` x 2 ranks with `extra`. Most tests here compare against
// one of a few such runs (the rejoin runs' take a minute), so each is made once per build of
// the programs and shared: <build>/test_cache/fault_survive/<programs' size and time>/<args'
// hash>/run, made under a lock (ctest runs two tests at once) and moved into place only when
// every launcher exited 0. A new build's first use removes the older builds' runs.
// (23 tests, 10 distinct uninterrupted runs.) The key holds the config file the runs read
// too: an edit of it without a rebuild is another run.
std::string reference(int nodes, const std::string& extra) {
  namespace fs = std::filesystem;
  std::string programs;
  for (const char* name : {"tessera-run", "tessera-train"}) {
    const fs::path p = kBin + "/" + name;
    programs += strCat(fs::file_size(p), "_", fs::last_write_time(p).time_since_epoch().count(), "_");
  }
  programs += readText(strCat(TESSERA_SOURCE_DIR, "/configs/default.yaml"));
  const fs::path cache = fs::path(kBin).parent_path() / "test_cache" / "fault_survive";
  const fs::path builds = cache / "builds";
  const fs::path dir = builds / std::to_string(std::hash<std::string>{}(programs)) /
                       std::to_string(std::hash<std::string>{}(strCat(nodes, "|", kTrainArgs, "|", extra)));
  fs::create_directories(dir.parent_path());
  const std::string lockFile = dir.string() + ".lock";  // one per run: the other runs are made meanwhile
  const int lock = ::open(lockFile.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
  if (lock < 0) throw std::runtime_error("cannot open " + lockFile);
  struct Unlock {
    int fd;
    ~Unlock() { ::close(fd); }  // closing releases the lock
  } unlock{lock};
  // Another test making this run holds the lock for a minute or two; a wait past ctest's
  // 600 s would end this test without a word.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(480);
  while (::flock(lock, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK || std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error("cannot lock " + lockFile + " within 480 s (another test making the run holds it)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  if (!fs::exists(dir / "run")) {
    for (const auto& older : fs::directory_iterator(builds)) {
      std::error_code gone;  // a test of the same build may be removing it too
      if (older.path() != dir.parent_path()) fs::remove_all(older.path(), gone);
    }
    // Made beside its place (a rename within one file system), kept for a look if it failed.
    const std::string scratch = strCat(dir.string(), ".making_", ::getpid());
    const Nodes r = runNodes(scratch, nodes, extra);
    bool ok = true;
    for (int n = 0; n < nodes; ++n) {
      EXPECT_EQ(r.status[n], 0) << r.logs[n];
      ok = ok && r.status[n] == 0;
    }
    if (!ok) return scratch + "/run";
    fs::create_directories(dir);
    fs::rename(scratch + "/run", dir / "run");
    fs::remove_all(scratch);
  }
  return (dir / "run").string();
}

void expectExportsEqual(const std::string& referenceRun, const std::string& run, bool bitwise,
                        const std::vector<std::string>& names = {"model_ema", "model_ema_0.999"}) {
  for (const std::string& name : names) {
    const auto want = exportOf(referenceRun, name);
    const auto got = exportOf(run, name);
    ASSERT_EQ(want.size(), got.size()) << name;
    for (const auto& [tensor, value] : want) {
      ASSERT_TRUE(got.count(tensor)) << tensor;
      if (bitwise) {
        EXPECT_TRUE(at::equal(value, got.at(tensor))) << name << " " << tensor << ": max difference "
                                                      << (value - got.at(tensor)).abs().max().item<double>();
      } else {
        EXPECT_TRUE(at::allclose(value, got.at(tensor), 1e-5, 1e-6))
            << name << " " << tensor << ": max difference " << (value - got.at(tensor)).abs().max().item<double>();
      }
    }
  }
}

// metrics.jsonl's replicas_live by step.
std::map<int64_t, double> replicasLive(const std::string& run) {
  std::map<int64_t, double> out;
  std::ifstream in(run + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    EXPECT_TRUE(j.contains("time")) << line;
    out[j.at("step").get<int64_t>()] = j.at("replicas_live").get<double>();
  }
  return out;
}

// Node 0 finished without a restart or a checkpoint read; the other nodes' launchers failed.
void expectNode0WentOn(const Nodes& r, const std::string& goesOn) {
  EXPECT_EQ(r.status[0], 0) << r.logs[0];
  for (size_t n = 1; n < r.status.size(); ++n) EXPECT_NE(r.status[n], 0) << r.logs[n];
  EXPECT_NE(r.logs[0].find("fault.survive: " + goesOn), std::string::npos) << r.logs[0];
  EXPECT_NE(r.logs[0].find("done: 60 steps"), std::string::npos) << r.logs[0];
  EXPECT_EQ(r.logs[0].find("resumed from"), std::string::npos) << r.logs[0];
  EXPECT_EQ(r.logs[0].find("restart"), std::string::npos) << r.logs[0];
}

TEST(FaultSurviveE2ETest, AGroupLostMidStepLeavesAndTheOtherEndsAsTheUninterruptedRun) {
  const std::string dir = tessera::test::scratchPath("tessera_fault_survive", "start");
  const Nodes r = runNodes(dir, 2, kDeterministic, "3:31:start");
  expectNode0WentOn(r, "ranks 0-1 of 4 go on as a world of 2 from step 30 (ranks 2-3 left)");
  EXPECT_NE(r.logs[1].find("rank 2's replica group lost a rank, so it leaves the run"), std::string::npos) << r.logs[1];
  expectExportsEqual(reference(2, kDeterministic), dir + "/run", /*bitwise=*/true);
  const auto live = replicasLive(dir + "/run");
  ASSERT_EQ(live.size(), 60u);
  EXPECT_EQ(live.at(30), 2.0);
  EXPECT_EQ(live.at(31), 1.0);
  EXPECT_EQ(live.at(60), 1.0);
  // The flight record of the change: rank 0's dump names the lost peer and who went on.
  std::ifstream dump(dir + "/run/flight/rank_0.json");
  const std::string flight((std::istreambuf_iterator<char>(dump)), std::istreambuf_iterator<char>());
  EXPECT_NE(flight.find("fault.survive: lost a peer ("), std::string::npos) << flight.substr(0, 2000);
  EXPECT_NE(flight.find("ranks 0-1 of 4 go on as a world of 2 from step 30"), std::string::npos) << flight.substr(0, 2000);
}

// A frozen process (SIGSTOP, never continued) is lost after a second, as a dead one.
TEST(FaultSurviveE2ETest, AStoppedRankIsLostAfterASecond) {
  const std::string dir = tessera::test::scratchPath("tessera_fault_survive", "stop");
  const Nodes r = runNodes(dir, 2, kDeterministic, "3:31:stop");
  expectNode0WentOn(r, "ranks 0-1 of 4 go on as a world of 2 from step 30 (ranks 2-3 left)");
  EXPECT_NE(r.logs[0].find("stopped for 1 s (SIGSTOP)"), std::string::npos) << r.logs[0];
  expectExportsEqual(reference(2, kDeterministic), dir + "/run", /*bitwise=*/true);
}

// A rank frozen for 5 s that then comes back (TESSERA_TEST_KILL WHEN pause: a node that
// stalls): the others take it for lost after 1 s and go on; when it wakes, its group has
// left, and its two live ranks ask to rejoin in process: no launcher restarts anything (none
// may), both exit 0, and the run ends as the uninterrupted one.
TEST(FaultSurviveE2ETest, ARankThatStallsAndComesBackRejoinsInProcess) {
  const std::string dir = tessera::test::scratchPath("tessera_fault_survive", "pause");
  const Nodes r = runNodes(dir, 2, kRejoinRun, "3:31:pause");
  EXPECT_EQ(r.status[0], 0) << r.logs[0];
  EXPECT_EQ(r.status[1], 0) << r.logs[1];
  EXPECT_NE(r.logs[0].find("fault.survive: ranks 0-1 of 4 go on as a world of 2 from step 30 (ranks 2-3 left)"),
            std::string::npos)
      << r.logs[0];
  for (const std::string rank : {"2", "3"}) {
    EXPECT_NE(r.logs[1].find(strCat("rank ", rank, "'s replica group lost a rank, so it leaves the run: ranks 0-1 of "
                                    "4 go on as a world of 2 from step 30 (ranks 2-3 left); asking to rejoin in process")),
              std::string::npos)
        << r.logs[1];
    EXPECT_TRUE(std::regex_search(r.logs[1], std::regex(strCat("fault.survive: rejoined as rank ", rank,
                                                               " of 4 after step [0-9]+"))))
        << r.logs[1];
  }
  EXPECT_EQ(r.logs[1].find("restart"), std::string::npos) << r.logs[1];
  EXPECT_EQ(r.logs[1].find("resumed from"), std::string::npos) << r.logs[1];
  EXPECT_NE(r.logs[0].find("the run went on without 1 lost replica group and took 1 back (fault.survive)"),
            std::string::npos)
      << r.logs[0];
  expectExportsEqual(reference(2, kRejoinRun), dir + "/run", /*bitwise=*/true);
}

// fault.lost_after_s: a rank frozen for 5 s in a run that allows 10 is not lost: the others
// wait for it in their collectives (shm sees its process stopped, rank 0's watcher its
// heartbeats late; neither for 10 s), nobody leaves, and the run ends as the uninterrupted one.
TEST(FaultSurviveE2ETest, ARankStalledShorterThanLostAfterIsWaitedFor) {
  const std::string dir = tessera::test::scratchPath("tessera_fault_survive", "pause_allowed");
  const Nodes r = runNodes(dir, 2, kDeterministic + " --set fault.lost_after_s=10", "3:31:pause");
  for (int n = 0; n < 2; ++n) {
    EXPECT_EQ(r.status[n], 0) << r.logs[n];
    EXPECT_EQ(r.logs[n].find("sent no heartbeat"), std::string::npos) << r.logs[n];
    EXPECT_EQ(r.logs[n].find("go on as a world"), std::string::npos) << r.logs[n];
    EXPECT_EQ(r.logs[n].find("restart"), std::string::npos) << r.logs[n];
  }
  EXPECT_NE(r.logs[0].find("done: 60 steps"), std::string::npos) << r.logs[0];
  // The others did wait for it: the step of the pause (31, or the one after it, whichever
  // its collectives fell in), not some other stall, took its 5 s.
  double longest = 0, previous = 0;
  int64_t longestStep = 0;
  std::ifstream metrics(dir + "/run/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const nlohmann::json row = nlohmann::json::parse(line);
    const double time = row.at("time").get<double>();
    if (previous > 0 && time - previous > longest) {
      longest = time - previous;
      longestStep = row.at("step").get<int64_t>();
    }
    previous = time;
  }
  EXPECT_GT(longest, 4.5);
  EXPECT_TRUE(longestStep == 31 || longestStep == 32) << "the longest step was " << longestStep;
  expectExportsEqual(reference(2, kDeterministic), dir + "/run", /*bitwise=*/true);
}

// Over gloo (several hosts' backend; here every rank on loopback): a killed peer's
// connections close, a stopped one misses its heartbeats; the live group abandons the
// collectives in flight and goes on to the same bits as the uninterrupted run over shm (the
// deterministic sums do not depend on the backend); a lost group rejoins.
const std::string kGloo = kDeterministic + " --set run.backend=gloo";

TEST(FaultSurviveE2ETest, OverGlooAKilledRanksGroupLeavesAndTheOtherGoesOn) {
  const std::string dir = tessera::test::scratchPath("tessera_fault_survive", "gloo_kill");
  const Nodes r = runNodes(dir, 2, kGloo, "3:31:start");
  expectNode0WentOn(r, "ranks 0-1 of 4 go on as a world of 2 from step 30 (ranks 2-3 left)");
  expectExportsEqual(reference(2, kDeterministic), dir + "/run", /*bitwise=*/true);
}

TEST(FaultSurviveE2ETest, OverGlooAStoppedRankIsLostByItsHeartbeat) {
  const std::string dir = tessera::test::scratchPath("tessera_fault_survive", "gloo_stop");
  const Nodes r = runNodes(dir, 2, kGloo, "2:31:stop");
  expectNode0WentOn(r, "ranks 0-1 of 4 go on as a world of 2 from step 30 (ranks 2-3 left)");
  EXPECT_NE(r.logs[0].find("launcher rank 2 sent no heartbeat for 1000 ms: lost"), std::string::npos) << r.logs[0];
  expectExportsEqual(reference(2, kDeterministic), dir + "/run", /*bitwise=*/true);
}

TEST(FaultSurviveE2ETest, OverGlooTheLostGroupRejoinsFromALivePeer) {
  const std::string dir = tessera::test::scratchPath("tessera_fault_survive", "gloo_rejoin");
  // Gloo's steps are slower than shm's: 1000 leave the restart (about 5 s) time enough.
  const std::string steps = " --set run.steps=1000 --set checkpoint.every_steps=500 --set run.log_every=10";
  const std::string longer = kGloo + steps;
  const Nodes r = runNodes(dir, 2, longer, "3:21:start", "--max-restarts 1");
  EXPECT_EQ(r.status[0], 0) << r.logs[0];
  EXPECT_EQ(r.status[1], 0) << r.logs[1];
  EXPECT_NE(r.logs[0].find("a lost replica group rejoined after step"), std::string::npos) << r.logs[0];
  EXPECT_EQ(r.logs[1].find("resumed from"), std::string::npos) << r.logs[1];
  expectExportsEqual(reference(2, kDeterministic + steps), dir + "/run", /*bitwise=*/true);
}

TEST(FaultSurviveE2ETest, AGroupLostAfterTheUpdateDoesNotRedoIt) {
  const std::string dir = tessera::test::scratchPath("tessera_fault_survive", "update");
  const Nodes r = runNodes(dir, 2, kDeterministic, "3:31:update");
  expectNode0WentOn(r, "ranks 0-1 of 4 go on as a world of 2 from step 31");
  expectExportsEqual(reference(2, kDeterministic), dir + "/run", /*bitwise=*/true);
}

TEST(FaultSurviveE2ETest, AGroupLostDuringAnAsyncSaveLeavesTheCheckpointsWhole) {
  const std::string dir = tessera::test::scratchPath("tessera_fault_survive", "save");
  const Nodes r = runNodes(dir, 2, kDeterministic, "3:40:save");
  expectNode0WentOn(r, "ranks 0-1 of 4 go on as a world of 2 from step 40");
  expectExportsEqual(reference(2, kDeterministic), dir + "/run", /*bitwise=*/true);
  // Every checkpoint left is complete and loads (the final one was saved by 2 ranks).
  const CommandResult check = runCommand(strCat(kBin, "/tessera-ckpt verify ", shellQuote(dir + "/run/checkpoints/step_00000060")));
  EXPECT_EQ(check.status, 0) << check.output;
}

TEST(FaultSurviveE2ETest, TwoGroupsLostOneAfterTheOther) {
  const std::string dir = tessera::test::scratchPath("tessera_fault_survive", "twice");
  const Nodes r = runNodes(dir, 3, kDeterministic, "3:21:start,5:41:start");
  expectNode0WentOn(r, "ranks 0-1, 4-5 of 6 go on as a world of 4 from step 20 (ranks 2-3 left)");
  EXPECT_NE(r.logs[0].find("fault.survive: ranks 0-1 of 4 go on as a world of 2 from step 40 (ranks 2-3 left)"),
            std::string::npos)
      << r.logs[0];
  expectExportsEqual(reference(3, kDeterministic), dir + "/run", /*bitwise=*/true);
  const auto live = replicasLive(dir + "/run");
  EXPECT_EQ(live.at(20), 3.0);
  EXPECT_EQ(live.at(21), 2.0);
  EXPECT_EQ(live.at(41), 1.0);
}

TEST(FaultSurviveE2ETest, WithoutDeterministicTheResultIsWithinFloatTolerance) {
  const std::string dir = tessera::test::scratchPath("tessera_fault_survive", "float");
  const Nodes r = runNodes(dir, 2, "", "3:31:start");
  expectNode0WentOn(r, "ranks 0-1 of 4 go on as a world of 2 from step 30");
  expectExportsEqual(reference(2, ""), dir + "/run", /*bitwise=*/false);
}

// The lost group's launcher restarts its ranks; they rejoin at a step boundary with their
// state from the live group (no checkpoint read), and the run ends as the uninterrupted one.
TEST(FaultSurviveE2ETest, TheLostGroupRejoinsFromALivePeer) {
  const std::string dir = tessera::test::scratchPath("tessera_fault_survive", "rejoin");
  const Nodes r = runNodes(dir, 2, kRejoinRun, "3:21:start", "--max-restarts 1");
  EXPECT_EQ(r.status[0], 0) << r.logs[0];
  EXPECT_EQ(r.status[1], 0) << r.logs[1];
  EXPECT_NE(r.logs[0].find("fault.survive: ranks 0-1 of 4 go on as a world of 2 from step 20"), std::string::npos)
      << r.logs[0];
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.logs[0], m, std::regex("a lost replica group rejoined after step ([0-9]+): world 2 -> 4")))
      << r.logs[0];
  const int64_t back = std::stoll(m[1]);
  for (const std::string rank : {"2", "3"}) {
    EXPECT_NE(r.logs[1].find(strCat("fault.survive: rejoined as rank ", rank, " of 4 after step ", back)),
              std::string::npos)
        << r.logs[1];
  }
  EXPECT_EQ(r.logs[1].find("resumed from"), std::string::npos) << r.logs[1];
  expectExportsEqual(reference(2, kRejoinRun), dir + "/run", /*bitwise=*/true);
  const auto live = replicasLive(dir + "/run");
  EXPECT_EQ(live.at(20), 2.0);
  EXPECT_EQ(live.at(30), 1.0);
  EXPECT_EQ(live.at(back + 10 - back % 10), 2.0);
  EXPECT_EQ(live.at(3000), 2.0);
}

// Three groups (kRejoinRun, the lost nodes' launchers with --max-restarts 1) with
// TESSERA_TEST_KILL=`kill`, in scratch folder `name`: every launcher exits 0, no rank read
// a checkpoint, and the export is bitwise the uninterrupted run's.
Nodes threeGroupsThatAllComeBack(const std::string& name, const std::string& kill) {
  const std::string dir = tessera::test::scratchPath("tessera_fault_survive", name);
  const Nodes r = runNodes(dir, 3, kRejoinRun, kill, "--max-restarts 1");
  for (int n = 0; n < 3; ++n) {
    EXPECT_EQ(r.status[n], 0) << r.logs[n];
    EXPECT_EQ(r.logs[n].find("resumed from"), std::string::npos) << r.logs[n];
  }
  expectExportsEqual(reference(3, kRejoinRun), dir + "/run", /*bitwise=*/true);
  return r;
}

// Three groups: C (ranks 4-5) lost and restarted; at its rejoin the donor, B's rank 2,
// dies before it sends (TESSERA_TEST_KILL WHEN share). The rejoin fails for every rank of
// it: A goes on alone, C asks again in process and is admitted later with A's state, B is
// restarted and rejoins too; the run ends as the uninterrupted one, every launcher exits 0.
TEST(FaultSurviveE2ETest, ADonorLostMidRejoinLeavesTheRejoinToAnotherGroup) {
  const Nodes r = threeGroupsThatAllComeBack("donor", "5:21:start,2:0:share");
  EXPECT_NE(r.logs[0].find("fault.survive: ranks 0-3 of 6 go on as a world of 4 from step 20 (ranks 4-5 left)"),
            std::string::npos)
      << r.logs[0];
  EXPECT_TRUE(std::regex_search(r.logs[0], std::regex("fault.survive: ranks 0-1 of 6 go on as a world of 2 from step "
                                                      "[0-9]+ \\(ranks 2-5 left\\)")))
      << r.logs[0];
  EXPECT_NE(r.logs[2].find("lost a peer"), std::string::npos) << r.logs[2];
  EXPECT_NE(r.logs[2].find("asking to rejoin again"), std::string::npos) << r.logs[2];
  EXPECT_TRUE(std::regex_search(r.logs[2], std::regex("fault.survive: rejoined as rank [0-9]+ of [0-9]+ after step")))
      << r.logs[2];
  EXPECT_NE(r.logs[0].find("the run went on without 2 lost replica groups and took 2 back (fault.survive)"),
            std::string::npos)
      << r.logs[0];
}

// Three groups; C (ranks 4-5) lost at step 21, and while the survivors build their world of
// 4 ranks, B's rank 2 dies (TESSERA_TEST_KILL WHEN build): no collective watches a peer
// then, so rank 0's watcher finds it by its heartbeat, every build ends with the abort, and
// the live ranks agree again: A goes on alone. B and C are restarted and rejoin; the run
// ends as the uninterrupted one.
TEST(FaultSurviveE2ETest, ARankLostWhileTheSurvivorsBuildTheirWorldIsSurvivedToo) {
  const Nodes r = threeGroupsThatAllComeBack("build_recover", "5:21:start,2:0:build");
  EXPECT_NE(r.logs[0].find("lost another peer while the world of 4 ranks was built"), std::string::npos) << r.logs[0];
  EXPECT_TRUE(std::regex_search(r.logs[0], std::regex("sent no heartbeat for [0-9]+ ms: lost"))) << r.logs[0];
  EXPECT_NE(r.logs[0].find("fault.survive: ranks 0-1 of 4 go on as a world of 2 from step 20 (ranks 2-3 left)"),
            std::string::npos)
      << r.logs[0];
  EXPECT_NE(r.logs[0].find("the run went on without 2 lost replica groups and took 2 back (fault.survive)"),
            std::string::npos)
      << r.logs[0];
}

// The same loss while a rejoin's world is built (B's rank 2 at the build that admits C,
// after step 25): the rejoin fails for all, A goes on alone from the parts it had before
// the admission, C asks again in process, B is restarted, both rejoin later.
TEST(FaultSurviveE2ETest, ARankLostWhileARejoinsWorldIsBuiltLeavesTheRejoinForLater) {
  const Nodes r = threeGroupsThatAllComeBack("build_rejoin", "5:21:start,2:25:build");
  EXPECT_NE(r.logs[0].find("fault.survive: ranks 0-3 of 6 go on as a world of 4 from step 20 (ranks 4-5 left)"),
            std::string::npos)
      << r.logs[0];
  EXPECT_TRUE(std::regex_search(r.logs[0], std::regex("sent no heartbeat for [0-9]+ ms: lost"))) << r.logs[0];
  EXPECT_TRUE(std::regex_search(r.logs[0], std::regex("fault.survive: ranks 0-1 of 6 go on as a world of 2 from step "
                                                      "[0-9]+ \\(ranks 2-5 left\\)")))
      << r.logs[0];
  EXPECT_NE(r.logs[2].find("asking to rejoin again"), std::string::npos) << r.logs[2];
  EXPECT_TRUE(std::regex_search(r.logs[2], std::regex("fault.survive: rejoined as rank [0-9]+ of [0-9]+ after step")))
      << r.logs[2];
}

// An elastic run (each node a tessera-run of --nnodes 2:2 --rdzv-endpoint): no other node's
// ranks failed with the lost one's, so its launcher restarts them into the running round
// (no new rendezvous round, the live node's ranks untouched), where they rejoin.
TEST(FaultSurviveE2ETest, InAnElasticRunTheLostNodeRestartsIntoTheRunningRound) {
  const std::string dir = tessera::test::scratchPath("tessera_fault_survive", "elastic");
  Nodes r = runNodes(dir, 2, kRejoinRun, "3:21:start", "--max-restarts 1", /*elastic=*/true);
  EXPECT_EQ(r.status[0], 0) << r.logs[0];
  EXPECT_EQ(r.status[1], 0) << r.logs[1];
  if (r.logs[0].find("RANK 0-1 of WORLD_SIZE 4") == std::string::npos) std::swap(r.logs[0], r.logs[1]);
  const std::string& live = r.logs[0];
  const std::string& lost = r.logs[1];
  EXPECT_NE(live.find("fault.survive: ranks 0-1 of 4 go on as a world of 2 from step 20"), std::string::npos) << live;
  EXPECT_NE(live.find("a lost replica group rejoined after step"), std::string::npos) << live;
  EXPECT_NE(live.find("the run went on without 1 lost replica group and took 1 back (fault.survive)"),
            std::string::npos)
      << live;
  EXPECT_NE(lost.find("no other node's ranks failed, so the run may live on without this node: restarting the local "
                      "ranks into round 1 to rejoin it"),
            std::string::npos)
      << lost;
  for (const std::string rank : {"2", "3"}) {
    EXPECT_NE(lost.find(strCat("fault.survive: rejoined as rank ", rank, " of 4 after step ")), std::string::npos)
        << lost;
  }
  // One round, the live node's ranks started once: the same processes throughout.
  for (const std::string& log : {live, lost}) EXPECT_EQ(log.find("rendezvous round 2"), std::string::npos) << log;
  EXPECT_EQ(live.find("started 2 ranks"), live.rfind("started 2 ranks")) << live;
  EXPECT_EQ(live.find("resumed from"), std::string::npos) << live;
  expectExportsEqual(reference(2, kRejoinRun), dir + "/run", /*bitwise=*/true);
}

// Ranks restarted into a running round where no run takes them back say so and exit 76
// (tessera-run then starts the next round).
TEST(FaultSurviveE2ETest, ARankRestartedIntoARoundWithNoRunToRejoinExits76) {
  const std::string dir = tessera::test::scratchPath("tessera_fault_survive", "nothing_to_rejoin");
  const CommandResult r =
      runCommand(strCat("TESSERA_RESTARTED_INTO_LIVE_ROUND=1 ", kBin, "/tessera-run --standalone --nproc-per-node 2 ",
                        kBin, "/tessera-train", kTrainArgs, " --set fault.survive=false --set run.dir=", shellQuote(dir)));
  EXPECT_EQ(r.status, 76) << r.output;
  EXPECT_NE(r.output.find("restarted into the running rendezvous round, but no run there takes this rank back "
                          "(fault.survive is off)"),
            std::string::npos)
      << r.output;
}

// A strategy where every rank holds the parameters (no_shard, zero1, zero2): what it shards
// (the EMA; zero1/zero2's masters and optimizer state) is sharded inside each node (its replica
// group), so the node that goes on holds all of it; the same export as a plain run of the
// strategy (sharded over every rank), and a checkpoint of that layout resumes on one process,
// without fault.survive, to the same export. A rank of node 1 is killed at `kill`; node 0
// goes on from step `from`.
void expectGoesOnWithItsShardsInTheGroup(const std::string& strategy, const std::string& kill, int from) {
  const std::string dir = tessera::test::scratchPath("tessera_fault_survive", strategy);
  const std::string args = kDeterministic + " --set sharding.strategy=" + strategy;
  const Nodes r = runNodes(dir, 2, args, kill);
  expectNode0WentOn(r, strCat("ranks 0-1 of 4 go on as a world of 2 from step ", from, " (ranks 2-3 left)"));
  const std::string referenceRun = reference(2, args);
  expectExportsEqual(referenceRun, dir + "/run", /*bitwise=*/true);
  const std::string plainDir = tessera::test::scratchPath("tessera_fault_survive", strategy + "_plain");
  const CommandResult plain = runCommand(strCat(kBin, "/tessera-run --standalone --nproc-per-node 2 ", kBin,
                                                "/tessera-train", kTrainArgs, args,
                                                " --set fault.survive=false --set run.dir=", shellQuote(plainDir)));
  ASSERT_EQ(plain.status, 0) << plain.output;
  expectExportsEqual(referenceRun, plainDir, /*bitwise=*/true);
  // Step 40's checkpoint (written by the node that went on) resumed on one process.
  const std::string resumed = tessera::test::scratchPath("tessera_fault_survive", strategy + "_resumed");
  const CommandResult one =
      runCommand(strCat(kBin, "/tessera-train", kTrainArgs, args, " --set fault.survive=false --set run.dir=",
                        shellQuote(resumed), " --resume ", shellQuote(dir + "/run/checkpoints/step_00000040")));
  ASSERT_EQ(one.status, 0) << one.output;
  EXPECT_NE(one.output.find("resumed from"), std::string::npos) << one.output;
  expectExportsEqual(referenceRun, resumed, /*bitwise=*/true);
}

TEST(FaultSurviveE2ETest, NoShardGoesOnTheSameWayWithItsEma) {
  expectGoesOnWithItsShardsInTheGroup("no_shard", "2:31:start", 30);
}

// zero2 reduces during backward; its rank is lost after the optimizer update (the step
// is not redone).
TEST(FaultSurviveE2ETest, Zero2GoesOnWithItsOptimizerStateShardedInTheGroup) {
  expectGoesOnWithItsShardsInTheGroup("zero2", "3:31:update", 31);
}

TEST(FaultSurviveE2ETest, Zero1GoesOnWithItsOptimizerStateShardedInTheGroup) {
  expectGoesOnWithItsShardsInTheGroup("zero1", "2:31:start", 30);
}

// zero2's lost group restarts and rejoins: its optimizer state shards come from the rank of
// the same place in the live group; the run ends as the uninterrupted one.
TEST(FaultSurviveE2ETest, Zero2sLostGroupRejoinsWithItsOptimizerState) {
  const std::string dir = tessera::test::scratchPath("tessera_fault_survive", "zero2_rejoin");
  const std::string longer = kDeterministic +
                             " --set sharding.strategy=zero2 --set run.steps=3000 --set checkpoint.every_steps=500"
                             " --set run.log_every=10";
  const Nodes r = runNodes(dir, 2, longer, "2:21:start", "--max-restarts 1");
  EXPECT_EQ(r.status[0], 0) << r.logs[0];
  EXPECT_EQ(r.status[1], 0) << r.logs[1];
  EXPECT_NE(r.logs[0].find("a lost replica group rejoined after step"), std::string::npos) << r.logs[0];
  EXPECT_EQ(r.logs[1].find("resumed from"), std::string::npos) << r.logs[1];
  expectExportsEqual(reference(2, longer), dir + "/run", /*bitwise=*/true);
}

TEST(FaultSurviveE2ETest, WhenRankZerosGroupLosesARankEveryRankStopsAndSaysWhy) {
  const std::string dir = tessera::test::scratchPath("tessera_fault_survive", "rank0");
  const Nodes r = runNodes(dir, 2, kDeterministic, "1:31:start");
  EXPECT_NE(r.status[0], 0) << r.logs[0];
  EXPECT_NE(r.status[1], 0) << r.logs[1];
  EXPECT_NE(r.logs[1].find("fault.survive: no replica group can go on: rank 0's replica group lost rank 1 (rank 0 "
                           "hosts the run's store, so its group must live)"),
            std::string::npos)
      << r.logs[1];
}

TEST(FaultSurviveE2ETest, ConfigurationsWithoutAReplicaElsewhereAreRefused) {
  const std::string train =
      kBin + "/tessera-run --standalone --nproc-per-node 2 " + kBin + "/tessera-train" + kTrainArgs + " --set run.steps=30";
  const auto refused = [&](const std::string& extra, const std::string& why) {
    const CommandResult r = runCommand(train + extra + " --set run.dir=" +
                                       shellQuote(tessera::test::scratchPath("tessera_fault_survive", "refused")));
    EXPECT_EQ(r.status, 2) << extra << "\n" << r.output;
    EXPECT_NE(r.output.find(why), std::string::npos) << extra << "\n" << r.output;
  };
  refused(" --set sharding.strategy=zero3", "fault.survive: needs a replica in every group: sharding.strategy zero3");
  // Both ranks in one shard group: one replica, nothing to go on with.
  refused("", "leave no second group to go on after a loss");
}

}  // namespace fault_survive_test
