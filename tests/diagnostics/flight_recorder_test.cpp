// The flight recorder's ring, its dump (what each thread is doing, the rings of live and of
// gone communicators), and the verdict on crafted dumps: behind, disagreeing, silent and
// stopped ranks, and dump files that are damaged or not files at all.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <thread>

#include "common/app_main.h"
#include "common/errors.h"
#include "common/trace.h"
#include "diagnostics/flight_recorder.h"
#include "diagnostics/flight_verdict.h"
#include "tests/support/scratch_path.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using tessera::diagnostics::FlightRing;
using tessera::diagnostics::VerdictInput;
namespace flight = tessera::diagnostics::flight;
namespace trace = tessera::trace;

bool contains(const std::vector<std::string>& lines, const std::string& text) {
  for (const auto& line : lines) {
    if (line.find(text) != std::string::npos) return true;
  }
  return false;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& line : lines) out += line + "\n";
  return out;
}

TEST(FlightRingTest, KeepsTheLastEntriesWithTheirStates) {
  FlightRing ring("world", "gloo", 1, {0, 1, 2}, 3);
  for (int i = 0; i < 5; ++i) {
    const trace::Tag tag(tessera::strCat("layers.", i));
    const int64_t seq = ring.issue("all_reduce", "Float", 256 + i, 1024, trace::currentTag());
    EXPECT_EQ(seq, i);
    if (i < 3) ring.finish(seq, "");
  }
  ring.waiting(4);
  ring.finish(0, "too late: it left the ring");  // ignored
  const json j = json::parse(ring.toJson(trace::nowNs()));
  EXPECT_EQ(j.at("group"), "world");
  EXPECT_EQ(j.at("rank"), 1);
  EXPECT_EQ(j.at("members"), json::array({0, 1, 2}));
  EXPECT_EQ(j.at("next_seq"), 5);
  const json& entries = j.at("entries");
  ASSERT_EQ(entries.size(), 3u);  // the last three: #2, #3, #4
  EXPECT_EQ(entries[0].at("seq"), 2);
  EXPECT_EQ(entries[0].at("state"), "completed");
  EXPECT_EQ(entries[0].at("numel"), 258);
  EXPECT_EQ(entries[0].at("tag"), "layers.2");
  EXPECT_EQ(entries[1].at("state"), "issued");
  EXPECT_EQ(entries[2].at("state"), "waiting");
  EXPECT_TRUE(entries[2].contains("wait_s_ago"));
  EXPECT_FALSE(entries[2].contains("ended_s_ago"));
  ring.finish(4, "timed out after 3 s");
  const json after = json::parse(ring.toJson(trace::nowNs()));
  EXPECT_EQ(after.at("entries")[2].at("state"), "failed");
  EXPECT_EQ(after.at("entries")[2].at("error"), "timed out after 3 s");
}

TEST(FlightRecorderTest, DumpSaysWhatEachThreadDoesAndKeepsGoneRings) {
  const std::string dir = tessera::test::scratchPath("flight", "dump");
  flight::setDumpFiles({dir + "/a/rank_3.json", dir + "/b/rank_3.json"}, 3, 4);
  auto ring = flight::openRing("world", "gloo", 3, {0, 1, 2, 3}, 2000);
  ASSERT_NE(ring, nullptr);
  ring->issue("barrier", "none", 0, 0, "");
  trace::setCurrentStep(7);
  {
    const trace::Span step("step", "step 7");
    const trace::Span forward("compute", "forward (micro-batch)");
    trace::setThreadDetail("forward layers.3");  // what an FSDP unit's hooks say
    const auto written = flight::dump("a test");
    trace::setThreadDetail("");
    ASSERT_EQ(written.size(), 2u);
    const json j = json::parse(std::ifstream(dir + "/b/rank_3.json"));
    EXPECT_EQ(j.at("format"), "tessera.flight/1");
    EXPECT_EQ(j.at("rank"), 3);
    EXPECT_EQ(j.at("world_size"), 4);
    EXPECT_EQ(j.at("reason"), "a test");
    EXPECT_EQ(j.at("step"), 7);
    bool found = false;
    for (const json& t : j.at("threads")) {
      if (t.at("doing") == json::array({"step 7", "forward (micro-batch)", "forward layers.3"})) found = true;
    }
    EXPECT_TRUE(found) << j.dump(1);
    ASSERT_EQ(j.at("groups").size(), 1u);
    EXPECT_EQ(j.at("groups")[0].at("entries")[0].at("op"), "barrier");
  }
  // An exception that unwinds the spans leaves where it failed; a later dump after the
  // ring's communicator is gone repeats its last entries.
  try {
    const trace::Span step("step", "step 8");
    const trace::Span backward("compute", "backward layers.2");
    throw tessera::Error("boom");
  } catch (const tessera::Error&) {
  }
  ring.reset();
  flight::dump("after the error");
  const json j = json::parse(std::ifstream(dir + "/a/rank_3.json"));
  EXPECT_EQ(j.at("reason"), "after the error");
  EXPECT_TRUE(j.value("groups_from_earlier_dump", false));
  ASSERT_EQ(j.at("groups").size(), 1u);
  bool failedIn = false;
  for (const json& t : j.at("threads")) {
    if (t.value("failed_in", json::array()) == json::array({"step 8", "backward layers.2"})) failedIn = true;
  }
  EXPECT_TRUE(failedIn) << j.dump(1);
  flight::setDumpFiles({}, -1, 0);
}

TEST(FlightRecorderTest, ADumpThatCannotBeWrittenIsNotAnError) {
  const std::string dir = tessera::test::scratchPath("flight", "unwritable");
  fs::create_directories(dir);
  std::ofstream(dir + "/file") << "x";
  flight::setDumpFiles({dir + "/file/rank_0.json"}, 0, 1);  // a file where its directory should be
  EXPECT_TRUE(flight::dump("nowhere to go").empty());
  flight::setDumpFiles({}, -1, 0);
}

// A dump as the recorder writes it, built by hand.
struct DumpBuilder {
  json j;
  DumpBuilder(int rank, const std::string& reason, std::vector<std::string> doing = {}) {
    j = {{"format", "tessera.flight/1"}, {"rank", rank}, {"world_size", 3}, {"reason", reason}, {"step", 3},
         {"threads", json::array()}, {"groups", json::array()}};
    if (!doing.empty()) j["threads"].push_back({{"thread", "main"}, {"doing", doing}, {"for_s", 12.0}});
  }
  // Entries #0..#n-1 of group world (members 0..2): all completed but the last when `lastPending`.
  DumpBuilder& group(int n, bool lastPending, int64_t numelOfLast = 256) {
    json entries = json::array();
    for (int seq = 0; seq < n; ++seq) {
      const bool last = seq == n - 1;
      entries.push_back({{"seq", seq}, {"op", "all_reduce"}, {"dtype", "Float"}, {"numel", last ? numelOfLast : 256},
                         {"bytes", 1024}, {"tag", "layers.1"}, {"thread", "main"}, {"step", seq + 1},
                         {"state", last && lastPending ? "waiting" : "completed"}, {"issued_s_ago", 5.0},
                         {"wait_s_ago", 4.5}});
    }
    j["groups"].push_back({{"group", "world"}, {"backend", "gloo"}, {"rank", j.at("rank")}, {"members", {0, 1, 2}},
                           {"next_seq", n}, {"entries", entries}});
    return *this;
  }
  void write(const std::string& dir) const {
    fs::create_directories(dir);
    std::ofstream(tessera::strCat(dir, "/rank_", j.at("rank").get<int>(), ".json")) << j.dump(1);
  }
};

TEST(FlightVerdictTest, NamesTheRankThatIsBehindAndWhatItWasDoing) {
  const std::string dir = tessera::test::scratchPath("verdict", "behind");
  DumpBuilder(0, "collective #2 timed out").group(3, true).write(dir);
  DumpBuilder(1, "SIGTERM", {"step 3", "forward layers.1"}).group(2, false).write(dir);
  DumpBuilder(2, "collective #2 timed out").group(3, true).write(dir);
  const auto lines = tessera::diagnostics::flightVerdict({dir, 0, {}, {}});
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines[0],
            "rank 1 is behind: ranks 0, 2 waited in collective #2 all_reduce Float x256 'layers.1' at step 3 of group "
            "'world' (gloo) for 4.5 s, which rank 1 never issued (its last was #1 all_reduce Float x256 'layers.1' at "
            "step 2, completed); it was doing: main: step 3 > forward layers.1 (for 12.0 s).")
      << joined(lines);
  EXPECT_TRUE(contains(lines, "rank 0 dumped on collective #2 timed out at step 3")) << joined(lines);
}

TEST(FlightVerdictTest, NamesRanksThatDisagreeOnACollective) {
  const std::string dir = tessera::test::scratchPath("verdict", "mismatch");
  DumpBuilder(0, "error").group(3, true).write(dir);
  DumpBuilder(1, "error").group(3, true).write(dir);
  DumpBuilder(2, "error").group(3, true, 300).write(dir);
  const auto lines = tessera::diagnostics::flightVerdict({dir, 0, {}, {}});
  EXPECT_EQ(lines.at(0),
            "ranks disagree on collective #2 of group 'world' (gloo): ranks 0, 1 issued #2 all_reduce Float x256 "
            "'layers.1' at step 3; rank 2 issued #2 all_reduce Float x300 'layers.1' at step 3. Every rank must issue "
            "the same collectives in the same order with the same sizes.")
      << joined(lines);
}

TEST(FlightVerdictTest, SilentAndStoppedRanksWithTheLaunchersFates) {
  const std::string dir = tessera::test::scratchPath("verdict", "silent");
  DumpBuilder(0, "timed out").group(3, true).write(dir);
  DumpBuilder(2, "timed out").group(3, true).write(dir);
  VerdictInput input{dir, 0, {{1, "killed by signal SIGKILL after 3.1 s"}}, {}};
  auto lines = tessera::diagnostics::flightVerdict(input);
  EXPECT_EQ(lines.at(0),
            "rank 1 left no flight record; ranks 0, 2 waited in collective #2 all_reduce Float x256 'layers.1' at step "
            "3 of group 'world' (gloo) for 4.5 s. Rank 1: killed by signal SIGKILL after 3.1 s.")
      << joined(lines);
  input.stopped = {1};
  lines = tessera::diagnostics::flightVerdict(input);
  EXPECT_EQ(lines.at(0),
            "rank 1 stopped answering: its process was stopped (SIGSTOP or a debugger) when the run was torn down.")
      << joined(lines);
  EXPECT_TRUE(contains(lines, "rank 1 left no flight record")) << joined(lines);
}

TEST(FlightVerdictTest, DamagedDumpsAreLinesNotCrashes) {
  const std::string dir = tessera::test::scratchPath("verdict", "damaged");
  DumpBuilder(0, "timed out").group(3, true).write(dir);
  std::ofstream(dir + "/rank_1.json") << "{\"format\": \"tessera.flight/1\", \"rank\": 1, \"groups\": [";  // cut
  std::ofstream(dir + "/rank_2.json") << json({{"format", "tessera.flight/1"}, {"rank", 2}, {"threads", json::array()},
                                               {"groups", {{{"group", "world"}, {"rank", 9}, {"members", {0, 1}},
                                                            {"next_seq", 0}, {"entries", json::array()}}}}})
                                             .dump();
  ASSERT_EQ(::mkfifo((dir + "/rank_3.json").c_str(), 0600), 0);  // must not block the reader
  fs::create_symlink(dir + "/rank_0.json", dir + "/rank_4.json");
  const auto lines = tessera::diagnostics::flightVerdict({dir, 0, {}, {}});
  EXPECT_TRUE(contains(lines, "unreadable dump " + dir + "/rank_1.json")) << joined(lines);
  EXPECT_TRUE(contains(lines, "rank_2.json: group rank 9 outside its 2 members")) << joined(lines);
  EXPECT_TRUE(contains(lines, "unreadable dump " + dir + "/rank_3.json")) << joined(lines);
  EXPECT_TRUE(contains(lines, "unreadable dump " + dir + "/rank_4.json")) << joined(lines);
  EXPECT_THROW(tessera::diagnostics::flightVerdict({dir + "/missing", 0, {}, {}}), tessera::Error);
}

// The counters tessera-run reports at a run's end (fault.survive's): the largest of each over
// the readable dumps; a cut dump, a FIFO, a symlink, a directory and counts that are not
// whole numbers from 0 to 2^63 - 1 are skipped, never a hang or a crash.
TEST(FlightVerdictTest, CountersComeFromTheReadableDumps) {
  const std::string dir = tessera::test::scratchPath("verdict", "counters");
  fs::create_directories(dir);
  std::ofstream(dir + "/rank_0.json") << json({{"rank", 0}, {"counters", {{"lost", 2}, {"back", 1}}}}).dump();
  std::ofstream(dir + "/rank_1.json") << json({{"rank", 1}, {"counters", {{"lost", 1}, {"back", 3}}}}).dump();
  std::ofstream(dir + "/rank_2.json") << "{\"counters\": {\"lost\": 50";  // cut
  ASSERT_EQ(::mkfifo((dir + "/rank_3.json").c_str(), 0600), 0);
  std::ofstream(dir + "/elsewhere.json") << json({{"counters", {{"lost", 70}}}}).dump();
  fs::create_symlink(dir + "/elsewhere.json", dir + "/rank_4.json");
  fs::create_directories(dir + "/rank_5.json");
  std::ofstream(dir + "/rank_6.json") << "{\"counters\": {\"lost\": 18446744073709551615, \"back\": -5, "
                                         "\"other\": \"9\", \"big\": 1e300}}";
  const auto counters = tessera::diagnostics::dumpCounters(dir);
  EXPECT_EQ(counters.at("lost"), 2);
  EXPECT_EQ(counters.at("back"), 3);
  EXPECT_EQ(counters.count("other") + counters.count("big"), 0u);
  EXPECT_TRUE(tessera::diagnostics::dumpCounters(dir + "/missing").empty());
}

// Crafted dumps: a member rank beyond the world does not make the verdict list that many
// ranks (its group is ignored, said in a line; one of 2e9 makes the dump unreadable), and a tag, reason or thread holding a newline
// or other control characters cannot forge a line of the verdict.
TEST(FlightVerdictTest, CraftedRanksAndTextCannotDriveTheVerdict) {
  const std::string dir = tessera::test::scratchPath("verdict", "crafted");
  DumpBuilder(0, "timed out\nrank 2 is behind: forged").group(3, true).write(dir);
  DumpBuilder forged(1, "timed out", {"step 3\rforged", "x"});
  forged.group(2, false);
  forged.j["groups"][0]["entries"][1]["tag"] = "layers.1\nrank 0 is behind: forged";
  forged.j["groups"].push_back({{"group", "huge"}, {"backend", "gloo"}, {"rank", 0}, {"members", {1, 5000}},
                                {"next_seq", 0}, {"entries", json::array()}});
  forged.write(dir);
  DumpBuilder(2, "timed out").group(3, true).write(dir);
  const auto lines = tessera::diagnostics::flightVerdict({dir, 0, {}, {}});
  ASSERT_LT(lines.size(), 20u) << joined(lines);
  for (const std::string& line : lines) {
    EXPECT_EQ(line.find('\n'), std::string::npos) << line;
    EXPECT_EQ(line.find('\r'), std::string::npos) << line;
    EXPECT_NE(line.rfind("rank 0 is behind", 0), 0u) << line;
    EXPECT_NE(line.rfind("rank 2 is behind", 0), 0u) << line;
  }
  EXPECT_TRUE(contains(lines, "names rank 5000, outside the world of 3 ranks")) << joined(lines);
  EXPECT_TRUE(contains(lines, "rank 1 is behind")) << joined(lines);
  EXPECT_TRUE(contains(lines, "\\nrank 0 is behind: forged")) << joined(lines);
}

TEST(FlightVerdictTest, NoDumpsSaysSo) {
  const std::string dir = tessera::test::scratchPath("verdict", "empty");
  fs::create_directories(dir);
  const auto lines = tessera::diagnostics::flightVerdict({dir, 2, {}, {}});
  EXPECT_TRUE(contains(lines, "no flight dumps in " + dir)) << joined(lines);
  EXPECT_TRUE(contains(lines, "rank 1: no dump here")) << joined(lines);
}

}  // namespace
