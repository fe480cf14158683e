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
    log.writeLossCurve((dir / "loss.svg").string(), "training loss: a<b & \"c\"");
  }
  std::ifstream in(dir / "loss.svg");
  std::stringstream svg;
  svg << in.rdbuf();
  EXPECT_NE(svg.str().find(">training loss: a&lt;b &amp; &quot;c&quot;</text>"), std::string::npos) << svg.str();
  EXPECT_EQ(svg.str().find("a<b"), std::string::npos);
  removeTree(dir.string());
}

}  // namespace
}  // namespace tessera::trainer
