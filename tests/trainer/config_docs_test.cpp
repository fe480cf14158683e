// The run config's documentation and examples stay in step with its schema: every key
// is documented in configs/README.md, and every shipped config in configs/ loads.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/config.h"
#include "common/errors.h"
#include "trainer/train_config.h"
#include "tests/support/scratch_path.h"

namespace tessera::trainer {
namespace {

std::string readFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(ConfigDocsTest, EveryKeyIsDocumented) {
  TrainConfig config;
  config::ConfigSchema schema;
  bindTrainConfig(schema, config);
  const std::string doc = readFile(std::filesystem::path(TESSERA_SOURCE_DIR) / "configs" / "README.md");
  ASSERT_FALSE(doc.empty()) << "configs/README.md is missing";
  ASSERT_FALSE(schema.fields().empty());
  for (const auto& field : schema.fields()) {
    EXPECT_NE(doc.find("| `" + field.path + "` |"), std::string::npos)
        << "configs/README.md has no table row for key '" << field.path << "'";
  }
}

TEST(ConfigDocsTest, ShippedConfigsLoad) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(std::filesystem::path(TESSERA_SOURCE_DIR) / "configs")) {
    if (entry.path().extension() != ".yaml") continue;
    ++count;
    EXPECT_NO_THROW(loadTrainConfig(entry.path().string(), {}, 2)) << entry.path();
  }
  EXPECT_GE(count, 1);
}

TEST(TrainConfigTest, GlobalBatchMustSplitIntoMicroBatches) {
  const std::filesystem::path file = test::scratchPath("tessera_config", "batch.yaml");
  std::ofstream(file) << "data:\n  path: /etc/hostname\n  global_batch: 30\n  micro_batch: 4\n";
  try {
    loadTrainConfig(file.string(), {}, 2);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(file.string() + ":3:17: data.global_batch: 30 is not a multiple of data.micro_batch (4) x world size (2)"),
              std::string::npos)
        << msg;
  }
  EXPECT_NO_THROW(loadTrainConfig(file.string(), {"data.global_batch=32"}, 2));
}

}  // namespace
}  // namespace tessera::trainer
