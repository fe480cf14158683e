// What a run shows of itself, end to end. profile: a 2-rank zero3 GPT's timeline, read
// from the merged Chrome trace: both ranks' tracks are there, the next unit's all-gather
// overlaps the current unit's forward (prefetch), and the step's phases account for its
// time. The memory breakdown of zero3 at 2 and 8 ranks adds up to the peak RSS.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "tests/support/run_command.h"
#include "tests/support/run_files.h"
#include "tests/support/scratch_path.h"

namespace {

namespace fs = std::filesystem;

using tessera::test::kBin;

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

// profile.aten_ops: every LibTorch operator of the traced steps is an "aten" event on the
// thread that ran it, inside that thread's spans (the step's forward's products and the
// backward's functions among them), and only inside the window; without the key, none.
TEST(ProfileE2ETest, AtenOpsAreTracedInsideTheStepsOnlyWhenAsked) {
  for (const bool ops : {true, false}) {
    const std::string dir = tessera::test::scratchPath("tessera_profile", ops ? "aten" : "no_aten");
    fs::remove_all(dir);
    const auto r = tessera::test::runCommand(
        kBin + "/tessera-train --config " + TESSERA_SOURCE_DIR + "/configs/default.yaml --set run.dir=" + dir +
            " --set run.steps=6 --set optim.schedule.warmup_steps=2 --set checkpoint.every_steps=0"
            " --set profile.start_step=4 --set profile.steps=2"
            " --set profile.aten_ops=" + (ops ? "true" : "false"),
        300);
    ASSERT_EQ(r.status, 0) << r.output;
    const std::vector<Span> spans = readTrace(dir + "/profile/trace.json");
    std::vector<const Span*> steps, aten;
    for (const Span& s : spans) {
      if (s.name == "step 4" || s.name == "step 5") steps.push_back(&s);
      if (s.category == "aten") aten.push_back(&s);
    }
    ASSERT_EQ(steps.size(), 2u);
    if (!ops) {
      EXPECT_TRUE(aten.empty()) << aten.size() << " aten events without profile.aten_ops";
      continue;
    }
    bool sawBackwardFunction = false, sawGelu = false;
    for (const Span* a : aten) {
      // Every operator lies within the window's two steps (the loader's next batch may run
      // on its own thread up to the window's end).
      EXPECT_GE(a->begin, steps[0]->begin - 1.0) << a->name;
      EXPECT_LE(a->end, steps[1]->end + 1.0) << a->name;
      sawBackwardFunction |= a->name.rfind("autograd::engine::evaluate_function: ", 0) == 0;
      sawGelu |= a->name == "aten::gelu";
    }
    EXPECT_GT(aten.size(), 100u);
    EXPECT_TRUE(sawBackwardFunction);
    EXPECT_TRUE(sawGelu);
  }
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

// Each logged window's breakdown (rank 0's, in metrics.jsonl) adds up to that rank's peak
// RSS within 10%, for zero3 at 2 and at 8 ranks: every part is measured on its own (the
// state's storages, the gathered units' peak, the host allocator's peak in use and mapped,
// glibc's count of malloc's heap, a snapshot before the first step), so a gap is memory
// none of them accounts for.
TEST(MemoryBreakdownE2ETest, Zero3BreakdownAddsUpToThePeakRss) {
  for (int world : {2, 8}) {
    const std::string dir = tessera::test::scratchPath("tessera_memory", "zero3_w" + std::to_string(world));
    fs::remove_all(dir);
    const auto r = tessera::test::runCommand(
        kBin + "/tessera-run --standalone --nproc-per-node " + std::to_string(world) + " " + kBin +
            "/tessera-train --config " + TESSERA_SOURCE_DIR + "/configs/default.yaml --set run.dir=" + dir +
            " --set run.steps=6 --set run.log_every=3 --set optim.schedule.warmup_steps=2"
            " --set checkpoint.every_steps=0 --set checkpoint.at_end=false --set checkpoint.export=[]"
            " --set model.arch=gpt --set model.embed_dim=256 --set model.layers=4 --set model.heads=4"
            " --set model.context=64 --set data.global_batch=64 --set data.micro_batch=" + std::to_string(64 / world) +
            " --set sharding.strategy=zero3 --set sharding.min_unit_params=0",
        600);
    ASSERT_EQ(r.status, 0) << r.output;
    const size_t line = r.output.find("memory at the run's peak (");
    ASSERT_NE(line, std::string::npos) << r.output;
    EXPECT_NE(r.output.find("): runtime ", line), std::string::npos) << r.output;
    const auto metrics = tessera::test::readMetrics(dir);
    ASSERT_EQ(metrics.size(), 2u);
    for (const auto& line : metrics) {
      const double total = line.at("mem_total_mib").get<double>(), rss = line.at("mem_peak_rss_mib").get<double>();
      EXPECT_NEAR(total, rss, 0.1 * rss) << "world " << world << " step " << line["step"] << ": " << line.dump();
      // zero3: the module holds no parameters between steps; the masters are the
      // optimizer's, gradients stay as shards, units are gathered one or two at a time.
      EXPECT_EQ(line.at("mem_params_mib").get<double>(), 0.0);
      for (const char* part : {"mem_runtime_mib", "mem_malloc_heap_mib", "mem_grads_mib", "mem_optimizer_mib", "mem_ema_mib",
                               "mem_gathered_mib", "mem_activations_mib"}) {
        EXPECT_GT(line.at(part).get<double>(), 0.0) << part << " at world " << world;
      }
      // The window's peak (VmHWM restarts with each window), at most the run's over the ranks.
      EXPECT_LE(line.at("mem_peak_rss_mib").get<double>(), line.at("peak_rss_mib").get<double>());
    }
  }
}

}  // namespace
