// The end-to-end training suites' shared helpers (see train_runs.h).
#include "tests/apps/train_runs.h"

#include <gtest/gtest.h>

#include <cmath>

#include "checkpoint/safetensors.h"
#include "tests/support/run_command.h"
#include "tests/support/run_files.h"

namespace tessera::test {

std::string trainCommand(int ranks) {
  const std::string bin = TESSERA_BIN_DIR;
  return ranks == 1 ? bin + "/tessera-train"
                    : bin + "/tessera-run --standalone --nproc-per-node " + std::to_string(ranks) + " " + bin +
                          "/tessera-train";
}

std::string mustRun(const std::string& command, int timeoutSeconds) {
  const auto r = runCommand(command, timeoutSeconds);
  EXPECT_EQ(r.status, 0) << command << "\n" << r.output;
  return r.output;
}

void expectSameLosses(const std::string& referenceDir, const std::string& otherDir, const std::string& what) {
  const auto a = readMetrics(referenceDir), b = readMetrics(otherDir);
  ASSERT_EQ(a.size(), b.size()) << what;
  ASSERT_FALSE(a.empty()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    for (const char* key : {"loss", "eval_loss", "eval_loss_ema"}) {
      if (!a[i].contains(key)) continue;
      ASSERT_TRUE(b[i].contains(key)) << what << " " << key;
      const double x = a[i][key], y = b[i][key];
      EXPECT_NEAR(x, y, 1e-5 * std::abs(x)) << what << ": " << key << " at step " << a[i]["step"];
    }
  }
}

std::map<std::string, at::Tensor> emaExport(const std::string& runDir) { return exportOf(runDir, "generator_ema"); }

std::map<std::string, at::Tensor> exportOf(const std::string& runDir, const std::string& name) {
  return checkpoint::loadSafetensors(runDir + "/export/" + name + ".safetensors");
}

void expectCloseExports(const std::string& referenceDir, const std::string& otherDir, const std::string& what) {
  const auto a = emaExport(referenceDir), b = emaExport(otherDir);
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, tensor] : a) {
    ASSERT_TRUE(b.count(name)) << what << ": " << name;
    EXPECT_TRUE(at::allclose(tensor, b.at(name), 1e-4, 1e-6)) << what << ": " << name;
  }
}

}  // namespace tessera::test
