// Export: offline from checkpoints of any world size equals the gathered tensors (names
// stripped, optional cast), splitting writes a Hugging Face index, the online export
// (gathered over the communicator) equals the offline one, and the command-line tools
// (tessera-export, tessera-ckpt) work and fail with the documented exit statuses.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include "checkpoint/exporter.h"
#include "checkpoint/metadata.h"
#include "checkpoint/safetensors.h"
#include "tests/checkpoint/checkpoint_test_util.h"

namespace tessera::checkpoint {
namespace {

using namespace testing;  // NOLINT
namespace fs = std::filesystem;
using nlohmann::json;

const std::string kExport = std::string(TESSERA_BIN_DIR) + "/tessera-export";
const std::string kCkpt = std::string(TESSERA_BIN_DIR) + "/tessera-ckpt";

std::map<std::string, at::Tensor> expectedUnder(const std::vector<GlobalTensor>& model, const std::string& prefix,
                                                std::optional<at::ScalarType> cast = std::nullopt) {
  std::map<std::string, at::Tensor> out;
  for (const auto& g : model) {
    if (g.name.rfind(prefix, 0) != 0) continue;
    out[g.name.substr(prefix.size())] = cast && g.full.is_floating_point() ? g.full.to(*cast) : g.full;
  }
  return out;
}

void expectSameTensors(const std::map<std::string, at::Tensor>& got, const std::map<std::string, at::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_TRUE(bitwiseEqual(got.at(name), t)) << name;
  }
}

TEST(ExportTest, OfflineExportEqualsTheGatheredTensorsForEverySavedWorldSize) {
  TempDir tmp;
  const auto model = sampleModel();
  for (int world = 1; world <= 4; ++world) {
    const std::string root = tmp / strCat("w", world);
    CheckpointOptions options;
    options.blockBytes = 24;
    saveOnRanks(world, root, model, 1, options);
    ExportOptions ex;
    ex.what = "generator_ema";
    const auto r = exportCheckpoint(root + "/step_00000001", root + "/ema.safetensors", ex);
    EXPECT_EQ(r.prefix, "ema/generator_ema/");
    expectSameTensors(loadSafetensors(root + "/ema.safetensors"), expectedUnder(model, "ema/generator_ema/"));
    ex.what = "model";
    ex.dtype = at::kHalf;
    exportCheckpoint(root + "/step_00000001", root + "/model.safetensors", ex);
    expectSameTensors(loadSafetensors(root + "/model.safetensors"), expectedUnder(model, "model/", at::kHalf));
  }
}

TEST(ExportTest, SplittingWritesAHuggingFaceIndex) {
  TempDir tmp;
  std::vector<GlobalTensor> model;
  for (int i = 0; i < 5; ++i) {
    model.push_back({strCat("model/layers.", i, ".weight"), at::arange(64 * (i + 1), at::kFloat).view({-1, 8}) + i});
  }
  saveOnRanks(2, tmp / "ckpt", model, 1);
  ExportOptions ex;
  ex.what = "model";
  ex.maxShardBytes = 1024;  // tensors of 256, 512, 768, 1024, 1280 bytes
  const auto r = exportCheckpoint(tmp / "ckpt/step_00000001", tmp / "out", ex);
  // Greedy in order: [256+512] [768] [1024] [1280 (alone, above the limit)].
  ASSERT_EQ(r.files.size(), 4u);
  EXPECT_EQ(fs::path(r.files[0]).filename(), "model-00001-of-00004.safetensors");
  ASSERT_EQ(r.indexFile, tmp / "out/model.safetensors.index.json");
  const json index = json::parse(readText(r.indexFile));
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), 256 + 512 + 768 + 1024 + 1280);
  EXPECT_EQ(index["weight_map"]["layers.0.weight"], "model-00001-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["layers.1.weight"], "model-00001-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["layers.4.weight"], "model-00004-of-00004.safetensors");
  for (const auto& f : r.files) EXPECT_LE(fs::file_size(f), 1280u + 512u) << f;
  expectSameTensors(loadSafetensors(r.indexFile), expectedUnder(model, "model/"));
  // Everything fits in one file: model.safetensors, no index.
  ex.maxShardBytes = 1 << 20;
  const auto one = exportCheckpoint(tmp / "ckpt/step_00000001", tmp / "one", ex);
  ASSERT_EQ(one.files.size(), 1u);
  EXPECT_EQ(one.files[0], tmp / "one/model.safetensors");
  EXPECT_TRUE(one.indexFile.empty());
}

TEST(ExportTest, OnlineExportEqualsOfflineExport) {
  TempDir tmp;
  const auto model = sampleModel();
  saveOnRanks(3, tmp / "ckpt", model, 1);
  ExportOptions ex;
  ex.what = "model";
  ex.dtype = at::kBFloat16;
  const auto names = exportNamesOf(componentsFor(model));
  test::runOnRanks(3, [&](test::RankContext& ctx) {
    const auto entries = entriesFor(model, ctx.world, ctx.rank);
    ExportOptions ema = ex;
    ema.what = "generator_ema";
    exportOnline(entries, names, ctx.comm().get(), tmp / "online.safetensors", ema);
    exportOnline(entries, names, ctx.comm().get(), tmp / "online_model.safetensors", ex);
  });
  ex.what = "generator_ema";
  exportCheckpoint(tmp / "ckpt/step_00000001", tmp / "offline.safetensors", ex);
  const auto online = loadSafetensors(tmp / "online.safetensors");
  expectSameTensors(online, loadSafetensors(tmp / "offline.safetensors"));
  expectSameTensors(online, expectedUnder(model, "ema/generator_ema/", at::kBFloat16));
  // The replicated tensor ("model/table") comes from rank 0 without a gather.
  expectSameTensors(loadSafetensors(tmp / "online_model.safetensors"), expectedUnder(model, "model/", at::kBFloat16));
}

TEST(ExportTest, ExportNamesResolveThroughAliasesAndUnknownNamesListTheChoices) {
  TempDir tmp;
  const auto model = sampleModel();
  {
    Checkpointer ckpt(tmp.path(), nullptr);
    SaveRequest req;
    req.step = 1;
    req.entries = entriesFor(model, 1, 0);
    req.components = componentsFor(model);
    req.components.front().exports["generator_ema_0.999"] = "ema/generator_ema/";  // sorted by key: ema first
    ckpt.save(req);
  }
  const auto md = CheckpointReader(tmp / "step_00000001").metadata();
  EXPECT_EQ(resolveExportPrefix(md, "generator_ema_0.999"), "ema/generator_ema/");
  EXPECT_EQ(resolveExportPrefix(md, "generator_ema"), "ema/generator_ema/");
  EXPECT_EQ(resolveExportPrefix(md, "model"), "model/");
  EXPECT_EQ(resolveExportPrefix(md, "optim/exp_avg/"), "optim/exp_avg/");
  try {
    resolveExportPrefix(md, "generator_ema_0.5");
    ADD_FAILURE() << "no error";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("available: generator_ema, generator_ema_0.999, model"), std::string::npos)
        << e.what();
  }
}

TEST(ExportTest, ByteSizesAndDtypesParse) {
  EXPECT_EQ(parseByteSize("2GB"), 2'000'000'000);
  EXPECT_EQ(parseByteSize("500MiB"), 500 << 20);
  EXPECT_EQ(parseByteSize("1.5 KB"), 1500);
  EXPECT_EQ(parseByteSize("4096"), 4096);
  EXPECT_THROW(parseByteSize("2 parsecs"), UsageError);
  EXPECT_THROW(parseByteSize("GB"), UsageError);
  EXPECT_EQ(parseExportDtype("bf16"), at::kBFloat16);
  EXPECT_THROW(parseExportDtype("int8"), UsageError);
}

TEST(ExportToolsTest, TesseraExportAndTesseraCkpt) {
  TempDir tmp;
  const auto model = sampleModel();
  saveOnRanks(2, tmp / "run/checkpoints", model, 100);

  // Given the run's checkpoints directory, the newest checkpoint is used.
  auto r = runCommand(strCat(kExport, " ", tmp / "run/checkpoints", " --what generator_ema --dtype bf16 --out ",
                             tmp / "export/generator_ema.safetensors"));
  ASSERT_EQ(r.status, 0) << r.output;
  expectSameTensors(loadSafetensors(tmp / "export/generator_ema.safetensors"),
                    expectedUnder(model, "ema/generator_ema/", at::kBFloat16));
  r = runCommand(strCat(kExport, " ", tmp / "run/checkpoints/step_00000100", " --what model --max-shard-size 200B --out ",
                        tmp / "export/model"));
  ASSERT_EQ(r.status, 0) << r.output;
  expectSameTensors(loadSafetensors(tmp / "export/model/model.safetensors.index.json"), expectedUnder(model, "model/"));

  r = runCommand(strCat(kExport, " ", tmp / "run/checkpoints", " --what generator_ema --dtype int3 --out x"));
  EXPECT_EQ(r.status, 2) << r.output;
  r = runCommand(strCat(kExport, " --what model"));
  EXPECT_EQ(r.status, 2) << r.output;
  r = runCommand(strCat(kExport, " ", tmp / "run/checkpoints", " --what nothing --out ", tmp / "x.safetensors"));
  EXPECT_EQ(r.status, 2) << r.output;  // a usage error, like the other bad arguments
  EXPECT_NE(r.output.find("available: generator_ema, model"), std::string::npos) << r.output;

  r = runCommand(strCat(kCkpt, " info ", tmp / "run/checkpoints"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("step         100"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("world size   2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("strategy     zero3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("model/layers.0.weight  F32 [10, 3]  shard0  2 chunks"), std::string::npos) << r.output;

  r = runCommand(strCat(kCkpt, " verify ", tmp / "run/checkpoints/step_00000100"));
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("OK "), std::string::npos) << r.output;
  r = runCommand(strCat(kCkpt, " list ", tmp / "run/checkpoints"));
  EXPECT_NE(r.output.find("step 100  (latest)"), std::string::npos) << r.output;

  // Corrupt one byte: verify exits 1 naming the file and the tensor.
  {
    const auto md = CheckpointReader(tmp / "run/checkpoints/step_00000100").metadata();
    const auto& c = md.find("ema/generator_ema/layers.0.bias")->chunks[0];
    std::fstream f(tmp / ("run/checkpoints/step_00000100/" + c.file), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(c.offset);
    f.put('\x7f');
  }
  r = runCommand(strCat(kCkpt, " verify ", tmp / "run/checkpoints/step_00000100"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("rank_00000.bin"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("'ema/generator_ema/layers.0.bias'"), std::string::npos) << r.output;
  r = runCommand(strCat(kExport, " ", tmp / "run/checkpoints", " --what generator_ema --out ", tmp / "y.safetensors"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("checksum mismatch"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(tmp / "y.safetensors"));

  r = runCommand(strCat(kCkpt, " frobnicate ", tmp.path()));
  EXPECT_EQ(r.status, 2) << r.output;
  r = runCommand(strCat(kCkpt, " verify ", tmp / "run"));
  EXPECT_EQ(r.status, 1) << r.output;
}

}  // namespace
}  // namespace tessera::checkpoint
