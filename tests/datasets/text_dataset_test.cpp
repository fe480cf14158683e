// Next-token datasets (bytes, uint16 and uint32 token files) and the distributed sampler:
// contents, splits, errors naming file and position, determinism, and that the union of
// the ranks' slices is the global batch at every world size.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "datasets/text_dataset.h"
#include "tests/support/scratch_path.h"

namespace tessera::datasets {
namespace {

std::string writeText(const std::string& name, const std::string& text) {
  const std::string path = test::scratchPath("tessera_ds", name);
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

TEST(TextDatasetTest, SamplesAreContextAndNextByte) {
  const std::string path = writeText("tessera_ds_a.txt", "abcdefghijklmnopqrst");  // 20 bytes
  TextDataset ds(path, 4, 0.25);  // train: first 15 bytes, eval: last 5
  EXPECT_EQ(ds.trainSamples(), 11);
  EXPECT_EQ(ds.evalSamples(), 1);
  auto [x, y, seeds] = ds.trainBatch({0, 10});
  EXPECT_EQ(x.sizes(), (c10::IntArrayRef{2, 4}));
  EXPECT_EQ(x[0][0].item<int64_t>(), 'a');
  EXPECT_EQ(x[1][3].item<int64_t>(), 'n');
  EXPECT_EQ(y[0].item<int64_t>(), 'e');
  EXPECT_EQ(y[1].item<int64_t>(), 'o');
  auto [ex, ey, eseeds] = ds.evalBatch(0, 1);
  EXPECT_EQ(ex[0][0].item<int64_t>(), 'p');
  EXPECT_EQ(ey[0].item<int64_t>(), 't');
  EXPECT_THROW(ds.trainBatch({11}), Error);
}

TEST(TextDatasetTest, EveryPositionTargetsAreTheWindowShiftedByOne) {
  const std::string path = writeText("tessera_ds_seq.txt", "abcdefghijklmnopqrst");
  TextDataset ds(path, 4, 0.25, TokenFormat::kBytes, 0, /*everyPosition=*/true);
  auto [x, y, seeds] = ds.trainBatch({0, 10});
  EXPECT_EQ(y.sizes(), (c10::IntArrayRef{2, 4}));
  EXPECT_TRUE(y.narrow(1, 0, 3).equal(x.narrow(1, 1, 3)));
  EXPECT_EQ(y[0][3].item<int64_t>(), 'e');  // the single-target sample's target
  EXPECT_EQ(y[1][3].item<int64_t>(), 'o');
  auto [ex, ey, eseeds] = ds.evalBatch(0, 1);
  EXPECT_EQ(ey[0][0].item<int64_t>(), 'q');
  EXPECT_EQ(ey[0][3].item<int64_t>(), 't');
}

TEST(TextDatasetTest, ErrorsNameTheFile) {
  try {
    TextDataset("/nonexistent/file.txt", 4, 0.1);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/file.txt"), std::string::npos);
  }
  const std::string tiny = writeText("tessera_ds_tiny.txt", "abc");
  EXPECT_THROW(TextDataset(tiny, 4, 0.0), Error);
}

std::string writeTokens(const std::string& name, const std::vector<uint32_t>& ids, int width) {
  std::string raw;
  for (uint32_t id : ids) {
    for (int b = 0; b < width; ++b) raw.push_back(static_cast<char>((id >> (8 * b)) & 0xFF));  // little-endian
  }
  return writeText(name, raw);
}

TEST(TokenDatasetTest, Uint16AndUint32FilesGiveTheirIds) {
  std::vector<uint32_t> ids;
  for (uint32_t i = 0; i < 20; ++i) ids.push_back(1000 + 300 * i);  // above one byte
  for (auto [format, width] : {std::pair{TokenFormat::kUint16, 2}, std::pair{TokenFormat::kUint32, 4}}) {
    const std::string path = writeTokens("tessera_ds_tokens_" + std::to_string(width) + ".bin", ids, width);
    TextDataset ds(path, 4, 0.25, format, 50000);
    EXPECT_EQ(ds.tokens(), 20);
    EXPECT_EQ(ds.trainSamples(), 11);
    auto [x, y, seeds] = ds.trainBatch({0, 10});
    EXPECT_EQ(x[0][0].item<int64_t>(), 1000);
    EXPECT_EQ(x[1][3].item<int64_t>(), 1000 + 300 * 13);
    EXPECT_EQ(y[0].item<int64_t>(), 1000 + 300 * 4);
    auto [ex, ey, eseeds] = ds.evalBatch(0, 1);
    EXPECT_EQ(ey[0].item<int64_t>(), 1000 + 300 * 19);
  }
  // 70000 needs uint32.
  const std::string wide = writeTokens("tessera_ds_tokens_wide.bin", {1, 70000, 3, 4, 5, 6}, 4);
  EXPECT_EQ(TextDataset(wide, 2, 0.0, TokenFormat::kUint32, 100000).trainBatch({0}).inputs[0][1].item<int64_t>(), 70000);
}

TEST(TokenDatasetTest, BadFilesAreErrorsNamingFileAndPosition) {
  const std::string odd = writeText("tessera_ds_odd.bin", std::string(7, 'x'));
  try {
    TextDataset(odd, 2, 0.0, TokenFormat::kUint16, 0);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tessera_ds_odd.bin': 7 bytes is not a whole number of uint16"),
              std::string::npos)
        << e.what();
  }
  const std::string big = writeTokens("tessera_ds_big.bin", {1, 2, 3, 999, 5, 6}, 2);
  try {
    TextDataset(big, 2, 0.0, TokenFormat::kUint16, 256);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token 3 is 999, not below model.vocab_size 256"), std::string::npos)
        << e.what();
  }
  // Bytes are checked against the vocabulary too.
  EXPECT_THROW(TextDataset(writeText("tessera_ds_hi.txt", "ab\xff\xfe" "cdefgh"), 2, 0.0, TokenFormat::kBytes, 128), Error);
  EXPECT_EQ(parseTokenFormat("text", "uint32"), TokenFormat::kBytes);
  EXPECT_EQ(parseTokenFormat("tokens", "uint32"), TokenFormat::kUint32);
  EXPECT_THROW(parseTokenFormat("tokens", "int8"), ConfigError);
  EXPECT_THROW(parseTokenFormat("images", "uint16"), ConfigError);
}

TEST(DistributedSamplerTest, RanksPartitionTheGlobalBatchAtEveryWorldSize) {
  DistributedSampler sampler(1000, 24, 7, true);
  for (int64_t step : {0, 5, 41, 42, 100}) {
    std::vector<int64_t> reference;
    for (int world : {1, 2, 3, 4}) {
      std::vector<int64_t> all;
      for (int r = 0; r < world; ++r) {
        auto part = sampler.indicesFor(step, r, world);
        EXPECT_EQ(part.size(), 24u / world);
        all.insert(all.end(), part.begin(), part.end());
      }
      if (world == 1) reference = all;
      EXPECT_EQ(all, reference) << "step " << step << " world " << world;
      EXPECT_EQ(std::set<int64_t>(all.begin(), all.end()).size(), all.size());
    }
  }
}

TEST(DistributedSamplerTest, EpochsAreSeededPermutations) {
  DistributedSampler a(100, 10, 3, true), b(100, 10, 3, true), c(100, 10, 4, true);
  EXPECT_EQ(a.stepsPerEpoch(), 10);
  std::set<int64_t> epoch0;
  for (int64_t s = 0; s < 10; ++s) {
    auto idx = a.indicesFor(s, 0, 1);
    EXPECT_EQ(idx, b.indicesFor(s, 0, 1));
    epoch0.insert(idx.begin(), idx.end());
  }
  EXPECT_EQ(epoch0.size(), 100u);
  EXPECT_NE(a.indicesFor(0, 0, 1), c.indicesFor(0, 0, 1));
  EXPECT_NE(a.indicesFor(0, 0, 1), a.indicesFor(10, 0, 1));  // next epoch, new order
  DistributedSampler ordered(100, 10, 3, false);
  EXPECT_EQ(ordered.indicesFor(1, 1, 2), (std::vector<int64_t>{15, 16, 17, 18, 19}));
  EXPECT_THROW(ordered.indicesFor(0, 0, 3), Error);
}

}  // namespace
}  // namespace tessera::datasets
