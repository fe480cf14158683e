// TensorBoard event files: CRC-32C and TFRecord framing against known values, and what the
// writer writes read back by an independent reader (python/read_tensorboard.py:
// python3-protobuf from the same schema, the crc32c module), which must also refuse a file
// with a damaged record rather than skip it.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "observe/tensorboard_writer.h"
#include "tests/support/run_files.h"
#include "tests/support/scratch_path.h"

namespace tessera::observe {
namespace {

namespace fs = std::filesystem;

std::string readBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

TEST(TensorBoardWriterTest, Crc32cAndFramingMatchTheirSpecifications) {
  // The CRC-32C check value of the iSCSI specification (RFC 3720, B.4) and of every
  // CRC catalogue: "123456789" -> 0xE3069283.
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(""), 0u);
  const uint32_t crc = crc32c("abc");
  EXPECT_EQ(maskedCrc32c("abc"), ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
  const std::string record = frameRecord("abc");
  ASSERT_EQ(record.size(), 8u + 4u + 3u + 4u);
  EXPECT_EQ(record.substr(0, 8), std::string("\x03\0\0\0\0\0\0\0", 8));  // little-endian length
  EXPECT_EQ(record.substr(12, 3), "abc");
}

TEST(TensorBoardWriterTest, IndependentReaderReadsEveryScalarAndImage) {
  const fs::path dir = tessera::test::scratchPath("tensorboard", "round_trip");
  fs::remove_all(dir);
  std::string file;
  {
    TensorBoardWriter writer(dir.string());
    file = writer.path();
    writer.addScalars(10, {{"train/loss", 2.5}, {"perf/mfu", 0.125}});
    writer.addScalars(20, {{"train/loss", 1.25}});
    EncodedImage image;
    image.png = std::string("\x89PNG\r\n\x1a\n", 8) + "not decoded by the reader";
    image.height = 4;
    image.width = 6;
    image.channels = 3;
    writer.addImage(20, "samples/model_ema", image);
  }
  EXPECT_EQ(fs::path(file).parent_path(), dir);
  EXPECT_EQ(fs::path(file).filename().string().rfind("events.out.tfevents.", 0), 0u) << file;
  const auto read = tessera::test::readTensorBoard(dir.string());
  ASSERT_TRUE(read.ok) << read.output;
  ASSERT_EQ(read.values.size(), 4u) << read.output;
  EXPECT_EQ(read.values[0]["tag"], "train/loss");
  EXPECT_EQ(read.values[0]["step"], 10);
  EXPECT_DOUBLE_EQ(read.values[0]["value"].get<double>(), 2.5);
  EXPECT_EQ(read.values[1]["tag"], "perf/mfu");
  EXPECT_DOUBLE_EQ(read.values[1]["value"].get<double>(), 0.125);
  EXPECT_EQ(read.values[2]["step"], 20);
  EXPECT_DOUBLE_EQ(read.values[2]["value"].get<double>(), 1.25);
  EXPECT_EQ(read.values[3]["tag"], "samples/model_ema");
  EXPECT_EQ(read.values[3]["image"]["height"], 4);
  EXPECT_EQ(read.values[3]["image"]["width"], 6);
  EXPECT_EQ(read.values[3]["image"]["colorspace"], 3);

  // A second writer in the same directory (a resumed run) starts a file of its own.
  { TensorBoardWriter again(dir.string()); EXPECT_NE(again.path(), file); }
}

// Each kind of damage is named by the reader (file and record), never skipped.
TEST(TensorBoardWriterTest, DamagedRecordsAreReportedNotSkipped) {
  const fs::path dir = tessera::test::scratchPath("tensorboard", "damaged");
  fs::remove_all(dir);
  std::string file;
  {
    TensorBoardWriter writer(dir.string());
    file = writer.path();
    writer.addScalars(1, {{"train/loss", 1.0}});
    writer.addScalars(2, {{"train/loss", 0.5}});
  }
  const std::string good = readBytes(file);
  struct Damage {
    std::string name, bytes, expected;
  };
  std::string flippedData = good, flippedLength = good;
  flippedData[good.size() - 6] ^= 0x01;  // inside the last record's data
  flippedLength[0] ^= 0x01;  // the first record's length
  for (const Damage& d : {Damage{"data", flippedData, "the data's CRC does not match"},
                          Damage{"length", flippedLength, "record 0 at byte 0: the length's CRC does not match"},
                          Damage{"cut", good.substr(0, good.size() - 3), "the file ends first"},
                          Damage{"trailing", good + "xyz", "trailing bytes"}}) {
    const fs::path damaged = dir / ("events.out.tfevents.damaged_" + d.name);
    std::ofstream(damaged, std::ios::binary) << d.bytes;
    const auto read = tessera::test::readTensorBoard(damaged.string());
    EXPECT_FALSE(read.ok) << d.name << ": " << read.output;
    EXPECT_NE(read.output.find(damaged.string()), std::string::npos) << d.name << ": " << read.output;
    EXPECT_NE(read.output.find(d.expected), std::string::npos) << d.name << ": " << read.output;
  }
}

}  // namespace
}  // namespace tessera::observe
