// Run metrics: JSON lines in <run.dir>/metrics.jsonl, a console line (or a progress
// bar with ETA on a terminal), and the loss curve as an SVG at the end of the run.
#pragma once

#include <cstdint>
#include <map>
#include <limits>
#include <string>
#include <vector>

namespace tessera::trainer {

struct StepMetrics {
  int64_t step = 0;           // optimizer steps completed
  double loss = 0;            // mean training loss over the global batch
  double lr = 0;
  double gradNorm = 0;        // global L2 norm of the averaged gradients (before clipping)
  double samplesPerSec = 0;   // over all ranks
  double stepTimeMs = 0;      // mean wall time per step since the last record
  double peakRssMiB = 0;      // max over ranks of the peak resident set size
  double commMiB = 0;         // bytes sent by this rank since the last record
  // Collectives this rank issued on the world communicator since the last record, per
  // step (checkpoint saves in the window included; hybrid's group collectives not).
  double collectivesPerStep = 0;
  std::map<std::string, double> extra;  // e.g. eval_loss, eval_loss_ema

  // Every figure by its name in metrics.jsonl, in a fixed order (step excluded): the one
  // list that metrics.jsonl and TensorBoard (under tensorBoardTag) both write.
  std::vector<std::pair<std::string, double>> named() const;
};

// The TensorBoard tag of a metrics.jsonl name, grouped the way TensorBoard shows sections:
// "eval/eval_loss", "perf/step_time_ms", "memory/peak_rss_mib", "comm/comm_mib",
// "train/loss" (every other figure of training: lr, grad_norm, critic_loss, ...).
std::string tensorBoardTag(const std::string& name);

class MetricsLog {
 public:
  // Appends to `jsonlPath` (created with its directory when missing). A run resumed at
  // `resumedStep` continues the metrics of the run up to that step: lines of later steps
  // (written after the checkpoint it resumes from, and about to be trained again) and lines
  // cut short are dropped first, so every step appears once. The default keeps every line.
  MetricsLog(const std::string& jsonlPath, int64_t totalSteps,
             int64_t resumedStep = std::numeric_limits<int64_t>::max());
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  // Writes one JSON line and a console line.
  void record(const StepMetrics& m);
  // Writes every loss curve recorded (training, critic, held-out with the live weights and
  // each EMA: the figures named loss or *_loss*) to `svgPath` with a legend, headed `title`,
  // on a log-scale y axis when `logScale`.
  void writeLossCurve(const std::string& svgPath, const std::string& title, bool logScale) const;

 private:
  std::string jsonlPath_;
  int fd_ = -1;  // jsonlPath_, opened for appending
  int64_t totalSteps_;
  bool terminal_;
  double startSec_;
  std::map<std::string, std::vector<std::pair<int64_t, double>>> curves_;  // by metrics.jsonl name
};

// Whether a metrics.jsonl figure is a loss the run's picture draws.
bool isLossCurve(const std::string& name);

// One line of a chart, named in its legend.
struct ChartSeries {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (x, y)
};

// "step 100/300 loss 2.1234 lr 0.003 gnorm ..." : the line a metrics record is logged as.
std::string formatStepLine(const StepMetrics& m, int64_t totalSteps);

// Renders series of (x, y) points as a standalone SVG line chart with a legend, the y
// axis linear or logarithmic (points <= 0 are left out of a log chart). Hand-written: a
// few dozen lines of SVG need no plotting library, and none is packaged for C++ in Debian.
std::string renderLineChartSvg(const std::vector<ChartSeries>& series, const std::string& title,
                               const std::string& xLabel, const std::string& yLabel, bool logScale = false);
// Charts of renderLineChartSvg one above the other in one SVG: for figures whose ranges are
// too far apart to share a y axis (a Frechet distance of 30 and an accuracy of 84%).
std::string stackChartsSvg(const std::vector<std::string>& charts);

// Peak resident set size of this process in MiB (VmHWM from /proc/self/status).
double peakRssMiB();

}  // namespace tessera::trainer
