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

// The global batch must split over the ranks; each rank's share is split into the largest
// micro-batches up to data.micro_batch that divide it (a resumed run on another world size
// keeps its global batch).
TEST(TrainConfigTest, GlobalBatchSplitsOverRanksAndMicroBatchesFollow) {
  const std::filesystem::path file = test::scratchPath("tessera_config", "batch.yaml");
  std::ofstream(file) << "data:\n  path: /etc/hostname\n  global_batch: 30\n  micro_batch: 4\n";
  try {
    loadTrainConfig(file.string(), {}, 4);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(file.string() + ":3:17: data.global_batch: 30 samples per step do not split evenly over world "
                                       "size 4 ranks"),
              std::string::npos)
        << msg;
  }
  const TrainConfig two = loadTrainConfig(file.string(), {}, 2).config;  // 15 per rank: micro-batches of 3
  EXPECT_EQ(two.data.micro_batch, 3);
  EXPECT_EQ(two.data.micro_batch_asked, 4);
  const TrainConfig one = loadTrainConfig(file.string(), {"data.global_batch=32"}, 2).config;  // 16 per rank: as asked
  EXPECT_EQ(one.data.micro_batch, 4);
  EXPECT_EQ(one.data.micro_batch_asked, 0);
  const TrainConfig big = loadTrainConfig(file.string(), {"data.global_batch=4", "data.micro_batch=64"}, 2).config;
  EXPECT_EQ(big.data.micro_batch, 2);  // never more than a rank's share
}

// data.micro_batch: auto is a rank's whole share on the run's world size (the resolved
// config shows the size it resolved to); any other word is refused naming the key.
TEST(TrainConfigTest, MicroBatchAuto) {
  const std::filesystem::path file = test::scratchPath("tessera_config", "auto.yaml");
  std::ofstream(file) << "data:\n  path: /etc/hostname\n  global_batch: 48\n  micro_batch: auto\n";
  const LoadedConfig two = loadTrainConfig(file.string(), {}, 2);
  EXPECT_EQ(two.config.data.micro_batch, 24);
  EXPECT_EQ(two.config.data.micro_batch_asked, 0);
  EXPECT_NE(two.resolvedYaml.find("micro_batch: 24"), std::string::npos) << two.resolvedYaml;
  EXPECT_EQ(loadTrainConfig(file.string(), {}, 3).config.data.micro_batch, 16);
  EXPECT_EQ(loadTrainConfig(file.string(), {"data.micro_batch=5"}, 3).config.data.micro_batch, 4);
  try {
    loadTrainConfig(file.string(), {"data.micro_batch=big"}, 2);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("data.micro_batch: expected an integer or 'auto', got 'big'"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(loadTrainConfig(file.string(), {"data.micro_batch=0"}, 2), ConfigError);  // numbers stay >= 1
}

}  // namespace
}  // namespace tessera::trainer
