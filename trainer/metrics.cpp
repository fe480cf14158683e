// Metrics log, console progress and SVG loss curve (see metrics.h).
#include "trainer/metrics.h"

#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "common/clock.h"
#include "common/errors.h"
#include "common/file_open.h"
#include "common/logging.h"
#include "trainer/memory_breakdown.h"

namespace tessera::trainer {
namespace {
std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}
}  // namespace

MetricsLog::MetricsLog(const std::string& jsonlPath, int64_t totalSteps, int64_t resumedStep)
    : jsonlPath_(jsonlPath), totalSteps_(totalSteps), terminal_(::isatty(STDERR_FILENO) == 1), startSec_(steadySeconds()) {
  std::filesystem::create_directories(std::filesystem::path(jsonlPath).parent_path());
  // Opened first: a link or a FIFO planted at the name is refused before anything is read.
  fd_ = openForAppend(jsonlPath);
  try {
    constexpr int64_t kMaxMetricsBytes = int64_t{1} << 30;
    std::istringstream previous(readRegularFile(jsonlPath, kMaxMetricsBytes, LinkPolicy::kRefuse));
    std::string kept;
    bool dropped = false;
    for (std::string line; std::getline(previous, line);) {
      try {
        const auto j = nlohmann::json::parse(line);
        const int64_t step = j.at("step").get<int64_t>();
        if (step > resumedStep) {  // trained again by this run
          dropped = true;
          continue;
        }
        for (const auto& [name, value] : j.items()) {
          if (isLossCurve(name) && value.is_number()) curves_[name].emplace_back(step, value.get<double>());
        }
        kept += line + "\n";
      } catch (const nlohmann::json::exception&) {
        dropped = true;  // a line cut short by a crash is dropped, not fatal
      }
    }
    if (dropped) {
      ::close(fd_);
      fd_ = -1;
      replaceFile(jsonlPath, kept);
      fd_ = openForAppend(jsonlPath);
    }
  } catch (...) {
    if (fd_ >= 0) ::close(fd_);
    throw;
  }
}

MetricsLog::~MetricsLog() {
  if (fd_ >= 0) ::close(fd_);
}

std::vector<std::pair<std::string, double>> StepMetrics::named() const {
  std::vector<std::pair<std::string, double>> out = {
      {"loss", loss},          {"lr", lr},         {"grad_norm", gradNorm},
      {"samples_per_sec", samplesPerSec},          {"step_time_ms", stepTimeMs},
      {"peak_rss_mib", peakRssMiB}, {"comm_mib", commMiB}, {"collectives_per_step", collectivesPerStep}};
  for (const auto& [k, v] : extra) out.emplace_back(k, v);
  return out;
}

std::string tensorBoardTag(const std::string& name) {
  auto startsWith = [&](const char* prefix) { return name.rfind(prefix, 0) == 0; };
  if (startsWith("eval_")) return "eval/" + name;
  if (name == "samples_per_sec" || name == "step_time_ms" || name == "data_wait_ms" || startsWith("mfu") ||
      startsWith("slowest_rank") ||
      startsWith("tokens_per_sec") || startsWith("images_per_sec") || startsWith("tflops")) {
    return "perf/" + name;
  }
  if (startsWith("peak_") || startsWith("mem_")) return "memory/" + name;
  if (startsWith("comm") || startsWith("collectives")) return "comm/" + name;
  return "train/" + name;
}

void MetricsLog::record(const StepMetrics& m) {
  nlohmann::json j = {{"step", m.step}};
  for (const auto& [k, v] : m.named()) j[k] = v;
  // When the row was written, Unix seconds (TensorBoard's events carry their own): what a
  // lost rank's timeline is read from.
  j["time"] = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  const std::string jsonLine = j.dump() + "\n";
  writeAllTo(fd_, jsonLine.data(), jsonLine.size(), jsonlPath_);
  for (const auto& [name, value] : m.named()) {
    if (isLossCurve(name)) curves_[name].emplace_back(m.step, value);
  }

  const double elapsed = steadySeconds() - startSec_;
  const double eta = m.step > 0 ? elapsed / static_cast<double>(m.step) * static_cast<double>(totalSteps_ - m.step) : 0;
  const std::string line = formatStepLine(m, totalSteps_);
  if (terminal_) {
    // A progress bar with ETA on a terminal (the log file gets the plain line); plain log
    // lines otherwise.
    const int width = 30;
    const int filled = totalSteps_ > 0 ? static_cast<int>(width * m.step / totalSteps_) : width;
    std::string bar = "[" + std::string(filled, '#') + std::string(width - filled, '.') + "]";
    std::fprintf(stderr, "\r%s %s ETA %ss\n", bar.c_str(), line.c_str(), fixed(eta, 0).c_str());
    log::writeToFile(log::Level::kInfo, line);
  } else {
    TLOG_INFO(line << " eta " << fixed(eta, 0) << "s");
  }
}

std::string formatStepLine(const StepMetrics& m, int64_t totalSteps) {
  std::ostringstream line;
  line << "step " << m.step << "/" << totalSteps << " loss " << fixed(m.loss, 4) << " lr " << m.lr << " gnorm "
       << fixed(m.gradNorm, 3) << " " << fixed(m.samplesPerSec, 1) << " samples/s " << fixed(m.stepTimeMs, 1)
       << " ms/step rss " << fixed(m.peakRssMiB, 0) << " MiB comm " << fixed(m.commMiB, 2) << " MiB";
  for (const auto& [k, v] : m.extra) {
    if (k.rfind("mem_", 0) == 0) continue;  // the breakdown: metrics.jsonl, TensorBoard and the run's last line
    line << " " << k << " " << fixed(v, 4);
  }
  return line.str();
}

bool isLossCurve(const std::string& name) {
  const std::string suffix = "_loss";
  return name == "loss" || name.find("_loss_") != std::string::npos ||
         (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0);
}

void MetricsLog::writeLossCurve(const std::string& svgPath, const std::string& title, bool logScale) const {
  std::vector<ChartSeries> series;
  auto train = curves_.find("loss");
  const auto line = [](const std::string& name, const std::vector<std::pair<int64_t, double>>& points) {
    ChartSeries s{name, {}};
    for (const auto& [step, y] : points) s.points.emplace_back(static_cast<double>(step), y);
    return s;
  };
  if (train != curves_.end()) series.push_back(line("train loss", train->second));
  for (const auto& [name, points] : curves_) {
    if (name != "loss") series.push_back(line(name, points));
  }
  replaceFile(svgPath, renderLineChartSvg(series, title, "step", logScale ? "loss (log scale)" : "loss", logScale));
}

namespace {

// Text as SVG (XML) character data: a run name may hold '<' or '&'.
std::string xmlText(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

}  // namespace

namespace {
// The size of one chart of renderLineChartSvg, in SVG units.
constexpr int kChartWidth = 720, kChartHeight = 420;
}  // namespace

std::string stackChartsSvg(const std::vector<std::string>& charts) {
  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kChartWidth << "\" height=\""
      << kChartHeight * static_cast<int>(charts.size()) << "\">\n";
  for (size_t i = 0; i < charts.size(); ++i) {
    svg << "<g transform=\"translate(0," << kChartHeight * static_cast<int>(i) << ")\">\n" << charts[i] << "</g>\n";
  }
  svg << "</svg>\n";
  return svg.str();
}

std::string renderLineChartSvg(const std::vector<ChartSeries>& series, const std::string& title,
                               const std::string& xLabel, const std::string& yLabel, bool logScale) {
  const double W = kChartWidth, H = kChartHeight, left = 70, right = 190, top = 40, bottom = 50;
  // What is drawn: on a log axis, the positive finite points; on a linear one, the finite.
  std::vector<ChartSeries> shown;
  for (const ChartSeries& s : series) {
    ChartSeries kept{s.name, {}};
    for (const auto& [x, y] : s.points) {
      if (std::isfinite(y) && (!logScale || y > 0)) kept.points.emplace_back(x, logScale ? std::log10(y) : y);
    }
    shown.push_back(std::move(kept));
  }
  double xMin = 0, xMax = 1, yMin = 0, yMax = 1;
  bool any = false;
  for (const ChartSeries& s : shown) {
    for (const auto& [x, y] : s.points) {
      xMin = any ? std::min(xMin, x) : x;
      xMax = any ? std::max(xMax, x) : x;
      yMin = any ? std::min(yMin, y) : y;
      yMax = any ? std::max(yMax, y) : y;
      any = true;
    }
  }
  if (xMax <= xMin) xMax = xMin + 1;
  if (yMax <= yMin) yMax = yMin + (logScale ? 0.1 : 1.0);
  auto px = [&](double x) { return left + (x - xMin) / (xMax - xMin) * (W - left - right); };
  auto py = [&](double y) { return top + (yMax - y) / (yMax - yMin) * (H - top - bottom); };
  // A tick's label: the value itself on a log axis (10^y), with the digits its spread needs.
  auto yTick = [&](double y) {
    const double value = logScale ? std::pow(10.0, y) : y;
    const double spread = logScale ? value : yMax - yMin;
    return fixed(value, spread >= 100 ? 0 : spread >= 1 ? 2 : 4);
  };
  std::ostringstream s;
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" font-family=\"sans-serif\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"" << (W - right + left) / 2 << "\" y=\"24\" text-anchor=\"middle\" font-size=\"16\">" << xmlText(title)
    << "</text>\n"
    << "<line x1=\"" << left << "\" y1=\"" << H - bottom << "\" x2=\"" << W - right << "\" y2=\"" << H - bottom
    << "\" stroke=\"black\"/>\n"
    << "<line x1=\"" << left << "\" y1=\"" << top << "\" x2=\"" << left << "\" y2=\"" << H - bottom
    << "\" stroke=\"black\"/>\n";
  for (int i = 0; i <= 4; ++i) {
    const double y = yMin + (yMax - yMin) * i / 4.0;
    const double x = xMin + (xMax - xMin) * i / 4.0;
    s << "<line x1=\"" << left << "\" y1=\"" << py(y) << "\" x2=\"" << W - right << "\" y2=\"" << py(y)
      << "\" stroke=\"#e0e0e0\"/>\n"
      << "<text x=\"" << left - 6 << "\" y=\"" << py(y) + 4 << "\" text-anchor=\"end\" font-size=\"11\">" << yTick(y)
      << "</text>\n"
      << "<text x=\"" << px(x) << "\" y=\"" << H - bottom + 16 << "\" text-anchor=\"middle\" font-size=\"11\">"
      << fixed(x, xMax - xMin >= 10 ? 0 : xMax - xMin >= 1 ? 1 : 3) << "</text>\n";
  }
  s << "<text x=\"" << (W - right + left) / 2 << "\" y=\"" << H - 10 << "\" text-anchor=\"middle\" font-size=\"12\">"
    << xmlText(xLabel) << "</text>\n"
    << "<text x=\"16\" y=\"" << H / 2 << "\" text-anchor=\"middle\" font-size=\"12\" transform=\"rotate(-90 16 " << H / 2
    << ")\">" << xmlText(yLabel) << "</text>\n";
  static const char* kColors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                  "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
  for (size_t i = 0; i < shown.size(); ++i) {
    const ChartSeries& line = shown[i];
    const char* color = kColors[i % (sizeof(kColors) / sizeof(kColors[0]))];
    if (line.points.size() > 1) {
      s << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"2\" points=\"";
      for (const auto& [x, y] : line.points) s << fixed(px(x), 1) << "," << fixed(py(y), 1) << " ";
      s << "\"/>\n";
    }
    // Sparse series (evaluations) get their points marked: one evaluation is one dot.
    if (line.points.size() <= 30) {
      for (const auto& [x, y] : line.points) {
        s << "<circle cx=\"" << fixed(px(x), 1) << "\" cy=\"" << fixed(py(y), 1)
          << "\" r=\"3\" fill=\"" << color << "\"/>\n";
      }
    }
    const double ly = top + 10 + 18.0 * static_cast<double>(i);
    s << "<line x1=\"" << W - right + 12 << "\" y1=\"" << ly << "\" x2=\"" << W - right + 36 << "\" y2=\"" << ly
      << "\" stroke=\"" << color << "\" stroke-width=\"3\"/>\n"
      << "<text x=\"" << W - right + 42 << "\" y=\"" << ly + 4 << "\" font-size=\"12\">" << xmlText(line.name)
      << (line.points.empty() ? " (nothing to draw)" : "") << "</text>\n";
  }
  s << "</svg>\n";
  return s.str();
}

double peakRssMiB() { return static_cast<double>(procStatusBytes("VmHWM")) / (1024.0 * 1024.0); }

}  // namespace tessera::trainer
