// Stragglers: the rank whose steps take longest, named while the run goes on. Each rank's
// time per step splits into busy (its own work: compute, copies, its data) and waiting
// (blocked in collectives until the others arrive); every rank waits for the slowest, so
// the slowest is the one busy longest, and what it costs the run is its lag behind the
// others' busy time. Each metrics window's figures per rank are gathered on the window's
// existing collective (no extra one); the decision is taken over spans of a few seconds
// of windows, as one window of a few short steps can be noise.
#pragma once

#include <string>
#include <vector>

namespace tessera::trainer {

// One rank's window, per step.
struct RankPace {
  double busyMs = 0;  // the step's wall time less the time blocked in collectives
  double waitMs = 0;  // blocked in collectives
};

struct StragglerReport {
  int slowestRank = -1;     // -1: fewer than two ranks
  double lagMs = 0;         // its busy time per step above the median of the others'
  double busyMs = 0;        // its busy time per step
  double othersBusyMs = 0;  // the median of the others' busy time per step
  double othersWaitMs = 0;  // the median of the others' time blocked in collectives per step
  // busyMs > ratio x othersBusyMs, and a lag that matters: at least 1 ms and 5% of the
  // step (`stepMs`); below that, a window of a few short steps is noise.
  bool slow = false;
};

// The slowest of `ranks` (indexed by rank) and whether it is slower than `ratio` times the
// others (diagnostics.straggler_ratio; 0: never slow) in a window of steps of `stepMs`.
StragglerReport findStraggler(const std::vector<RankPace>& ranks, double ratio, double stepMs);

// Sums the windows' paces over spans of at least `spanMs` of steps and decides on each span
// whether its slowest rank is slow (findStraggler): what rank 0 names in its log.
class StragglerWatch {
 public:
  StragglerWatch(double ratio, double spanMs = 5000) : ratio_(ratio), spanMs_(spanMs) {}
  // One metrics window: each rank's pace per step over `steps` steps of `stepMs`. Returns
  // whether to name the span's slowest rank now (into `report`): when a span it completes
  // finds one slow, first, then every 10th span in a row that finds the same rank slow.
  bool add(const std::vector<RankPace>& paces, int64_t steps, double stepMs, StragglerReport& report);

 private:
  double ratio_, spanMs_;
  std::vector<RankPace> sums_;  // per rank, summed over the span's steps
  int64_t steps_ = 0;
  double wallMs_ = 0;
  int lastSlow_ = -1, streak_ = 0;  // the rank found slow in a row of spans, and how many
};

// "rank 1 is slow: 35.2 ms per step behind the others (busy 80.1 ms per step, the others'
// median 44.9 ms; they wait for it in collectives, 33.0 ms per step)".
std::string describeStraggler(const StragglerReport& report);

}  // namespace tessera::trainer
