// The flight recorder in tessera-train, end to end: SIGUSR1 writes a rank's dump and the
// run goes on; SIGTERM (a preemption) writes every rank's dump and still stops with a
// checkpoint; diagnostics.flight_entries 0 writes none. The fault cases themselves are in
// tests/distributed/fault_test.cpp.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "tests/support/run_command.h"
#include "tests/support/scratch_path.h"

namespace {

namespace fs = std::filesystem;
using tessera::test::shellQuote;

using tessera::test::kBin;

// Starts a 2-rank run and waits for its first metrics line; with `usr1`, sends SIGUSR1 to
// one rank (saving the dump it wrote) and checks the rank still runs; then SIGTERMs the
// launcher.
std::string runThenTerm(const std::string& dir, const std::string& extra, bool usr1) {
  const std::string d = shellQuote(dir);
  std::string script = "set -u; " + kBin + "/tessera-run --standalone --nproc-per-node 2 " + kBin +
                       "/tessera-train --config " + TESSERA_SOURCE_DIR + "/configs/default.yaml --set run.dir=" + d +
                       " --set run.steps=1000000 --set checkpoint.every_steps=0 --set run.log_every=5 " + extra +
                       " & L=$!; for i in $(seq 300); do [ -s " + d + "/metrics.jsonl ] && break; sleep 0.1; done; ";
  if (usr1) {
    script += "R=$(pgrep -P $L | tail -1); kill -USR1 $R; "
              "for i in $(seq 100); do ls " + d + "/flight/rank_*.json >/dev/null 2>&1 && break; sleep 0.1; done; "
              "sleep 0.5; mkdir -p " + d + "/usr1 && cp " + d + "/flight/rank_*.json " + d + "/usr1/ 2>/dev/null; "
              "kill -0 $R && echo 'rank still running after SIGUSR1'; ";
  }
  return script + "kill -TERM $L; wait $L; echo \"launcher exit $?\"";
}

TEST(FlightE2ETest, Usr1DumpsWithoutStoppingAndSigtermDumpsEveryRank) {
  const std::string dir = tessera::test::scratchPath("tessera_flight", "usr1");
  const auto r = tessera::test::runCommand(runThenTerm(dir, "", true), 300);
  EXPECT_NE(r.output.find("rank still running after SIGUSR1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("flight recorder: SIGUSR1: wrote " + dir + "/flight/rank_"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("launcher exit 143"), std::string::npos) << r.output;  // 128 + SIGTERM, after a checkpoint
  EXPECT_NE(r.output.find("stopping at step"), std::string::npos) << r.output;

  // The SIGUSR1 dump: one rank's, in the middle of the run, with its collectives.
  std::vector<fs::path> usr1;
  for (const auto& e : fs::directory_iterator(dir + "/usr1")) usr1.push_back(e.path());
  ASSERT_EQ(usr1.size(), 1u) << r.output;
  const auto dump = nlohmann::json::parse(std::ifstream(usr1[0]));
  EXPECT_EQ(dump.at("reason"), "SIGUSR1 (a look at a running rank)");
  EXPECT_EQ(dump.at("world_size"), 2);
  EXPECT_GT(dump.at("step").get<int64_t>(), 0);
  ASSERT_FALSE(dump.at("groups").empty());
  const auto& group = dump.at("groups")[0];
  EXPECT_EQ(group.at("members"), nlohmann::json::array({0, 1}));
  ASSERT_FALSE(group.at("entries").empty());
  bool gather = false;
  for (const auto& e : group.at("entries")) gather = gather || e.at("op") == "all_gather";
  EXPECT_TRUE(gather) << "zero3 gathers its units";

  // SIGTERM: both ranks dumped, and tessera-flight reads them.
  for (int rank = 0; rank < 2; ++rank) {
    const auto term = nlohmann::json::parse(std::ifstream(dir + "/flight/rank_" + std::to_string(rank) + ".json"));
    EXPECT_EQ(term.at("reason"), "SIGTERM") << rank;
  }
  const auto offline = tessera::test::runCommand(kBin + "/tessera-flight " + shellQuote(dir));
  EXPECT_EQ(offline.status, 0) << offline.output;
  EXPECT_NE(offline.output.find("rank 1 dumped on SIGTERM"), std::string::npos) << offline.output;
}

// diagnostics.collective_timeout_s reaches tessera-train's collectives: a stopped rank
// (SIGSTOP) ends the run within that timeout + the grace period + 10 s, with the verdict;
// meanwhile the other rank says what it waits for.
TEST(FlightE2ETest, StoppedRankEndsTheRunWithinTheCollectiveTimeout) {
  const std::string dir = tessera::test::scratchPath("tessera_flight", "stopped");
  const std::string d = shellQuote(dir);
  const std::string script =
      kBin + "/tessera-run --standalone --nproc-per-node 2 --grace-period-s 2 " + kBin + "/tessera-train --config " +
      TESSERA_SOURCE_DIR + "/configs/default.yaml --set run.dir=" + d +
      " --set run.steps=1000000 --set checkpoint.every_steps=0 --set run.log_every=5"
      " --set diagnostics.collective_timeout_s=2 & L=$!; for i in $(seq 300); do [ -s " + d +
      "/metrics.jsonl ] && break; sleep 0.1; done; R=$(pgrep -P $L | tail -1); start=$(date +%s); kill -STOP $R; "
      "wait $L; echo \"launcher exit $? after $(( $(date +%s) - start )) s\"";
  const auto r = tessera::test::runCommand(script, 120);
  EXPECT_NE(r.output.find("launcher exit 1 after"), std::string::npos) << r.output;
  const size_t after = r.output.find("launcher exit 1 after ");
  ASSERT_NE(after, std::string::npos) << r.output;
  EXPECT_LE(std::stoi(r.output.substr(after + 22)), 2 + 2 + 10) << r.output;
  EXPECT_NE(r.output.find("timed out after 2 s"), std::string::npos) << r.output;
  // While it waits, the rank still running says so (it was silent until the timeout).
  EXPECT_TRUE(std::regex_search(r.output, std::regex("has waited 1(\\.[0-9]+)? s for the other ranks \\(timeout 2 s\\): "
                                                     "one has not joined it")))
      << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("rank [01] stopped answering: its process was stopped \\(SIGSTOP "
                                                     "or a debugger\\)")))
      << r.output;
  // The folder the verdict names outlives the launcher (no --log-dir: a temporary one).
  std::smatch kept;
  ASSERT_TRUE(std::regex_search(r.output, kept, std::regex("the dumps stay in (\\S+) "))) << r.output;
  EXPECT_TRUE(fs::exists(fs::path(kept[1].str()) / "rank_0.json")) << kept[1];
  std::error_code ec;
  fs::remove_all(fs::path(kept[1].str()).parent_path(), ec);
}

// A rank slow but not stuck (stopped and continued in a loop, 60% of the time) is named in
// rank 0's log while the run goes on, within a minute, and metrics.jsonl records it as
// the slowest rank.
TEST(FlightE2ETest, ASlowRankIsNamedWhileTheRunGoesOn) {
  const std::string dir = tessera::test::scratchPath("tessera_flight", "straggler");
  const std::string d = shellQuote(dir);
  const std::string script =
      "set -u; " + kBin + "/tessera-run --standalone --nproc-per-node 2 " + kBin + "/tessera-train --config " +
      TESSERA_SOURCE_DIR + "/configs/default.yaml --set run.dir=" + d +
      " --set run.steps=1000000 --set checkpoint.every_steps=0 --set checkpoint.at_end=false --set run.log_every=5"
      " & L=$!; for i in $(seq 300); do [ -s " + d +
      "/metrics.jsonl ] && break; sleep 0.1; done; R=; for p in $(pgrep -P $L); do tr '\\0' '\\n' < /proc/$p/environ "
      "| grep -qx RANK=1 && R=$p; done; start=$(date +%s); for i in $(seq 240); do kill -STOP $R; sleep 0.15; "
      "kill -CONT $R; sleep 0.1; grep -q 'rank 1 is slow' " + d + "/logs/rank_0.log 2>/dev/null && break; done; "
      "echo \"named after $(( $(date +%s) - start )) s\"; before=$(wc -l < " + d + "/metrics.jsonl); sleep 2; "
      "after=$(wc -l < " + d + "/metrics.jsonl); [ $after -gt $before ] && echo 'the run goes on'; "
      "kill -TERM $L; wait $L; echo \"launcher exit $?\"";
  const auto r = tessera::test::runCommand(script, 180);
  std::smatch named;
  ASSERT_TRUE(std::regex_search(r.output, named, std::regex("named after ([0-9]+) s"))) << r.output;
  EXPECT_LE(std::stoi(named[1].str()), 60) << r.output;
  std::ifstream log0(dir + "/logs/rank_0.log");
  const std::string rank0((std::istreambuf_iterator<char>(log0)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(std::regex_search(rank0, std::regex("\\[rank 0\\][^\n]*rank 1 is slow: [0-9.]+ ms per step behind the "
                                                  "others \\(busy [0-9.]+ ms per step")))
      << rank0 << r.output;
  EXPECT_NE(r.output.find("the run goes on"), std::string::npos) << r.output;
  bool recorded = false;
  std::ifstream metrics(dir + "/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    ASSERT_TRUE(j.contains("slowest_rank")) << line;
    recorded = recorded || (j["slowest_rank"] == 1 && j["slowest_rank_lag_ms"].get<double>() > 10);
  }
  EXPECT_TRUE(recorded) << "no window names rank 1 as the slowest";
}

TEST(FlightE2ETest, ZeroEntriesTurnsTheRecorderOff) {
  const std::string dir = tessera::test::scratchPath("tessera_flight", "off");
  const auto r = tessera::test::runCommand(runThenTerm(dir, "--set diagnostics.flight_entries=0", false), 300);
  EXPECT_NE(r.output.find("launcher exit 143"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir + "/flight")) << r.output;
}

}  // namespace
