// profile: {start_step, steps}: the timeline (common/trace.h) of those steps on every rank,
// written as Chrome-trace JSON: <run.dir>/profile/rank_<r>.json by each rank and, merged
// by rank 0, <run.dir>/profile/trace.json (one process per rank, one track per thread and
// per communicator's collectives; clocks aligned at the barrier that opens the window).
// Opens in Perfetto (ui.perfetto.dev) and chrome://tracing. profile.aten_ops adds every
// LibTorch operator (AtenOpRecorder).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/trace.h"
#include "trainer/train_config.h"

namespace tessera::distributed {
class Communicator;
}

namespace tessera::trainer {

// One rank's events as Chrome-trace JSON events (times in microseconds from `originNs`,
// `pid` = rank, a `tid` per track with its thread_name record).
std::string chromeTraceEvents(const std::vector<trace::Event>& events, int rank, int64_t originNs);

// While alive, every LibTorch operator any thread of the process runs (forward and backward
// functions) is recorded as an event of category "aten" on that thread's track when a window
// is open: what the spans' tensor work is made of (profile.aten_ops; the plain loop's bench).
// Each operator then costs two clock reads and a lock.
class AtenOpRecorder {
 public:
  AtenOpRecorder();
  ~AtenOpRecorder();
  AtenOpRecorder(const AtenOpRecorder&) = delete;
  AtenOpRecorder& operator=(const AtenOpRecorder&) = delete;

 private:
  uint64_t handle_;
};

class ProfileWindow {
 public:
  ProfileWindow(const ProfileSection& profile, distributed::Communicator& hostComm, std::filesystem::path runDir);

  // Before the step that makes `done` + 1 steps: opens the window at profile.start_step.
  // Collective (a barrier) when it opens.
  void beforeStep(int64_t done);
  // After `done` steps: closes it after the last traced step and writes the files.
  // Collective when it closes. Returns the merged trace's path on rank 0 then, else "".
  std::string afterStep(int64_t done);

 private:
  ProfileSection profile_;
  distributed::Communicator& comm_;
  std::filesystem::path dir_;
  bool open_ = false;
  std::unique_ptr<AtenOpRecorder> atenOps_;  // while open, with profile.aten_ops
  int64_t originNs_ = 0;  // this rank's clock reading that rank 0's origin corresponds to
};

}  // namespace tessera::trainer
