// The loss curve: a standalone SVG titled with the run's name, which is escaped (a run
// name is user text and may hold '<' or '&').
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/filesystem.h"
#include "trainer/metrics.h"

namespace tessera::trainer {
namespace {

TEST(MetricsTest, LossCurveIsTitledWithTheEscapedRunName) {
  const auto dir = std::filesystem::temp_directory_path() / ("tessera_metrics_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    MetricsLog log((dir / "metrics.jsonl").string(), 2);
    for (int64_t step : {1, 2}) {
      StepMetrics m;
      m.step = step;
      m.loss = 3.0 - static_cast<double>(step);
      log.record(m);
    }
    log.writeLossCurve((dir / "loss.svg").string(), "training loss: a<b & \"c\"", false);
  }
  std::ifstream in(dir / "loss.svg");
  std::stringstream svg;
  svg << in.rdbuf();
  EXPECT_NE(svg.str().find(">training loss: a&lt;b &amp; &quot;c&quot;</text>"), std::string::npos) << svg.str();
  EXPECT_EQ(svg.str().find("a<b"), std::string::npos);
  removeTree(dir.string());
}

// Every loss of a run is a curve with its legend entry: training, critic, held-out with the
// live weights and the EMA (sparse: marked by dots), also from the lines of a run it
// resumes; a log axis leaves out what it cannot draw and labels ticks with values.
TEST(MetricsTest, LossCurveDrawsEveryLossWithALegend) {
  const auto dir = std::filesystem::temp_directory_path() / ("tessera_metrics_all_" + std::to_string(::getpid()));
  removeTree(dir.string());
  std::filesystem::create_directories(dir);
  for (int64_t first : {1, 6}) {  // the second log resumes the first's metrics.jsonl
    MetricsLog log((dir / "metrics.jsonl").string(), 10, /*resumedStep=*/first - 1);
    for (int64_t step = first; step < first + 5; ++step) {
      StepMetrics m;
      m.step = step;
      m.loss = 10.0 / static_cast<double>(step);
      m.extra["critic_loss"] = step == 3 ? 0.0 : 1.0 / static_cast<double>(step);  // 0: not on a log axis
      m.extra["data_wait_ms"] = 5;  // not a loss
      if (step % 5 == 0) {
        m.extra["eval_loss"] = 2.0;
        m.extra["eval_loss_ema"] = 1.5;
      }
      log.record(m);
    }
    if (first == 1) continue;
    log.writeLossCurve((dir / "loss.svg").string(), "losses", false);
    log.writeLossCurve((dir / "loss_log.svg").string(), "losses", true);
  }
  auto read = [&](const char* name) {
    std::ifstream in(dir / name);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  const std::string svg = read("loss.svg"), logSvg = read("loss_log.svg");
  for (const char* legend : {">train loss</text>", ">critic_loss</text>", ">eval_loss</text>", ">eval_loss_ema</text>"}) {
    EXPECT_NE(svg.find(legend), std::string::npos) << legend << "\n" << svg;
    EXPECT_NE(logSvg.find(legend), std::string::npos) << legend;
  }
  EXPECT_EQ(svg.find("data_wait_ms"), std::string::npos);
  auto count = [](const std::string& text, const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count(svg, "<polyline"), 4u);  // train and critic over 10 steps; the evaluations at steps 5 and 10
  // Dots: 10 + 10 critic + 2 + 2 evaluations on the linear axis; the critic's 0 dropped on the log one.
  EXPECT_EQ(count(svg, "<circle"), 24u);
  EXPECT_EQ(count(logSvg, "<circle"), 23u);
  EXPECT_NE(logSvg.find(">loss (log scale)</text>"), std::string::npos);
  EXPECT_NE(logSvg.find(">10.00</text>"), std::string::npos) << logSvg;  // the top tick: the first loss, 10
  removeTree(dir.string());
}

}  // namespace
}  // namespace tessera::trainer
