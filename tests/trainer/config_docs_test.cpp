// The run config's documentation and examples stay in step with its schema: every key
// is documented in configs/README.md, every shipped config in configs/ loads, and every
// environment variable the sources and scripts read is in docs/environment.md.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
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

// Every top-level section of the schema (run, model, data, ..., the named models) has its
// heading in configs/README.md, "## `name` — what it is".
TEST(ConfigDocsTest, EverySectionHasAHeading) {
  TrainConfig config;
  config::ConfigSchema schema;
  bindTrainConfig(schema, config);
  const std::string doc = readFile(std::filesystem::path(TESSERA_SOURCE_DIR) / "configs" / "README.md");
  int sections = 0;
  for (const auto& [path, text] : schema.sections()) {
    if (path.find('.') != std::string::npos) continue;
    ++sections;
    EXPECT_NE(doc.find("## `" + path + "`"), std::string::npos) << "configs/README.md has no heading for section '" << path << "'";
  }
  EXPECT_GE(sections, 10);
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

// Every environment variable read anywhere is in docs/environment.md's tables: a literal
// getenv("NAME") in the C++ sources; in a file that calls getenv with a name it computes
// (distributed/rank_env.cpp's contracts, the malloc tunables), every upper-case string
// literal that file holds; in the scripts, every ${NAME:-default} they read.
TEST(DocsTest, EveryEnvironmentVariableIsListed) {
  namespace fs = std::filesystem;
  const fs::path root = TESSERA_SOURCE_DIR;
  const std::string doc = readFile(root / "docs" / "environment.md");
  ASSERT_FALSE(doc.empty()) << "docs/environment.md is missing";
  const std::regex literalGetenv(R"re(getenv\(\s*"([A-Za-z_][A-Za-z0-9_]*)"\s*\))re");
  const std::regex computedGetenv(R"re(getenv\(\s*[^"\s])re");
  const std::regex upperLiteral(R"re("([A-Z][A-Z0-9]*_[A-Z0-9_]*|[A-Z]{4,})")re");
  const std::regex scriptRead(R"re(\$\{([A-Z][A-Z0-9_]*):-)re");
  std::set<std::string> missing;
  int files = 0, names = 0;
  const auto need = [&](const std::string& name, const fs::path& where) {
    ++names;
    if (doc.find("`" + name + "`") == std::string::npos) missing.insert(name + " (" + where.string() + ")");
  };
  for (const char* folder : {"common", "kernels", "diagnostics", "distributed", "dtensor", "optim", "sharding", "ema",
                             "checkpoint", "imaging", "observe", "datasets", "models", "trainer", "recipes", "apps",
                             "bench", "examples"}) {
    for (const auto& entry : fs::recursive_directory_iterator(root / folder)) {
      const std::string ext = entry.path().extension().string();
      if (ext != ".cpp" && ext != ".h" && ext != ".cu") continue;
      const std::string text = readFile(entry.path());
      ++files;
      for (std::sregex_iterator it(text.begin(), text.end(), literalGetenv), end; it != end; ++it) {
        need((*it)[1].str(), entry.path().lexically_relative(root));
      }
      if (!std::regex_search(text, computedGetenv)) continue;
      for (std::sregex_iterator it(text.begin(), text.end(), upperLiteral), end; it != end; ++it) {
        need((*it)[1].str(), entry.path().lexically_relative(root));
      }
    }
  }
  std::vector<fs::path> scripts = {root / "run.sh", root / "test.sh"};
  for (const auto& entry : fs::directory_iterator(root / "scripts")) {
    if (entry.path().extension() == ".sh") scripts.push_back(entry.path());
  }
  for (const fs::path& script : scripts) {
    const std::string text = readFile(script);
    for (std::sregex_iterator it(text.begin(), text.end(), scriptRead), end; it != end; ++it) {
      need((*it)[1].str(), script.lexically_relative(root));
    }
  }
  EXPECT_GT(files, 100);
  EXPECT_GT(names, 30) << "the scan found too few reads to be looking at the right files";
  for (const std::string& name : missing) ADD_FAILURE() << "docs/environment.md does not list " << name;
}

}  // namespace
}  // namespace tessera::trainer
