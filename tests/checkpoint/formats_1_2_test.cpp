// checkpoint::checkpointComponents (formats_1_2.h): the component table of checkpoints older
// than the table (tests/data/legacy_v1, format 1) read from the trainer's layout, as
// tessera-ckpt info and tessera-export see them; an alias pointing away from its own EMA
// profile is refused.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "checkpoint/exporter.h"
#include "checkpoint/format.h"
#include "checkpoint/reader.h"
#include "checkpoint/formats_1_2.h"

namespace tessera::checkpoint {
namespace {

using checkpoint::ComponentRecord;
using Prefixes = std::map<std::string, std::string>;

const std::string kLegacy = std::string(TESSERA_SOURCE_DIR) + "/tests/data/legacy_v1";

checkpoint::CheckpointMetadata legacy(const std::string& name) {
  return checkpoint::CheckpointReader(kLegacy + "/" + name + "_step_00000004").metadata();
}

const ComponentRecord& find(const std::vector<ComponentRecord>& table, const std::string& key) {
  for (const auto& c : table) {
    if (c.key == key) return c;
  }
  throw std::runtime_error("no component " + key);
}

TEST(CheckpointLayoutTest, SeveralModelsOfFormatOne) {
  const auto md = legacy("distill");
  ASSERT_EQ(md.version, 1);
  const auto table = checkpointComponents(md);
  ASSERT_EQ(table.size(), 6u);  // three models, two optimizers, one EMA
  for (const std::string m : {"critic", "generator", "teacher"}) {
    EXPECT_EQ(find(table, m).kind, "model");
    EXPECT_EQ(find(table, m).exports.at(m), m + "/");
  }
  EXPECT_EQ(find(table, "optim/generator").kind, "optimizer");
  EXPECT_EQ(find(table, "optim/generator").of, "generator");
  EXPECT_EQ(find(table, "optim/critic").of, "critic");
  const ComponentRecord& ema = find(table, "ema");
  EXPECT_EQ(ema.kind, "ema");
  EXPECT_EQ(ema.of, "generator");
  EXPECT_EQ(ema.parts, (Prefixes{{"generator_ema", "ema/generator_ema/"}}));
  EXPECT_EQ(ema.exports.at("generator_ema_0.99"), "ema/generator_ema/");  // the recorded alias
  const Prefixes names = checkpointExportNames(md);
  EXPECT_EQ(checkpoint::resolveExportPrefix(md, "generator_ema", names), "ema/generator_ema/");
  EXPECT_EQ(checkpoint::resolveExportPrefix(md, "teacher", names), "teacher/");
}

TEST(CheckpointLayoutTest, TheSingleModelFormOfFormatOne) {
  const auto md = legacy("diffusion");
  const auto table = checkpointComponents(md);
  ASSERT_EQ(table.size(), 3u);
  EXPECT_EQ(find(table, "model").kind, "model");
  EXPECT_EQ(find(table, "optim").of, "model");  // optim/<state>/<param>
  const ComponentRecord& ema = find(table, "ema");
  EXPECT_EQ(ema.of, "model");
  EXPECT_EQ(ema.parts, (Prefixes{{"generator_ema", "ema/generator_ema/"}, {"generator_ema_0.999", "ema/generator_ema_0.999/"}}));
  // Without the table, the profile's own name is found only through the layout.
  EXPECT_THROW(checkpoint::resolveExportPrefix(md, "generator_ema"), checkpoint::CheckpointError);
  EXPECT_EQ(checkpoint::resolveExportPrefix(md, "generator_ema", checkpointExportNames(md)), "ema/generator_ema/");
}

TEST(CheckpointLayoutTest, AnAliasAwayFromItsOwnProfileIsRefused) {
  auto md = legacy("diffusion");
  md.aliases["generator_ema"] = "model/";
  try {
    checkpointComponents(md);
    ADD_FAILURE() << "no error";
  } catch (const checkpoint::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("alias 'generator_ema' points to 'model/', but 'ema/generator_ema/' holds"),
              std::string::npos)
        << e.what();
  }
}

TEST(CheckpointLayoutTest, FormatThreeIsReadAsRecorded) {
  checkpoint::CheckpointMetadata md;
  md.version = 3;
  md.components = {{"net", "model", "", {}, {{"net", "net/"}}}};
  ASSERT_EQ(checkpointComponents(md).size(), 1u);
  EXPECT_EQ(checkpointComponents(md)[0].key, "net");
}

}  // namespace
}  // namespace tessera::checkpoint
