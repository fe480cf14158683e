// The slowest rank of a metrics window (see stragglers.h).
#include "trainer/stragglers.h"

#include <algorithm>

#include "common/errors.h"

namespace tessera::trainer {

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string ms(double v) { return strCat(static_cast<double>(static_cast<int64_t>(v * 10.0 + 0.5)) / 10.0, " ms"); }

}  // namespace

StragglerReport findStraggler(const std::vector<RankPace>& ranks, double ratio, double stepMs) {
  StragglerReport r;
  if (ranks.size() < 2) return r;
  const auto slowest =
      std::max_element(ranks.begin(), ranks.end(), [](const RankPace& a, const RankPace& b) { return a.busyMs < b.busyMs; });
  r.slowestRank = static_cast<int>(slowest - ranks.begin());
  std::vector<double> busy, wait;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (static_cast<int>(i) == r.slowestRank) continue;
    busy.push_back(ranks[i].busyMs);
    wait.push_back(ranks[i].waitMs);
  }
  r.busyMs = slowest->busyMs;
  r.othersBusyMs = median(busy);
  r.othersWaitMs = median(wait);
  r.lagMs = r.busyMs - r.othersBusyMs;
  r.slow = ratio > 0 && r.lagMs >= std::max(1.0, 0.05 * stepMs) && r.busyMs > ratio * r.othersBusyMs;
  return r;
}

bool StragglerWatch::add(const std::vector<RankPace>& paces, int64_t steps, double stepMs, StragglerReport& report) {
  if (sums_.size() != paces.size()) sums_.assign(paces.size(), RankPace{});
  for (size_t r = 0; r < paces.size(); ++r) {
    sums_[r].busyMs += paces[r].busyMs * static_cast<double>(steps);
    sums_[r].waitMs += paces[r].waitMs * static_cast<double>(steps);
  }
  steps_ += steps;
  wallMs_ += stepMs * static_cast<double>(steps);
  if (wallMs_ < spanMs_ || steps_ == 0) return false;
  std::vector<RankPace> perStep;
  for (const RankPace& s : sums_) {
    perStep.push_back({s.busyMs / static_cast<double>(steps_), s.waitMs / static_cast<double>(steps_)});
  }
  report = findStraggler(perStep, ratio_, wallMs_ / static_cast<double>(steps_));
  sums_.assign(paces.size(), RankPace{});
  steps_ = 0;
  wallMs_ = 0;
  const bool again = report.slow && report.slowestRank == lastSlow_;
  streak_ = report.slow ? (again ? streak_ + 1 : 1) : 0;
  lastSlow_ = report.slow ? report.slowestRank : -1;
  return streak_ == 1 || (streak_ > 1 && streak_ % 10 == 1);
}

std::string describeStraggler(const StragglerReport& r) {
  return strCat("rank ", r.slowestRank, " is slow: ", ms(r.lagMs), " per step behind the others (busy ", ms(r.busyMs),
                " per step, the others' median ", ms(r.othersBusyMs), "; they wait for it in collectives, ",
                ms(r.othersWaitMs), " per step)");
}

}  // namespace tessera::trainer
