// profile: a 2-rank zero3 GPT's timeline, read from the merged Chrome trace: both ranks'
// tracks are there, the next unit's all-gather overlaps the current unit's forward
// (prefetch), and the step's phases account for its time.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "tests/support/run_command.h"
#include "tests/support/scratch_path.h"

namespace {

namespace fs = std::filesystem;

const std::string kBin = TESSERA_BIN_DIR;

struct Span {
  std::string name, category, track;
  int pid = 0;
  double begin = 0, end = 0;  // microseconds
};

std::vector<Span> readTrace(const std::string& path) {
  std::ifstream in(path);
  const nlohmann::json trace = nlohmann::json::parse(in);
  std::map<std::pair<int, int>, std::string> tracks;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") == "M" && e.at("name") == "thread_name") tracks[{e.at("pid"), e.at("tid")}] = e.at("args").at("name");
  }
  std::vector<Span> spans;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    const double ts = e.at("ts").get<double>(), dur = e.at("dur").get<double>();
    spans.push_back({e.at("name"), e.at("cat"), tracks.at({e.at("pid"), e.at("tid")}), e.at("pid"), ts, ts + dur});
  }
  return spans;
}

TEST(ProfileE2ETest, Zero3TraceShowsPrefetchOverlapAndAccountsForTheStep) {
  const std::string dir = tessera::test::scratchPath("tessera_profile", "gpt");
  fs::remove_all(dir);
  const auto r = tessera::test::runCommand(
      kBin + "/tessera-run --standalone --nproc-per-node 2 " + kBin + "/tessera-train --config " + TESSERA_SOURCE_DIR +
          "/configs/default.yaml --set run.dir=" + dir +
          " --set run.steps=8 --set optim.schedule.warmup_steps=2 --set checkpoint.every_steps=0"
          " --set model.arch=gpt --set model.embed_dim=64 --set model.layers=3 --set model.heads=4"
          " --set sharding.strategy=zero3 --set sharding.min_unit_params=0 --set data.micro_batch=32"
          " --set profile.start_step=5 --set profile.steps=2",
      300);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("profile: steps 5-6 of 2 ranks traced into " + dir + "/profile/trace.json"),
            std::string::npos)
      << r.output;
  for (const char* rankFile : {"rank_0.json", "rank_1.json"}) EXPECT_TRUE(fs::exists(fs::path(dir) / "profile" / rankFile));
  const std::vector<Span> spans = readTrace(dir + "/profile/trace.json");

  for (int rank : {0, 1}) {
    auto find = [&](const std::string& name, const std::string& track) -> std::vector<const Span*> {
      std::vector<const Span*> out;
      for (const Span& s : spans) {
        if (s.pid == rank && s.name == name && s.track.rfind(track, 0) == 0) out.push_back(&s);
      }
      return out;
    };
    const auto steps = find("step 5", "main");
    ASSERT_EQ(steps.size(), 1u) << "rank " << rank;
    ASSERT_EQ(find("step 6", "main").size(), 1u);
    EXPECT_FALSE(find("prepare the batch of step 6", "data loader").empty()) << "rank " << rank;

    // Prefetch: unit h.k's all-gather is in flight while h.(k-1) computes its forward, and
    // the forward of h.k waits for less than the gather took.
    int overlapping = 0;
    for (int k = 1; k < 3; ++k) {
      const std::string unit = "h." + std::to_string(k), previous = "h." + std::to_string(k - 1);
      for (const Span* gather : find("all_gather " + unit + " (97.6 KiB)", "collectives")) {
        for (const Span* forward : find("forward " + previous, "main")) {
          if (gather->begin < forward->end && gather->end > forward->begin) ++overlapping;
        }
      }
    }
    EXPECT_GE(overlapping, 2) << "rank " << rank << ": no all-gather of the next unit overlaps a unit's forward";

    // The step's phases (the main thread's outermost spans inside it) cover >= 90% of it.
    for (const Span* step : {steps[0], find("step 6", "main")[0]}) {
      std::vector<std::pair<double, double>> inside;
      for (const Span& s : spans) {
        if (s.pid == rank && s.track == "main" && &s != step && s.begin >= step->begin && s.end <= step->end) {
          inside.emplace_back(s.begin, s.end);
        }
      }
      std::sort(inside.begin(), inside.end());
      double covered = 0, reach = step->begin;
      for (const auto& [b, e] : inside) {
        if (e <= reach) continue;
        covered += e - std::max(b, reach);
        reach = e;
      }
      const double duration = step->end - step->begin;
      EXPECT_GE(covered, 0.9 * duration) << "rank " << rank << " " << step->name << ": phases cover " << covered
                                         << " of " << duration << " us";
      EXPECT_LE(covered, duration);
    }
  }
  // Clocks aligned: both ranks' step 5 start within 5 ms of each other (they start
  // together, after the step before's gradient-norm all-reduce).
  double begins[2] = {0, 0};
  for (const Span& s : spans) {
    if (s.name == "step 5") begins[s.pid] = s.begin;
  }
  EXPECT_LT(std::abs(begins[0] - begins[1]), 5000.0);
}

// A window past the end of the run is a config error naming the key.
TEST(ProfileE2ETest, WindowPastTheRunIsRefused) {
  const auto r = tessera::test::runCommand(kBin + "/tessera-train --config " + TESSERA_SOURCE_DIR +
                                           "/configs/default.yaml --set run.steps=30 --set profile.start_step=30"
                                           " --set profile.steps=2 --set run.dir=" +
                                           tessera::test::scratchPath("tessera_profile", "refused"));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--set profile.start_step=30: profile.start_step: 30 + profile.steps (2) - 1 is past "
                          "run.steps (30) (profile.steps: --set profile.steps=2; run.steps: --set run.steps=30)"),
            std::string::npos)
      << r.output;
}

}  // namespace
