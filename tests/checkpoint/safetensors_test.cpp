// Safetensors: the written bytes follow the format exactly, the reader refuses every
// malformed header, import is strict with a full report, and an independent reader
// (Python: struct only, then torch.frombuffer) sees the same names, shapes and values.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>

#include "checkpoint/exporter.h"
#include "checkpoint/format.h"
#include "checkpoint/safetensors.h"
#include "tests/checkpoint/checkpoint_test_util.h"

namespace tessera::checkpoint {
namespace {

using namespace testing;  // NOLINT
namespace fs = std::filesystem;
using nlohmann::json;

std::vector<std::pair<std::string, at::Tensor>> sampleTensors() {
  return {{"w", at::arange(6, at::kFloat).view({2, 3}) * 0.5},
          {"b", at::arange(3, at::kBFloat16)},
          {"n", at::tensor({int64_t{7}, int64_t{-9}})},
          {"s", at::scalar_tensor(2.5, at::kDouble)},
          {"e", at::zeros({0, 4})}};
}

std::string writeSample(const std::string& path) {
  std::vector<SafetensorsEntry> plan;
  auto tensors = sampleTensors();
  for (const auto& [name, t] : tensors) plan.push_back({name, t.scalar_type(), t.sizes().vec()});
  SafetensorsWriter w(path, plan, {{"note", "hello"}});
  for (const auto& [name, t] : tensors) w.writeTensor(t.contiguous());
  w.finish();
  return readText(path);
}

void putLength(std::string& bytes, uint64_t n) {
  for (int i = 0; i < 8; ++i) bytes[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
}

// A file with the given header JSON and data section size.
std::string fileWithHeader(const std::string& header, size_t dataBytes) {
  std::string out(8, '\0');
  putLength(out, header.size());
  return out + header + std::string(dataBytes, '\0');
}

std::string parseError(const std::string& bytes) {
  try {
    parseSafetensorsHeader(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                           static_cast<int64_t>(bytes.size()), "test.safetensors");
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "";
}

TEST(SafetensorsTest, FileFollowsTheFormatExactly) {
  TempDir tmp;
  const std::string bytes = writeSample(tmp / "a.safetensors");
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);  // little-endian host
  ASSERT_LE(8 + n, bytes.size());
  EXPECT_EQ((8 + n) % 8, 0u);
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.front(), '{');
  // Padding is spaces after the JSON object.
  const size_t close = header.find_last_of('}');
  EXPECT_EQ(header.find_first_not_of(' ', close + 1), std::string::npos);
  const json j = json::parse(header);
  EXPECT_EQ(j["__metadata__"]["format"], "pt");
  EXPECT_EQ(j["__metadata__"]["note"], "hello");
  EXPECT_EQ(j["w"]["dtype"], "F32");
  EXPECT_EQ(j["b"]["dtype"], "BF16");
  EXPECT_EQ(j["n"]["dtype"], "I64");
  EXPECT_EQ(j["s"]["dtype"], "F64");
  EXPECT_EQ(j["s"]["shape"], json::array());
  EXPECT_EQ(j["w"]["shape"], json({2, 3}));
  // Offsets: back to back from 0 to the end of the file, in write order.
  int64_t pos = 0;
  for (const auto& [name, t] : sampleTensors()) {
    const auto off = j[name]["data_offsets"];
    EXPECT_EQ(off[0].get<int64_t>(), pos) << name;
    pos += t.numel() * static_cast<int64_t>(t.element_size());
    EXPECT_EQ(off[1].get<int64_t>(), pos) << name;
  }
  EXPECT_EQ(static_cast<int64_t>(bytes.size()), 8 + static_cast<int64_t>(n) + pos);
  // Raw little-endian values.
  float w1;
  std::memcpy(&w1, bytes.data() + 8 + n + 4, 4);
  EXPECT_EQ(w1, 0.5f);
  // And our reader agrees.
  auto loaded = loadSafetensors(tmp / "a.safetensors");
  for (const auto& [name, t] : sampleTensors()) EXPECT_TRUE(bitwiseEqual(loaded.at(name), t)) << name;
  EXPECT_FALSE(fs::exists(tmp / "a.safetensors.tmp"));
}

TEST(SafetensorsTest, ReaderRefusesMalformedFiles) {
  std::string good;
  {
    TempDir tmp;
    good = writeSample(tmp / "a.safetensors");
  }
  EXPECT_EQ(parseError(good), "");
  std::string e;

  e = parseError("abc");
  EXPECT_NE(e.find("shorter than the 8-byte header length"), std::string::npos) << e;

  std::string huge = good;
  putLength(huge, uint64_t{1} << 62);
  e = parseError(huge);
  EXPECT_NE(e.find("header length"), std::string::npos) << e;

  std::string past = good;
  putLength(past, good.size());
  e = parseError(past);
  EXPECT_NE(e.find("runs past the end of the file"), std::string::npos) << e;

  e = parseError(fileWithHeader("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]", 8));
  EXPECT_NE(e.find("not valid JSON"), std::string::npos) << e;

  e = parseError(fileWithHeader("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 16]}}", 8));
  EXPECT_NE(e.find("outside"), std::string::npos) << e;

  e = parseError(fileWithHeader("{\"a\": {\"dtype\": \"F32\", \"shape\": [3], \"data_offsets\": [0, 8]}}", 8));
  EXPECT_NE(e.find("needs 12"), std::string::npos) << e;

  e = parseError(fileWithHeader("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
                                " \"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}}",
                                12));
  EXPECT_NE(e.find("overlap"), std::string::npos) << e;

  e = parseError(fileWithHeader("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}", 8));
  EXPECT_NE(e.find("hole"), std::string::npos) << e;

  e = parseError(fileWithHeader("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 8));
  EXPECT_NE(e.find("cover 4 bytes of a 8-byte data section"), std::string::npos) << e;

  e = parseError(fileWithHeader("{\"a\": {\"dtype\": \"C64\", \"shape\": [1], \"data_offsets\": [0, 8]}}", 8));
  EXPECT_NE(e.find("unknown dtype 'C64'"), std::string::npos) << e;

  e = parseError(fileWithHeader("{\"a\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 0]}}", 0));
  EXPECT_NE(e.find("outside"), std::string::npos) << e;

  e = parseError(fileWithHeader(
      "{\"a\": {\"dtype\": \"F32\", \"shape\": [4611686018427387904, 4], \"data_offsets\": [0, 0]}}", 0));
  EXPECT_NE(e.find("overflows"), std::string::npos) << e;

  e = parseError(fileWithHeader("{\"__metadata__\": {\"format\": 1}}", 0));
  EXPECT_NE(e.find("expected a string"), std::string::npos) << e;

  e = parseError(fileWithHeader(std::string(100, '[') + std::string(100, ']'), 0));
  EXPECT_FALSE(e.empty());

  // A truncated file (data cut short) through the file reader.
  TempDir tmp;
  writeText(tmp / "t.safetensors", good.substr(0, good.size() - 3));
  EXPECT_THROW(SafetensorsReader(tmp / "t.safetensors"), CheckpointError);
}

TEST(SafetensorsTest, ImportIsStrictAndReportsEveryProblem) {
  TempDir tmp;
  writeSample(tmp / "a.safetensors");
  // Expect "w" [3, 2] (mismatch), "b" (ok), "x" (missing); "n", "s", "e" are unexpected.
  std::vector<StateEntry> entries;
  entries.push_back({"model/w", dtensor::ShardSpec({3, 2}, at::kFloat, 1, 0), at::zeros({3, 2})});
  entries.push_back({"model/b", dtensor::ShardSpec({3}, at::kBFloat16, 1, 0), at::zeros({3}, at::kBFloat16)});
  entries.push_back({"model/x", dtensor::ShardSpec({1}, at::kFloat, 1, 0), at::zeros({1})});
  ImportOptions options;
  options.stripPrefix = "model/";
  try {
    importSafetensors(tmp / "a.safetensors", entries, options);
    ADD_FAILURE() << "no error";
  } catch (const CheckpointError& err) {
    const std::string e = err.what();
    EXPECT_NE(e.find("missing (1):\n  x"), std::string::npos) << e;
    EXPECT_NE(e.find("unexpected (3):\n  e\n  n\n  s"), std::string::npos) << e;
    EXPECT_NE(e.find("w: file has [2, 3], expected [3, 2]"), std::string::npos) << e;
  }
}

TEST(SafetensorsTest, ImportFillsShardsOnEveryRankWithCasting) {
  TempDir tmp;
  const at::Tensor w = at::arange(30, at::kFloat).view({10, 3}) / 7;
  {
    SafetensorsWriter writer(tmp / "m.safetensors", {{"layers.0.weight", at::kBFloat16, {10, 3}}}, {});
    writer.writeTensor(w.to(at::kBFloat16));
    writer.finish();
  }
  for (int world = 1; world <= 4; ++world) {
    for (int rank = 0; rank < world; ++rank) {
      dtensor::ShardSpec spec({10, 3}, at::kFloat, world, rank);
      StateEntry e{"ema/generator_ema/layers.0.weight", spec, at::full(spec.localShape(), 5.0f)};
      ImportOptions options;
      options.stripPrefix = "ema/generator_ema/";
      importSafetensors(tmp / "m.safetensors", {e}, options);
      EXPECT_TRUE(bitwiseEqual(e.local, spec.shardOf(w.to(at::kBFloat16).to(at::kFloat))));
      options.allowCast = false;
      EXPECT_THROW(importSafetensors(tmp / "m.safetensors", {e}, options), CheckpointError);
    }
  }
}

// Weights are floating point and finite: an integer tensor for a float entry is refused
// whatever allowCast says (its values are no weights), and so are NaN and Inf, each error
// naming the file and the tensor.
TEST(SafetensorsTest, ImportRefusesIntegersAndNonFiniteValues) {
  TempDir tmp;
  const dtensor::ShardSpec spec({2, 2}, at::kFloat, 1, 0);
  auto importOne = [&](const std::string& file, const at::Tensor& value) {
    saveSafetensors(tmp / file, {{"w", value}});
    StateEntry e{"model/w", spec, at::zeros({2, 2})};
    ImportOptions options;
    options.stripPrefix = "model/";
    importSafetensors(tmp / file, {e}, options);
  };
  auto messageOf = [&](const std::string& file, const at::Tensor& value) -> std::string {
    try {
      importOne(file, value);
    } catch (const CheckpointError& e) {
      return e.what();
    }
    return "no error";
  };
  const std::string ints = messageOf("ints.safetensors", at::ones({2, 2}, at::kInt));
  EXPECT_NE(ints.find(tmp / "ints.safetensors"), std::string::npos) << ints;
  EXPECT_NE(ints.find("w: file has I32, a floating-point tensor is needed"), std::string::npos) << ints;
  for (float bad : {NAN, INFINITY}) {
    at::Tensor value = at::ones({2, 2});
    value[1][0] = bad;
    const std::string e = messageOf("bad.safetensors", value);
    EXPECT_NE(e.find(tmp / "bad.safetensors"), std::string::npos) << e;
    EXPECT_NE(e.find("tensor 'w' holds NaN or Inf"), std::string::npos) << e;
  }
  EXPECT_NO_THROW(importOne("good.safetensors", at::ones({2, 2}, at::kBFloat16)));
}

// A sharded export (Hugging Face's index.json and files) imports like one file: every rank
// of every world size gets exactly its rows.
TEST(SafetensorsTest, ImportFromAShardedExportOnEveryRank) {
  TempDir tmp;
  std::map<std::string, at::Tensor> weights = {{"a", at::arange(28, at::kFloat).view({7, 4})},
                                               {"b", at::arange(5, at::kFloat) - 2},
                                               {"c", at::full({}, 0.5f)}};
  std::vector<StateEntry> full;
  for (const auto& [name, w] : weights) {
    full.push_back({"model/" + name, dtensor::ShardSpec(w.sizes().vec(), at::kFloat, 1, 0), w});
  }
  ExportOptions ex;
  ex.what = "model";
  ex.maxShardBytes = 64;  // a (112 bytes) alone, then b and c
  const ExportResult written = exportOnline(full, {}, nullptr, tmp / "out", ex);
  ASSERT_FALSE(written.indexFile.empty());
  ASSERT_EQ(written.files.size(), 2u);
  for (int world = 1; world <= 4; ++world) {
    for (int rank = 0; rank < world; ++rank) {
      std::vector<StateEntry> entries;
      for (const auto& [name, w] : weights) {
        dtensor::ShardSpec spec(w.sizes().vec(), at::kFloat, world, rank);
        entries.push_back({"model/" + name, spec, at::full(spec.localShape(), 9.0f)});
      }
      ImportOptions options;
      options.stripPrefix = "model/";
      importSafetensors(written.indexFile, entries, options);
      for (const auto& e : entries) {
        EXPECT_TRUE(bitwiseEqual(e.local, e.spec.shardOf(weights.at(e.name.substr(6)))))
            << e.name << " rank " << rank << " of " << world;
      }
    }
  }
}

// Issue 36, class 4: an index must describe its shards: a tensor a file holds but
// weight_map does not list, a name written twice, a total_size that is not a number or
// not the sum of the tensors' bytes — each refused with the index and the name.
TEST(SafetensorsTest, IndexThatDoesNotDescribeItsShardsIsRefused) {
  TempDir tmp;
  std::vector<StateEntry> full;
  for (const auto& [name, w] : std::map<std::string, at::Tensor>{{"a", at::arange(28, at::kFloat).view({7, 4})},
                                                                 {"b", at::arange(5, at::kFloat)},
                                                                 {"c", at::full({}, 0.5f)}}) {
    full.push_back({"model/" + name, dtensor::ShardSpec(w.sizes().vec(), at::kFloat, 1, 0), w});
  }
  ExportOptions ex;
  ex.what = "model";
  ex.maxShardBytes = 64;  // a alone, then b and c
  const ExportResult written = exportOnline(full, {}, nullptr, tmp / "out", ex);
  const std::string index = written.indexFile;
  const std::string original = readText(index);
  EXPECT_NO_THROW(loadSafetensors(index));
  auto refusedWith = [&](const std::string& text) {
    writeText(index, text);
    try {
      loadSafetensors(index);
    } catch (const CheckpointError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  auto j = nlohmann::json::parse(original);
  ASSERT_EQ(j["metadata"]["total_size"], 28 * 4 + 5 * 4 + 4);
  auto without = j;
  without["weight_map"].erase("c");  // its file is still listed (for b)
  std::string e = refusedWith(without.dump());
  EXPECT_NE(e.find("'c' is in"), std::string::npos) << e;
  EXPECT_NE(e.find("not in weight_map"), std::string::npos) << e;
  auto wrongTotal = j;
  wrongTotal["metadata"]["total_size"] = 1000;
  e = refusedWith(wrongTotal.dump());
  EXPECT_NE(e.find("total_size is 1000"), std::string::npos) << e;
  wrongTotal["metadata"]["total_size"] = "132";
  e = refusedWith(wrongTotal.dump());
  EXPECT_NE(e.find("total_size"), std::string::npos) << e;
  wrongTotal["metadata"]["total_size"] = -1;
  EXPECT_NE(refusedWith(wrongTotal.dump()).find("total_size"), std::string::npos);
  const size_t map = original.find("\"weight_map\"");
  const size_t brace = original.find('{', map);
  e = refusedWith(original.substr(0, brace + 1) + "\"a\": \"x.safetensors\", " + original.substr(brace + 1));
  EXPECT_NE(e.find("'a' appears twice"), std::string::npos) << e;
  writeText(index, original);
  EXPECT_NO_THROW(loadSafetensors(index));
}

TEST(SafetensorsTest, IndependentPythonReaderSeesTheSameTensors) {
  TempDir tmp;
  // A checkpoint saved on 3 ranks, exported as bf16 (floats) with ints kept.
  const auto model = sampleModel();
  saveOnRanks(3, tmp / "ckpt", model, 1);
  ExportOptions options;
  options.what = "generator_ema";
  options.dtype = at::kBFloat16;
  exportCheckpoint(tmp / "ckpt/step_00000001", tmp / "ema.safetensors", options);
  json expected = json::object();
  for (const auto& g : model) {
    if (g.name.rfind("ema/generator_ema/", 0) != 0) continue;
    at::Tensor t = g.full.is_floating_point() ? g.full.to(at::kBFloat16) : g.full;
    expected[g.name.substr(18)] = {{"dtype", dtypeName(t.scalar_type())},
                                   {"shape", t.sizes().vec()},
                                   {"sum", t.to(at::kDouble).sum().item<double>()},
                                   {"first", t.numel() ? t.reshape({-1})[0].to(at::kDouble).item<double>() : 0.0}};
  }
  writeText(tmp / "expected.json", expected.dump());
  const auto r = runCommand(strCat(TESSERA_PYTHON3, " ", TESSERA_SOURCE_DIR, "/tests/checkpoint/read_safetensors.py ",
                                   tmp / "ema.safetensors", " ", tmp / "expected.json"));
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("ok stdlib"), std::string::npos) << r.output;
  // Debian's python3-torch is a test dependency (scripts/setup.sh); when it is there the
  // torch decode must pass too.
  if (runCommand(strCat(TESSERA_PYTHON3, " -c 'import torch'")).status == 0) {
    EXPECT_NE(r.output.find("ok torch"), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace tessera::checkpoint
