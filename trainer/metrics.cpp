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

#include "common/errors.h"
#include "common/file_open.h"
#include "common/logging.h"

namespace tessera::trainer {
namespace {
double nowSec() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}
}  // namespace

MetricsLog::MetricsLog(const std::string& jsonlPath, int64_t totalSteps)
    : jsonlPath_(jsonlPath), totalSteps_(totalSteps), terminal_(::isatty(STDERR_FILENO) == 1), startSec_(nowSec()) {
  std::filesystem::create_directories(std::filesystem::path(jsonlPath).parent_path());
  // A resumed run appends to the metrics of the run it continues; its loss curve
  // covers both.
  // Opened first: a link or a FIFO planted at the name is refused before anything is read.
  fd_ = openForAppend(jsonlPath);
  try {
    constexpr int64_t kMaxMetricsBytes = int64_t{1} << 30;
    std::istringstream previous(readRegularFile(jsonlPath, kMaxMetricsBytes, LinkPolicy::kRefuse));
    for (std::string line; std::getline(previous, line);) {
      try {
        const auto j = nlohmann::json::parse(line);
        losses_.emplace_back(j.at("step").get<int64_t>(), j.at("loss").get<double>());
      } catch (const nlohmann::json::exception&) {
        // A line cut short by a crash is skipped, not fatal.
      }
    }
  } catch (...) {
    ::close(fd_);
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
  const std::string jsonLine = j.dump() + "\n";
  writeAllTo(fd_, jsonLine.data(), jsonLine.size(), jsonlPath_);
  losses_.emplace_back(m.step, m.loss);

  const double elapsed = nowSec() - startSec_;
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
  for (const auto& [k, v] : m.extra) line << " " << k << " " << fixed(v, 4);
  return line.str();
}

void MetricsLog::writeLossCurve(const std::string& svgPath, const std::string& title) const {
  replaceFile(svgPath, renderLineChartSvg(losses_, title, "step", "loss"));
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

std::string renderLineChartSvg(const std::vector<std::pair<int64_t, double>>& points, const std::string& title,
                               const std::string& xLabel, const std::string& yLabel) {
  const double W = 640, H = 400, left = 70, right = 20, top = 40, bottom = 50;
  double xMin = 0, xMax = 1, yMin = 0, yMax = 1;
  if (!points.empty()) {
    xMin = static_cast<double>(points.front().first);
    xMax = static_cast<double>(points.back().first);
    yMin = yMax = points.front().second;
    for (const auto& [x, y] : points) {
      yMin = std::min(yMin, y);
      yMax = std::max(yMax, y);
    }
  }
  if (xMax <= xMin) xMax = xMin + 1;
  if (yMax <= yMin) yMax = yMin + 1;
  auto px = [&](double x) { return left + (x - xMin) / (xMax - xMin) * (W - left - right); };
  auto py = [&](double y) { return top + (yMax - y) / (yMax - yMin) * (H - top - bottom); };
  std::ostringstream s;
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" font-family=\"sans-serif\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"" << W / 2 << "\" y=\"24\" text-anchor=\"middle\" font-size=\"16\">" << xmlText(title) << "</text>\n"
    << "<line x1=\"" << left << "\" y1=\"" << H - bottom << "\" x2=\"" << W - right << "\" y2=\"" << H - bottom
    << "\" stroke=\"black\"/>\n"
    << "<line x1=\"" << left << "\" y1=\"" << top << "\" x2=\"" << left << "\" y2=\"" << H - bottom
    << "\" stroke=\"black\"/>\n";
  for (int i = 0; i <= 4; ++i) {
    const double y = yMin + (yMax - yMin) * i / 4.0;
    const double x = xMin + (xMax - xMin) * i / 4.0;
    s << "<text x=\"" << left - 6 << "\" y=\"" << py(y) + 4 << "\" text-anchor=\"end\" font-size=\"11\">" << fixed(y, 3)
      << "</text>\n"
      << "<text x=\"" << px(x) << "\" y=\"" << H - bottom + 16 << "\" text-anchor=\"middle\" font-size=\"11\">"
      << fixed(x, 0) << "</text>\n";
  }
  s << "<text x=\"" << W / 2 << "\" y=\"" << H - 10 << "\" text-anchor=\"middle\" font-size=\"12\">" << xmlText(xLabel)
    << "</text>\n"
    << "<text x=\"16\" y=\"" << H / 2 << "\" text-anchor=\"middle\" font-size=\"12\" transform=\"rotate(-90 16 " << H / 2
    << ")\">" << xmlText(yLabel) << "</text>\n";
  if (!points.empty()) {
    s << "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"2\" points=\"";
    for (const auto& [x, y] : points) s << fixed(px(static_cast<double>(x)), 1) << "," << fixed(py(y), 1) << " ";
    s << "\"/>\n";
  }
  s << "</svg>\n";
  return s.str();
}

double peakRssMiB() {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  double kib = 0;
  while (std::fgets(line, sizeof(line), f)) {
    if (std::sscanf(line, "VmHWM: %lf kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib / 1024.0;
}

}  // namespace tessera::trainer
