// Every kind of damage is detected with the file and the tensor named: flipped bytes,
// truncated or missing rank files, metadata pointing outside a file, a tampered trainer
// state or metadata. resume auto then falls back to the previous complete checkpoint on
// every rank. A sound checkpoint whose tensors do not fit the model (dtype, shape, a
// missing tensor) is refused by the load's plan instead, and never fallen back from.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "checkpoint/format.h"
#include "checkpoint/metadata.h"
#include "checkpoint/reader.h"
#include "tests/checkpoint/checkpoint_test_util.h"

namespace tessera::checkpoint {
namespace {

using namespace testing;  // NOLINT
namespace fs = std::filesystem;

// Damages one byte of a file in place.
void flipByte(const std::string& path, int64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(offset);
  f.write(&c, 1);
}

class CorruptionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CheckpointOptions options;
    options.blockBytes = 32;
    saveOnRanks(2, tmp_.path(), model_, 1, options);
    dir_ = tmp_ / "step_00000001";
    md_ = CheckpointReader(dir_).metadata();
  }

  // The chunk of `tensor` saved by `rank`.
  const ChunkInfo& chunkOf(const std::string& tensor, int rank) const {
    for (const auto& c : md_.find(tensor)->chunks) {
      if (c.rank == rank) return c;
    }
    throw std::runtime_error("no chunk");
  }

  // Loads on (world, rank) and returns the CheckpointError's message ("" if none thrown).
  std::string loadError(int world = 2, int rank = 1, std::vector<StateEntry> entries = {}) const {
    if (entries.empty()) entries = junkEntriesFor(model_, world, rank);
    try {
      loadCheckpoint(dir_, entries);
    } catch (const CheckpointError& e) {
      return e.what();
    }
    return "";
  }

  std::string verifyError() const {
    try {
      CheckpointReader(dir_).verifyAll();
    } catch (const CheckpointError& e) {
      return e.what();
    }
    return "";
  }

  TempDir tmp_;
  std::vector<GlobalTensor> model_ = sampleModel();
  std::string dir_;
  CheckpointMetadata md_;
};

#define EXPECT_HAS(haystack, needle) EXPECT_NE((haystack).find(needle), std::string::npos) << (haystack)

TEST_F(CorruptionTest, ChecksumMismatchNamesFileAndTensor) {
  const std::string tensor = "optim/exp_avg/layers.0.weight";
  const auto& c = chunkOf(tensor, 1);
  flipByte(dir_ + "/rank_00001.bin", c.offset + c.length - 3);
  const std::string e = loadError();
  EXPECT_HAS(e, "checksum mismatch");
  EXPECT_HAS(e, "rank_00001.bin");
  EXPECT_HAS(e, "'" + tensor + "'");
  const std::string v = verifyError();
  EXPECT_HAS(v, "checksum mismatch");
  EXPECT_HAS(v, tensor);
  // A rank that does not read the damaged block does not see it (no whole-file reads);
  // rank 0 of 2 owns rows [0, 5), the flipped byte is in rows [5, 10).
  EXPECT_EQ(loadError(2, 0), "");
  // Without verification the damage goes through unnoticed: verification is what catches it.
  auto entries = junkEntriesFor(model_, 2, 1);
  LoadOptions noVerify;
  noVerify.verify = false;
  EXPECT_NO_THROW(loadCheckpoint(dir_, entries, noVerify));
}

TEST_F(CorruptionTest, TruncatedRankFile) {
  fs::resize_file(dir_ + "/rank_00001.bin", fs::file_size(dir_ + "/rank_00001.bin") - 5);
  const std::string e = loadError();
  EXPECT_HAS(e, "rank_00001.bin");
  EXPECT_HAS(e, "truncated");
  EXPECT_HAS(e, "needed by tensor '");
  EXPECT_HAS(verifyError(), "truncated");
}

TEST_F(CorruptionTest, MissingRankFile) {
  fs::remove(dir_ + "/rank_00000.bin");
  const std::string e = loadError(1, 0);
  EXPECT_HAS(e, "missing file");
  EXPECT_HAS(e, "rank_00000.bin");
  EXPECT_HAS(e, "needed by tensor 'model/layers.0.weight'");
}

TEST_F(CorruptionTest, MetadataPointingOutsideAFile) {
  auto j = nlohmann::json::parse(readText(dir_ + "/metadata.json"));
  for (auto& t : j["tensors"]) {
    if (t["name"] == "model/layers.0.bias") t["chunks"][0]["offset"] = 1 << 20;
  }
  writeText(dir_ + "/metadata.json", resealMetadata(j.dump()));  // consistent: only the content is wrong
  const std::string e = loadError();
  EXPECT_HAS(e, "metadata.json");
  EXPECT_HAS(e, "'model/layers.0.bias'");
  EXPECT_HAS(e, "lie outside rank_00000.bin");
}

TEST_F(CorruptionTest, MetadataWithAGapInTheChunks) {
  auto j = nlohmann::json::parse(readText(dir_ + "/metadata.json"));
  for (auto& t : j["tensors"]) {
    if (t["name"] == "model/layers.0.weight") t["chunks"].erase(1);
  }
  writeText(dir_ + "/metadata.json", resealMetadata(j.dump()));  // consistent: only the content is wrong
  const std::string e = loadError();
  EXPECT_HAS(e, "'model/layers.0.weight'");
  EXPECT_HAS(e, "cover rows [0, 5) of 10");
}

TEST_F(CorruptionTest, GarbledMetadataIsNotACheckpoint) {
  writeText(dir_ + "/metadata.json", "{\"format\": \"tessera-checkpoint\", \"vers");
  const std::string e = loadError();
  EXPECT_HAS(e, "metadata.json");
  EXPECT_HAS(e, "not valid JSON");
}

// A key written twice (an edit appended after the original) is refused, not read as its
// last value: metadata.json at the top level and inside a tensor, the trainer state.
TEST_F(CorruptionTest, DuplicateKeysAreRefusedNamingTheKey) {
  const std::string original = readText(dir_ + "/metadata.json");
  const size_t brace = original.find('{');
  writeText(dir_ + "/metadata.json", original.substr(0, brace + 1) + "\"step\": 999, " + original.substr(brace + 1));
  std::string e = loadError();
  EXPECT_HAS(e, "metadata.json");
  EXPECT_HAS(e, "'step' appears twice");
  const size_t name = original.find("\"name\"");
  ASSERT_NE(name, std::string::npos);
  writeText(dir_ + "/metadata.json", original.substr(0, name) + "\"name\": \"model/x\", " + original.substr(name));
  EXPECT_HAS(loadError(), "'name' appears twice");
  // A NUL byte in the key does not cut the message short.
  writeText(dir_ + "/metadata.json",
            original.substr(0, brace + 1) + "\"a\\u0000b\": 1, \"a\\u0000b\": 2, " + original.substr(brace + 1));
  EXPECT_HAS(loadError(), "'a\\x00b' appears twice");
  writeText(dir_ + "/metadata.json", original);
  EXPECT_EQ(loadError(), "");
}

// metadata.json, the one file no block checksum covers, carries its own: a value edited
// (or a byte flipped) without resealing is named as such, before any field is believed;
// legacy version 1 files, which have none, still load.
TEST_F(CorruptionTest, EditedMetadataFailsItsOwnChecksum) {
  const std::string original = readText(dir_ + "/metadata.json");
  ASSERT_NE(original.find("\"metadata_checksum\""), std::string::npos);
  auto j = nlohmann::json::parse(original);
  EXPECT_EQ(j["version"], kFormatVersion);
  j["strategy"] = "no_shard";  // an innocent-looking edit
  writeText(dir_ + "/metadata.json", j.dump(1));
  std::string e = loadError();
  EXPECT_HAS(e, "metadata.json");
  EXPECT_HAS(e, "metadata_checksum");
  EXPECT_HAS(verifyError(), "metadata_checksum");
  j.erase("metadata_checksum");  // removed: refused as well
  writeText(dir_ + "/metadata.json", j.dump(1));
  EXPECT_HAS(loadError(), "missing key 'metadata_checksum'");
  // Resealed, the edit is consistent (a deliberate one); as version 1, no checksum is asked.
  writeText(dir_ + "/metadata.json", resealMetadata(j.dump()));
  EXPECT_EQ(loadError(), "");
  j["version"] = 1;
  writeText(dir_ + "/metadata.json", j.dump(1));
  EXPECT_EQ(loadError(), "");
  j["version"] = kFormatVersion + 1;
  writeText(dir_ + "/metadata.json", j.dump(1));
  EXPECT_HAS(loadError(), "format version");
  writeText(dir_ + "/metadata.json", original);
  EXPECT_EQ(loadError(), "");
}

// The component table is trusted by every export and by tessera-ckpt, so metadata.json's is
// checked: prefixes ending in '/' that hold tensors under the component's own key, `of`
// naming another component, one prefix per export name, and no name that names tensors
// of its own (a key, a part) exported as others (resealed each time: a consistent file,
// wrong content).
TEST_F(CorruptionTest, BadComponentTablesAreRefusedNamingTheComponent) {
  const std::string original = readText(dir_ + "/metadata.json");
  auto withComponents = [&](const std::function<void(nlohmann::json&)>& edit) {
    auto j = nlohmann::json::parse(original);
    edit(j["components"]);
    writeText(dir_ + "/metadata.json", resealMetadata(j.dump()));
    return loadError();
  };
  // componentsFor: ema, model, optim (sorted by key).
  ASSERT_EQ(nlohmann::json::parse(original)["components"][0]["key"], "ema");
  auto ema = [](nlohmann::json& c) -> nlohmann::json& { return c[0]; };
  EXPECT_EQ(withComponents([&](auto& c) { ema(c)["exports"]["smooth"] = "ema/generator_ema/"; }), "");
  EXPECT_HAS(withComponents([&](auto& c) { ema(c)["exports"]["smooth"] = ""; }), "components[0] ('ema').exports.smooth");
  EXPECT_HAS(withComponents([&](auto& c) { ema(c)["exports"]["smooth"] = "ema"; }), "not a prefix ending in '/'");
  EXPECT_HAS(withComponents([&](auto& c) { ema(c)["parts"]["smooth"] = "ema/nothing/"; }),
             "no tensor is under 'ema/nothing/'");
  EXPECT_HAS(withComponents([&](auto& c) { ema(c)["exports"]["smooth"] = "model/"; }),
             "'model/' is not under the component's key 'ema/'");
  EXPECT_HAS(withComponents([&](auto& c) { c[1]["exports"]["generator_ema"] = "model/"; }),
             "but another component exports it as 'ema/generator_ema/'");
  EXPECT_HAS(withComponents([&](auto& c) { ema(c)["exports"]["model"] = "ema/generator_ema/"; }),
             "'model/' holds tensors of that name");
  EXPECT_HAS(withComponents([&](auto& c) { ema(c)["exports"]["generator_ema"] = "ema/"; }),
             "'ema/generator_ema/' holds tensors of that name");
  EXPECT_HAS(withComponents([&](auto& c) { ema(c)["of"] = "nobody"; }), "'nobody' is not another component's key");
  EXPECT_HAS(withComponents([&](auto& c) { ema(c)["of"] = "ema"; }), "'ema' is not another component's key");
  EXPECT_HAS(withComponents([&](auto& c) { ema(c)["key"] = "/ema"; }), "starts or ends with '/'");
  EXPECT_HAS(withComponents([&](auto& c) { ema(c)["exports"][std::string("a\0b", 3)] = "ema/generator_ema/"; }),
             "a\\x00b");
  EXPECT_HAS(withComponents([&](auto& c) { c = nlohmann::json::object(); }), "components");
  writeText(dir_ + "/metadata.json", original);
}

// Formats 1 and 2 recorded flat export aliases instead: still checked when read (the
// ema/<alias>/ rule of the trainer's layout is trainer::checkpointComponents').
TEST_F(CorruptionTest, BadExportAliasesOfFormatTwoAreRefusedNamingTheAlias) {
  const std::string original = readText(dir_ + "/metadata.json");
  auto withAliases = [&](const nlohmann::json& aliases) {
    auto j = nlohmann::json::parse(original);
    j["version"] = 2;
    j.erase("components");
    j["aliases"] = aliases;
    writeText(dir_ + "/metadata.json", resealMetadata(j.dump()));
    return loadError();
  };
  EXPECT_EQ(withAliases({{"weights", "model/"}, {"generator_ema", "ema/generator_ema/"}}), "");
  EXPECT_HAS(withAliases({{"weights", ""}}), "aliases.weights");
  EXPECT_HAS(withAliases({{"weights", "model"}}), "not a prefix ending in '/'");
  EXPECT_HAS(withAliases({{"weights", "nothing/"}}), "no tensor is under 'nothing/'");
  EXPECT_HAS(withAliases({{"model", "ema/generator_ema/"}}), "'model/' holds tensors of that name");
  EXPECT_HAS(withAliases({{std::string("a\0b", 3), "model/"}}), "a\\x00b");
  writeText(dir_ + "/metadata.json", original);
}

TEST_F(CorruptionTest, TamperedTrainerState) {
  std::string ts = readText(dir_ + "/trainer_state.json");
  ts[ts.size() - 2] = ts[ts.size() - 2] == '1' ? '2' : '1';
  writeText(dir_ + "/trainer_state.json", ts);
  const std::string e = loadError();
  EXPECT_HAS(e, "trainer_state.json");
  EXPECT_HAS(e, "checksum mismatch");
}

// A sound checkpoint whose tensors do not fit the entries is not damage: the load is
// planned against the metadata before any byte is read (planLoad) and refused as
// LoadPlanError, naming each tensor and what differs.
TEST_F(CorruptionTest, DtypeShapeAndMissingTensorMismatchesWithTheModel) {
  const auto planError = [&](const std::vector<StateEntry>& entries, const LoadOptions& options = {}) {
    try {
      loadCheckpoint(dir_, entries, options);
    } catch (const LoadPlanError& e) {
      EXPECT_EQ(e.dir(), dir_);
      EXPECT_FALSE(e.mismatches().empty());
      return std::string(e.what());
    }
    ADD_FAILURE() << "no LoadPlanError";
    return std::string();
  };
  auto entries = junkEntriesFor(model_, 2, 0);
  entries[0].spec = dtensor::ShardSpec({10, 3}, at::kBFloat16, 2, 0);
  entries[0].local = at::zeros({5, 3}, at::kBFloat16);
  std::string e = planError(entries);
  EXPECT_HAS(e, "'model/layers.0.weight' saved as F32, this program has BF16");

  entries = junkEntriesFor(model_, 2, 0);
  entries[0].spec = dtensor::ShardSpec({3, 10}, at::kFloat, 2, 0);
  entries[0].local = at::zeros({2, 10});
  e = planError(entries);
  EXPECT_HAS(e, "'model/layers.0.weight' saved with shape [10, 3], this program has [3, 10]");

  entries = junkEntriesFor(model_, 2, 0);
  entries[0].name = "model/layers.1.weight";
  e = planError(entries);
  EXPECT_HAS(e, "'model/layers.1.weight' not in the checkpoint");
  EXPECT_HAS(e, dir_);

  // The plan alone, from the metadata: every difference at once, strict or not.
  entries = junkEntriesFor(model_, 2, 0);
  entries[0].name = "model/layers.1.weight";
  const CheckpointReader reader(dir_);
  const auto& md = reader.metadata();
  const auto lenient = planLoad(md, entries, false);
  ASSERT_EQ(lenient.size(), 1u);
  EXPECT_EQ(lenient[0].tensor, "model/layers.1.weight");
  const auto strict = planLoad(md, entries, true);
  ASSERT_EQ(strict.size(), 2u);
  EXPECT_EQ(strict[1].tensor, "model/layers.0.weight");
  EXPECT_EQ(strict[1].problem, "in the checkpoint, not in this program");
  EXPECT_TRUE(planLoad(md, junkEntriesFor(model_, 2, 0), true).empty());
}

TEST_F(CorruptionTest, StrictLoadRefusesUnusedTensors) {
  auto entries = junkEntriesFor(model_, 2, 0);
  entries.pop_back();
  LoadOptions strict;
  strict.strict = true;
  try {
    loadCheckpoint(dir_, entries, strict);
    ADD_FAILURE() << "no error";
  } catch (const LoadPlanError& e) {
    EXPECT_HAS(std::string(e.what()), "ema/generator_ema/steps");
  }
}

// resume auto falls back from a damaged checkpoint, never from one whose state does not
// fit: the older ones of the same run have the same layout, and loading one would hide
// the mismatch behind "damaged". Every rank refuses, before reading.
TEST_F(CorruptionTest, ResumeAutoDoesNotFallBackFromAnotherLayout) {
  saveOnRanks(2, tmp_.path(), sampleModel(5), 2);
  std::vector<int> refused(2, 0);
  test::runOnRanks(2, [&](test::RankContext& ctx) {
    auto entries = junkEntriesFor(model_, ctx.world, ctx.rank);
    entries[0].spec = dtensor::ShardSpec({3, 10}, at::kFloat, ctx.world, ctx.rank);
    entries[0].local = at::zeros({2, 10});
    try {
      resumeAuto(tmp_.path(), entries, ctx.comm().get());
    } catch (const LoadPlanError& e) {
      EXPECT_HAS(std::string(e.what()), "step_00000002");
      EXPECT_HAS(std::string(e.what()), "saved with shape [10, 3], this program has [3, 10]");
      refused[static_cast<size_t>(ctx.rank)] = 1;
    }
  });
  EXPECT_EQ(refused, (std::vector<int>{1, 1}));
}

TEST_F(CorruptionTest, ResumeAutoFallsBackOnEveryRankWhenOneRankSeesCorruption) {
  // Step 2 is damaged only in rows that rank 1 (of 2) reads: both ranks must fall back.
  const auto newer = sampleModel(5);
  saveOnRanks(2, tmp_.path(), newer, 2);
  const std::string dir2 = tmp_ / "step_00000002";
  const auto md2 = CheckpointReader(dir2).metadata();
  const auto& c = md2.find("model/layers.0.weight")->chunks.back();
  flipByte(dir2 + "/" + c.file, c.offset + 1);
  std::vector<int64_t> steps(2, -1);
  test::runOnRanks(2, [&](test::RankContext& ctx) {
    auto entries = junkEntriesFor(model_, ctx.world, ctx.rank);
    auto r = resumeAuto(tmp_.path(), entries, ctx.comm().get());
    ASSERT_TRUE(r.has_value());
    steps[static_cast<size_t>(ctx.rank)] = r->step;
    const auto want = entriesFor(model_, ctx.world, ctx.rank);
    for (size_t i = 0; i < entries.size(); ++i) EXPECT_TRUE(bitwiseEqual(entries[i].local, want[i].local));
  });
  EXPECT_EQ(steps[0], 1);
  EXPECT_EQ(steps[1], 1);
}

TEST_F(CorruptionTest, ResumeAutoListsEveryFailureWhenNothingLoads) {
  flipByte(dir_ + "/rank_00000.bin", 0);
  auto entries = junkEntriesFor(model_, 1, 0);
  try {
    resumeAuto(tmp_.path(), entries, nullptr);
    ADD_FAILURE() << "no error";
  } catch (const CheckpointError& e) {
    const std::string msg = e.what();
    EXPECT_HAS(msg, "step_00000001");
    EXPECT_HAS(msg, "checksum mismatch");
  }
}

// The checksum of a block read in pieces (the part a reader keeps straight into its
// destination, the rest into scratch) is the checksum of the block whole.
TEST(EdgeBlockTest, ChecksumOfPiecesIsTheChecksumOfTheBlock) {
  std::vector<uint8_t> block(1000);
  for (size_t i = 0; i < block.size(); ++i) block[i] = static_cast<uint8_t>(i * 131 + 7);
  const uint64_t whole = checksum(block.data(), block.size());
  EXPECT_EQ(checksum({{block.data(), 100}, {block.data() + 100, 650}, {block.data() + 750, 250}}), whole);
  EXPECT_EQ(checksum({{block.data(), 0}, {block.data(), 1000}, {block.data() + 1000, 0}}), whole);
  EXPECT_EQ(checksum({{block.data(), 200}, {block.data() + 200, 40}}), checksum(block.data(), 240));  // short input
  std::vector<uint8_t> damaged = block;
  damaged[700] ^= 1;
  EXPECT_NE(checksum({{damaged.data(), 100}, {damaged.data() + 100, 900}}), whole);
}

// A read that keeps only part of a checksum block still checks all of it: damage in the
// rows of an edge block that the read does not keep is caught on either side of the rows
// it keeps, and a read that does not touch the damaged block loads.
TEST(EdgeBlockTest, DamageInTheRowsNotKeptOfAnEdgeBlockIsCaught) {
  TempDir tmp;
  std::vector<GlobalTensor> model{{"model/big", at::arange(64 * 16, at::kFloat).view({64, 16})}};
  CheckpointOptions options;
  options.blockBytes = 256;  // 4 rows of 64 bytes: block 5 holds rows [20, 24)
  saveSingle(tmp.path(), model, 1, options);
  const std::string dir = tmp / "step_00000001";
  const ChunkInfo chunk = CheckpointReader(dir).tensor("model/big").chunks.at(0);
  auto readError = [&](int64_t rowBegin, int64_t rowEnd) -> std::string {
    CheckpointReader reader(dir);
    const TensorInfo& t = reader.tensor("model/big");
    at::Tensor rows = at::empty({rowEnd - rowBegin, 16});
    try {
      reader.readRows(t, rowBegin, rowEnd, rows.data_ptr());
    } catch (const CheckpointError& e) {
      return e.what();
    }
    EXPECT_TRUE(bitwiseEqual(rows, model[0].full.narrow(0, rowBegin, rowEnd - rowBegin)));
    return "";
  };
  auto flipByteOfRow = [&](int64_t row) { flipByte(dir + "/" + chunk.file, chunk.offset + row * 64 + 5); };
  EXPECT_EQ(readError(21, 22), "");  // block 5 read on both sides of row 21
  EXPECT_EQ(readError(22, 44), "");  // rank 1 of 3: block 5 an edge before its rows
  EXPECT_EQ(readError(0, 22), "");   // rank 0 of 3: block 5 an edge after its rows
  for (const int64_t damaged : {20, 23}) {
    flipByteOfRow(damaged);
    EXPECT_HAS(readError(21, 22), "block 5 = file bytes [1280, 1536)");
    EXPECT_HAS(readError(damaged == 20 ? 22 : 0, damaged == 20 ? 44 : 22), "checksum mismatch");
    EXPECT_EQ(readError(24, 64), "");
    flipByteOfRow(damaged);  // undone
  }
}

// Sets TESSERA_CHECKPOINT_PIPELINE for the scope (checkpoint/format.h: pipelinedChecksums).
class PipelineSetting {
 public:
  explicit PipelineSetting(bool on) { setenv("TESSERA_CHECKPOINT_PIPELINE", on ? "1" : "0", 1); }
  ~PipelineSetting() { unsetenv("TESSERA_CHECKPOINT_PIPELINE"); }
};

// A save that writes each 16 MiB segment on a helper thread while it checksums the next
// (pipelinedChecksums()), over several segments: the same files as inline hashing, and
// loads (inline or not: the variable only changes saves) get the same values back and
// catch damage in any segment, with the tensor named.
TEST(PipelinedChecksumTest, SameFilesAndSameDamageCaughtAsInline) {
  TempDir tmp;
  std::vector<GlobalTensor> model = sampleModel();
  // 36 MiB in one chunk: three segments, the last one partial.
  model.push_back({"model/big", at::arange(int64_t{9} << 20, at::kFloat).sin().view({int64_t{9} << 10, 1024})});
  CheckpointOptions options;  // 1 MiB blocks
  for (const bool pipelined : {false, true}) {
    PipelineSetting setting(pipelined);
    EXPECT_EQ(pipelinedChecksums(), pipelined);
    saveSingle(tmp / (pipelined ? "pipelined" : "inline"), model, 1, options);
  }
  const std::string inlineDir = tmp / "inline/step_00000001", pipelinedDir = tmp / "pipelined/step_00000001";
  EXPECT_EQ(readText(inlineDir + "/rank_00000.bin"), readText(pipelinedDir + "/rank_00000.bin"));
  EXPECT_EQ(readText(inlineDir + "/metadata.json"), readText(pipelinedDir + "/metadata.json"));

  const TensorInfo big = *CheckpointReader(pipelinedDir).metadata().find("model/big");
  ASSERT_EQ(big.chunks.size(), 1u);
  for (const bool pipelined : {false, true}) {
    PipelineSetting setting(pipelined);
    auto entries = junkEntriesFor(model, 1, 0);
    loadCheckpoint(pipelinedDir, entries);
    for (size_t i = 0; i < model.size(); ++i) {  // one rank: local = the whole tensor (0-d held as [1])
      EXPECT_TRUE(bitwiseEqual(entries[i].local.reshape({-1}), model[i].full.reshape({-1}))) << model[i].name;
    }
  }
  // Damage in the first segment, then also in the last: caught either way.
  for (const int64_t at : {int64_t{5}, (int64_t{35} << 20) + 7}) {
    flipByte(pipelinedDir + "/rank_00000.bin", big.chunks[0].offset + at);
    for (const bool pipelined : {false, true}) {
      PipelineSetting setting(pipelined);
      auto entries = junkEntriesFor(model, 1, 0);
      try {
        loadCheckpoint(pipelinedDir, entries);
        ADD_FAILURE() << "damage at byte " << at << " not caught, pipelined " << pipelined;
      } catch (const CheckpointError& e) {
        EXPECT_NE(std::string(e.what()).find("checksum mismatch"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("'model/big'"), std::string::npos) << e.what();
      }
    }
    flipByte(pipelinedDir + "/rank_00000.bin", big.chunks[0].offset + at);  // undone
  }
}

}  // namespace
}  // namespace tessera::checkpoint
