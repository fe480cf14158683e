// imaging/: PNG round trips (bytes and files), JPEG decoding (TurboJPEG-made files),
// channel conversion, the errors for files that are truncated, not images, missing, not
// regular (a FIFO must not block) or claim a huge size, each naming the file; and the
// pixel conventions, resizing and sample grids of image_ops.h.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <turbojpeg.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/errors.h"
#include "imaging/image_io.h"
#include "imaging/image_ops.h"
#include "tests/support/scratch_path.h"
#include "tests/support/error_capture.h"

namespace tessera::imaging {
namespace {

using tessera::test::errorOf;
using tessera::test::errorWithoutBlockingOn;

namespace fs = std::filesystem;

// A [c, h, w] uint8 image whose pixels run through the byte values in a scrambled order
// (73 is odd: 256 consecutive pixels hold every value once).
at::Tensor patternImage(int64_t c, int64_t h, int64_t w, int64_t salt = 0) {
  return at::arange(c * h * w, at::kLong).mul(73).add(41 + salt).remainder(256).to(at::kByte).view({c, h, w});
}

// A [colour.size(), h, w] uint8 image of one colour.
at::Tensor flatImage(const std::vector<int>& colour, int64_t h, int64_t w) {
  at::Tensor image = at::empty({static_cast<int64_t>(colour.size()), h, w}, at::kByte);
  for (size_t c = 0; c < colour.size(); ++c) image[static_cast<int64_t>(c)].fill_(colour[c]);
  return image;
}

int maxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kInt) - b.to(at::kInt)).abs().max().item<int>();
}

at::Tensor floats(const std::vector<float>& values) {
  return at::from_blob(const_cast<float*>(values.data()), {static_cast<int64_t>(values.size())}, at::kFloat).clone();
}

std::vector<int> bytesOf(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kInt).contiguous();
  return std::vector<int>(c.data_ptr<int>(), c.data_ptr<int>() + c.numel());
}

// JPEG bytes of `image` ([1 or 3, H, W] uint8) through TurboJPEG: 4:4:4 for colour.
std::string encodeJpeg(const at::Tensor& image, int quality) {
  const bool gray = image.size(0) == 1;
  const at::Tensor hwc = image.permute({1, 2, 0}).contiguous();
  tjhandle tj = tjInitCompress();
  if (tj == nullptr) throw std::runtime_error("tjInitCompress failed");
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  const int rc = tjCompress2(tj, hwc.data_ptr<uint8_t>(), static_cast<int>(image.size(2)), 0,
                             static_cast<int>(image.size(1)), gray ? TJPF_GRAY : TJPF_RGB, &buffer, &size,
                             gray ? TJSAMP_GRAY : TJSAMP_444, quality, 0);
  const std::string error = rc == 0 ? std::string() : std::string(tjGetErrorStr2(tj));
  std::string out = rc == 0 ? std::string(reinterpret_cast<const char*>(buffer), size) : std::string();
  tjFree(buffer);
  tjDestroy(tj);
  if (rc != 0) throw std::runtime_error("tjCompress2: " + error);
  return out;
}

void appendBigEndian32(std::string& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>((v >> shift) & 0xFF));
}

// One PNG chunk: length, type, data, CRC-32 of type and data.
std::string pngChunk(const std::string& type, const std::string& data) {
  std::string chunk;
  appendBigEndian32(chunk, static_cast<uint32_t>(data.size()));
  const std::string body = type + data;
  chunk += body;
  appendBigEndian32(chunk, static_cast<uint32_t>(crc32(0L, reinterpret_cast<const Bytef*>(body.data()),
                                                       static_cast<uInt>(body.size()))));
  return chunk;
}

// A hand-made 8-bit gray PNG whose IHDR says width x height. Its IDAT holds (at most 64)
// zero bytes: the whole image when it is small (each row a filter byte and its pixels),
// else a token libpng does not look at before the size is known.
std::string pngClaiming(uint32_t width, uint32_t height) {
  std::string ihdr;
  appendBigEndian32(ihdr, width);
  appendBigEndian32(ihdr, height);
  ihdr += std::string("\x08\x00\x00\x00\x00", 5);  // bit depth 8, gray, deflate, filter method 0, no interlace
  const std::string raw(static_cast<size_t>(std::min<uint64_t>(uint64_t{width + 1} * height, 64)), '\0');
  uLongf size = compressBound(static_cast<uLong>(raw.size()));
  std::string idat(size, '\0');
  if (compress(reinterpret_cast<Bytef*>(idat.data()), &size, reinterpret_cast<const Bytef*>(raw.data()),
               static_cast<uLong>(raw.size())) != Z_OK) {
    throw std::runtime_error("zlib compress failed");
  }
  idat.resize(size);
  return std::string("\x89PNG\r\n\x1a\n", 8) + pngChunk("IHDR", ihdr) + pngChunk("IDAT", idat) + pngChunk("IEND", "");
}

void writeFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// --- image_io ---------------------------------------------------------------------------

TEST(ImageIoTest, PngBytesRoundTripBitwiseForGrayAndRgbOfOddSizes) {
  for (const at::Tensor& image : {patternImage(1, 7, 5), patternImage(3, 5, 7), patternImage(3, 1, 1, 9)}) {
    const std::string png = encodePng(image);
    ASSERT_GE(png.size(), 8u);
    EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
    const at::Tensor decoded = decodeImage(png, "memory");
    EXPECT_EQ(decoded.scalar_type(), at::kByte);
    EXPECT_EQ(decoded.sizes().vec(), image.sizes().vec());
    EXPECT_TRUE(at::equal(decoded, image)) << image.sizes();
  }
}

TEST(ImageIoTest, EncodePngTakesHwImagesAndStridedViews) {
  const at::Tensor hw = patternImage(1, 6, 9)[0];  // [H, W]: a gray image
  const at::Tensor gray = decodeImage(encodePng(hw), "hw");
  EXPECT_EQ(gray.sizes().vec(), (std::vector<int64_t>{1, 6, 9}));
  EXPECT_TRUE(at::equal(gray[0], hw));

  const at::Tensor transposed = patternImage(3, 5, 7).transpose(1, 2);  // [3, 7, 5], not contiguous
  ASSERT_FALSE(transposed.is_contiguous());
  EXPECT_TRUE(at::equal(decodeImage(encodePng(transposed), "transposed"), transposed.contiguous()));
}

TEST(ImageIoTest, EncodePngRefusesWhatIsNotAnImage) {
  EXPECT_THROW(encodePng(at::zeros({3, 4, 4}, at::kFloat)), Error);  // not uint8
  EXPECT_THROW(encodePng(at::zeros({2, 4, 4}, at::kByte)), Error);   // 2 channels
  EXPECT_THROW(encodePng(at::zeros({1, 3, 4, 4}, at::kByte)), Error);
  EXPECT_THROW(encodePng(at::zeros({1, 0, 4}, at::kByte)), Error);   // no rows
}

TEST(ImageIoTest, WritePngThenReadImageGivesThePixelsBack) {
  const std::string dir = test::scratchPath("tessera_image_io", "files");
  fs::create_directories(dir);
  const std::string path = dir + "/picture.png";
  const at::Tensor rgb = patternImage(3, 5, 7);
  writePng(path, rgb);
  EXPECT_TRUE(at::equal(readImage(path), rgb));
  EXPECT_EQ(readFile(path), encodePng(rgb));

  const at::Tensor gray = patternImage(1, 7, 5, 3);
  writePng(path, gray);  // replaces the file
  EXPECT_TRUE(at::equal(readImage(path), gray));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST(ImageIoTest, JpegDecodesToItsShapeWithinJpegToleranceOfAFlatColour) {
  // 9x13 is no multiple of the 8x8 blocks: the edge blocks are partial.
  const at::Tensor colour = flatImage({200, 40, 90}, 9, 13);
  const std::string jpeg = encodeJpeg(colour, 95);
  ASSERT_GE(jpeg.size(), 3u);
  EXPECT_EQ(static_cast<unsigned char>(jpeg[0]), 0xFF);
  EXPECT_EQ(static_cast<unsigned char>(jpeg[1]), 0xD8);
  const at::Tensor decoded = decodeImage(jpeg, "colour.jpg");
  EXPECT_EQ(decoded.scalar_type(), at::kByte);
  EXPECT_EQ(decoded.sizes().vec(), (std::vector<int64_t>{3, 9, 13}));
  EXPECT_LE(maxAbsDiff(decoded, colour), 3);  // only the YCbCr conversion's rounding

  const at::Tensor gray = flatImage({77}, 11, 7);
  const at::Tensor decodedGray = decodeImage(encodeJpeg(gray, 95), "gray.jpg");
  EXPECT_EQ(decodedGray.sizes().vec(), (std::vector<int64_t>{1, 11, 7}));  // a gray JPEG keeps one channel
  EXPECT_LE(maxAbsDiff(decodedGray, gray), 2);

  // The same through a file.
  const std::string path = test::scratchPath("tessera_image_io", "colour.jpg");
  writeFile(path, jpeg);
  EXPECT_TRUE(at::equal(readImage(path), decoded));
}

TEST(ImageIoTest, ChannelsConvertBetweenGrayAndRgb) {
  const std::string dir = test::scratchPath("tessera_image_io", "channels");
  fs::create_directories(dir);

  // An RGB PNG of gray pixels (R = G = B) read as gray gives those values.
  const at::Tensor grayValues = patternImage(1, 5, 7);
  const std::string rgbPath = dir + "/rgb.png";
  writePng(rgbPath, grayValues.expand({3, 5, 7}).contiguous());
  const at::Tensor asGray = readImage(rgbPath, 1);
  EXPECT_EQ(asGray.sizes().vec(), (std::vector<int64_t>{1, 5, 7}));
  EXPECT_LE(maxAbsDiff(asGray, grayValues), 1);
  EXPECT_EQ(readImage(rgbPath, 3).size(0), 3);  // channels 3 on RGB: as it is
  EXPECT_EQ(readImage(rgbPath).size(0), 3);

  // Pure red, green, blue: green is the brightest and blue the darkest in gray.
  at::Tensor primaries = at::zeros({3, 1, 3}, at::kByte);
  for (int64_t c = 0; c < 3; ++c) primaries[c][0][c].fill_(255);
  const std::vector<int> luma = bytesOf(decodeImage(encodePng(primaries), "primaries", 1));
  ASSERT_EQ(luma.size(), 3u);
  EXPECT_GT(luma[1], luma[0]);
  EXPECT_GT(luma[0], luma[2]);

  // A gray PNG read as RGB: three copies of the gray channel.
  const std::string grayPath = dir + "/gray.png";
  writePng(grayPath, grayValues);
  const at::Tensor asRgb = readImage(grayPath, 3);
  EXPECT_EQ(asRgb.sizes().vec(), (std::vector<int64_t>{3, 5, 7}));
  EXPECT_TRUE(at::equal(asRgb[0], asRgb[1]));
  EXPECT_TRUE(at::equal(asRgb[0], asRgb[2]));
  EXPECT_LE(maxAbsDiff(asRgb[0], grayValues[0]), 1);
  EXPECT_TRUE(at::equal(readImage(grayPath, 1), grayValues));

  // JPEG: colour read as gray (its luma, 0.299 R + 0.587 G + 0.114 B), gray read as RGB.
  const std::string colourJpeg = encodeJpeg(flatImage({200, 40, 90}, 9, 13), 95);
  const at::Tensor jpegGray = decodeImage(colourJpeg, "colour.jpg", 1);
  EXPECT_EQ(jpegGray.sizes().vec(), (std::vector<int64_t>{1, 9, 13}));
  EXPECT_LE(maxAbsDiff(jpegGray, flatImage({94}, 9, 13)), 3);  // 93.54
  const at::Tensor jpegRgb = decodeImage(encodeJpeg(flatImage({77}, 11, 7), 95), "gray.jpg", 3);
  EXPECT_EQ(jpegRgb.sizes().vec(), (std::vector<int64_t>{3, 11, 7}));
  EXPECT_LE(maxAbsDiff(jpegRgb, flatImage({77, 77, 77}, 11, 7)), 2);

  EXPECT_THROW(readImage(grayPath, 2), Error);  // channels: 0, 1 or 3
  EXPECT_THROW(readImage(grayPath, 4), Error);
}

TEST(ImageIoTest, HandMadePngOfAFewPixelsDecodes) {
  // The control for the huge-size case below: the same construction, small, is a valid PNG.
  const at::Tensor image = decodeImage(pngClaiming(3, 2), "hand-made");
  EXPECT_EQ(image.sizes().vec(), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(image.sum().item<int64_t>(), 0);
}

TEST(ImageIoTest, UnreadableFilesAreErrorsNamingTheFile) {
  const std::string dir = test::scratchPath("tessera_image_io", "bad");
  fs::create_directories(dir);
  const std::string png = encodePng(patternImage(3, 30, 40));
  const std::string jpeg = encodeJpeg(patternImage(3, 32, 32), 90);  // noise: mostly scan data
  std::string randomBytes;
  for (int i = 0; i < 300; ++i) randomBytes.push_back(static_cast<char>((i * 131 + 7) % 256));  // starts 07 8a ..
  std::string corruptPng = png;
  corruptPng[corruptPng.size() - 20] ^= static_cast<char>(0xFF);  // inside the last IDAT: its CRC no longer matches

  struct Case {
    std::string name;
    std::string bytes;
    std::string expected;  // a part of the message besides the path
  };
  const std::vector<Case> cases = {
      {"truncated.png", png.substr(0, png.size() / 2), "PNG"},
      {"corrupt.png", corruptPng, "PNG"},
      {"truncated.jpg", jpeg.substr(0, jpeg.size() / 2), "JPEG"},
      {"random.png", randomBytes, "neither a PNG nor a JPEG"},
      {"empty.png", "", "neither a PNG nor a JPEG"},
      {"huge.png", pngClaiming(100000, 100000), "100000x100000"},
  };
  for (const Case& c : cases) {
    const std::string path = dir + "/" + c.name;
    writeFile(path, c.bytes);
    const std::string message = errorOf([&] { readImage(path); });
    EXPECT_NE(message.find(path), std::string::npos) << c.name << ": " << message;
    EXPECT_NE(message.find(c.expected), std::string::npos) << c.name << ": " << message;
  }
  // decodeImage names what its caller says the bytes are.
  EXPECT_NE(errorOf([&] { decodeImage(randomBytes, "blob-17"); }).find("blob-17"), std::string::npos);
  EXPECT_NE(errorOf([&] { decodeImage(jpeg.substr(0, jpeg.size() / 2), "half.jpg"); }).find("half.jpg"),
            std::string::npos);

  const std::string missing = dir + "/missing.png";
  const std::string missingMessage = errorOf([&] { readImage(missing); });
  EXPECT_NE(missingMessage.find(missing), std::string::npos) << missingMessage;

  const std::string folder = dir + "/folder.png";
  fs::create_directories(folder);
  const std::string folderMessage = errorOf([&] { readImage(folder); });
  EXPECT_NE(folderMessage.find(folder), std::string::npos) << folderMessage;
  EXPECT_NE(folderMessage.find("directory"), std::string::npos) << folderMessage;
}

TEST(ImageIoTest, FifoIsRefusedWithoutBlocking) {
  const std::string fifo = test::scratchPath("tessera_image_io", "fifo.png");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string message = errorWithoutBlockingOn(fifo, [fifo] { readImage(fifo); });
  EXPECT_NE(message.find(fifo), std::string::npos) << message;
  EXPECT_NE(message.find("FIFO"), std::string::npos) << message;
}

// --- image_ops --------------------------------------------------------------------------

TEST(ImageOpsTest, ModelPixelsMapZeroToMinusOneAndFullToOne) {
  const at::Tensor all = at::arange(256, at::kLong).to(at::kByte);
  const at::Tensor model = toModelPixels(all);
  EXPECT_EQ(model.scalar_type(), at::kFloat);
  EXPECT_FLOAT_EQ(model[0].item<float>(), -1.0f);
  EXPECT_FLOAT_EQ(model[255].item<float>(), 1.0f);
  EXPECT_GE(model.min().item<float>(), -1.0f);
  EXPECT_LE(model.max().item<float>(), 1.0f);
  EXPECT_TRUE((model.narrow(0, 1, 255) > model.narrow(0, 0, 255)).all().item<bool>());  // increasing
  // And back: every byte value survives the round trip.
  const at::Tensor back = toUint8Pixels(model);
  EXPECT_EQ(back.scalar_type(), at::kByte);
  EXPECT_TRUE(at::equal(back, all));
}

TEST(ImageOpsTest, Uint8PixelsAreClampedAndRounded) {
  // toUint8Pixels computes (x + 1) * 127.5, rounds with at::round (half to even, as
  // std::nearbyint), then clamps to [0, 255]: 0 -> 127.5 -> 128 (128 is the even
  // neighbour; half away from zero gives 128 as well), -2 -> -127.5 -> 0, 2 -> 382.5 -> 255.
  EXPECT_EQ(bytesOf(toUint8Pixels(floats({-2.0f, -1.0f, 0.0f, 1.0f, 2.0f}))), (std::vector<int>{0, 0, 128, 255, 255}));
  // 0.5 -> 191.25 -> 191, -0.5 -> 63.75 -> 64, -0.75 -> 31.875 -> 32.
  EXPECT_EQ(bytesOf(toUint8Pixels(floats({0.5f, -0.5f, -0.75f}))), (std::vector<int>{191, 64, 32}));
  const at::Tensor fromDouble = toUint8Pixels(at::zeros({2, 2}, at::kDouble));
  EXPECT_EQ(fromDouble.scalar_type(), at::kByte);
  EXPECT_EQ(fromDouble.sizes().vec(), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(bytesOf(fromDouble), (std::vector<int>{128, 128, 128, 128}));
}

TEST(ImageOpsTest, ResizeToTheSameSizeKeepsThePixels) {
  const at::Tensor image = patternImage(3, 5, 7);
  EXPECT_TRUE(at::equal(resizeImage(image, 5, 7), image));
}

TEST(ImageOpsTest, IntegerShrinkAveragesEachBlock) {
  // 2x: each output pixel the mean of a 2x2 block, rounded half to even (at::round).
  const at::Tensor image = patternImage(3, 6, 8);
  const at::Tensor half = resizeImage(image, 3, 4);
  ASSERT_EQ(half.sizes().vec(), (std::vector<int64_t>{3, 3, 4}));
  EXPECT_EQ(half.scalar_type(), at::kByte);
  const auto in = image.accessor<uint8_t, 3>();
  const auto out = half.accessor<uint8_t, 3>();
  for (int64_t c = 0; c < 3; ++c) {
    for (int64_t y = 0; y < 3; ++y) {
      for (int64_t x = 0; x < 4; ++x) {
        const int sum =
            in[c][2 * y][2 * x] + in[c][2 * y][2 * x + 1] + in[c][2 * y + 1][2 * x] + in[c][2 * y + 1][2 * x + 1];
        EXPECT_EQ(static_cast<int>(out[c][y][x]), static_cast<int>(std::nearbyint(sum / 4.0)))
            << c << " " << y << " " << x;
      }
    }
  }
  // 3x: 3x3 blocks.
  const at::Tensor big = patternImage(1, 6, 9, 5);
  const at::Tensor third = resizeImage(big, 2, 3);
  ASSERT_EQ(third.sizes().vec(), (std::vector<int64_t>{1, 2, 3}));
  const auto b = big.accessor<uint8_t, 3>();
  const auto t = third.accessor<uint8_t, 3>();
  for (int64_t y = 0; y < 2; ++y) {
    for (int64_t x = 0; x < 3; ++x) {
      int sum = 0;
      for (int64_t dy = 0; dy < 3; ++dy) {
        for (int64_t dx = 0; dx < 3; ++dx) sum += b[0][3 * y + dy][3 * x + dx];
      }
      EXPECT_EQ(static_cast<int>(t[0][y][x]), static_cast<int>(std::nearbyint(sum / 9.0))) << y << " " << x;
    }
  }
}

TEST(ImageOpsTest, BilinearResizeOfAConstantImageIsConstant) {
  const at::Tensor image = flatImage({77, 0, 255}, 5, 7);
  const std::vector<std::vector<int64_t>> sizes = {{9, 11}, {6, 4}, {3, 3}};  // up, mixed, down by 5/3 and 7/3
  for (const std::vector<int64_t>& size : sizes) {
    const at::Tensor resized = resizeImage(image, size[0], size[1]);
    ASSERT_EQ(resized.sizes().vec(), (std::vector<int64_t>{3, size[0], size[1]}));
    EXPECT_TRUE(at::equal(resized, flatImage({77, 0, 255}, size[0], size[1]))) << size[0] << "x" << size[1];
  }
}

TEST(ImageOpsTest, NonIntegerResizeIsTorchBilinearRounded) {
  // 4x6 -> 3x5 is no integer shrink: upsample_bilinear2d (align_corners false) on the
  // float image, then at::round (half to even) and a clamp, as resizeImage does.
  const at::Tensor image = patternImage(1, 4, 6);
  const at::Tensor resized = resizeImage(image, 3, 5);
  const at::Tensor expected =
      at::upsample_bilinear2d(image.to(at::kFloat).unsqueeze(0), {3, 5}, /*align_corners=*/false)
          .squeeze(0)
          .round()
          .clamp(0, 255)
          .to(at::kByte);
  ASSERT_EQ(resized.sizes().vec(), (std::vector<int64_t>{1, 3, 5}));
  EXPECT_TRUE(at::equal(resized, expected));

  // And against bilinear interpolation written out: source coordinate (d + 0.5) * in / out - 0.5,
  // clamped at 0, between the two nearest pixels (within the rounding's half a level).
  const auto in = image.accessor<uint8_t, 3>();
  const auto out = resized.accessor<uint8_t, 3>();
  auto source = [](int64_t d, int64_t inSize, int64_t outSize, int64_t& lo, int64_t& hi, double& frac) {
    const double scale = static_cast<double>(inSize) / static_cast<double>(outSize);
    const double s = std::max(0.0, (static_cast<double>(d) + 0.5) * scale - 0.5);
    lo = static_cast<int64_t>(s);
    hi = std::min(lo + 1, inSize - 1);
    frac = s - static_cast<double>(lo);
  };
  for (int64_t y = 0; y < 3; ++y) {
    for (int64_t x = 0; x < 5; ++x) {
      int64_t y0 = 0, y1 = 0, x0 = 0, x1 = 0;
      double fy = 0, fx = 0;
      source(y, 4, 3, y0, y1, fy);
      source(x, 6, 5, x0, x1, fx);
      const double value = (1 - fy) * ((1 - fx) * in[0][y0][x0] + fx * in[0][y0][x1]) +
                           fy * ((1 - fx) * in[0][y1][x0] + fx * in[0][y1][x1]);
      EXPECT_LE(std::abs(static_cast<double>(out[0][y][x]) - value), 0.5 + 1e-3) << y << " " << x;
    }
  }
}

TEST(ImageOpsTest, ResizeRefusesWhatIsNotAUint8Image) {
  EXPECT_THROW(resizeImage(at::zeros({1, 4, 4}, at::kFloat), 2, 2), Error);
  EXPECT_THROW(resizeImage(at::zeros({4, 4}, at::kByte), 2, 2), Error);
  EXPECT_THROW(resizeImage(at::zeros({1, 4, 4}, at::kByte), 0, 2), Error);
}

TEST(ImageOpsTest, ImageGridPlacesImageKAtRowKOverColumnsAndColumnKModColumns) {
  const int64_t n = 5, c = 3, h = 2, w = 3, columns = 2, padding = 1, scale = 2;
  const at::Tensor pixels =
      at::arange(n * c * h * w, at::kLong).mul(73).add(41).remainder(256).to(at::kByte).view({n, c, h, w});
  const at::Tensor grid = imageGrid(toModelPixels(pixels), columns, padding, scale);
  // 3 rows of 2 * 2 + 1 pixels and 2 columns of 3 * 2 + 1, after one pixel of border.
  ASSERT_EQ(grid.sizes().vec(), (std::vector<int64_t>{3, 16, 15}));
  EXPECT_EQ(grid.scalar_type(), at::kByte);

  at::Tensor expected = at::full({3, 16, 15}, 128, at::kByte);
  auto e = expected.accessor<uint8_t, 3>();
  const auto p = pixels.accessor<uint8_t, 4>();
  for (int64_t k = 0; k < n; ++k) {
    const int64_t top = padding + (k / columns) * (h * scale + padding);
    const int64_t left = padding + (k % columns) * (w * scale + padding);
    for (int64_t ch = 0; ch < c; ++ch) {
      for (int64_t y = 0; y < h * scale; ++y) {
        for (int64_t x = 0; x < w * scale; ++x) e[ch][top + y][left + x] = p[k][ch][y / scale][x / scale];
      }
    }
  }
  EXPECT_TRUE(at::equal(grid, expected));

  const auto g = grid.accessor<uint8_t, 3>();
  // Image 3: row 1, column 1 (top 1 + 5, left 1 + 7); each pixel a 2x2 block.
  EXPECT_EQ(static_cast<int>(g[0][6][8]), static_cast<int>(p[3][0][0][0]));
  EXPECT_EQ(static_cast<int>(g[0][7][9]), static_cast<int>(p[3][0][0][0]));
  EXPECT_EQ(static_cast<int>(g[2][6][10]), static_cast<int>(p[3][2][0][1]));
  EXPECT_EQ(static_cast<int>(g[1][13][5]), static_cast<int>(p[4][1][1][2]));  // image 4: row 2, column 0
  // Gray 128: the border, the gaps, and the empty cell after the last image.
  EXPECT_TRUE((grid.select(1, 0) == 128).all().item<bool>());
  EXPECT_TRUE((grid.select(1, 5) == 128).all().item<bool>());
  EXPECT_TRUE((grid.select(2, 7) == 128).all().item<bool>());
  EXPECT_TRUE((grid.narrow(1, 11, 4).narrow(2, 8, 6) == 128).all().item<bool>());
}

TEST(ImageOpsTest, ImageGridWithoutPaddingOrScaleLaysImagesSideBySide) {
  const at::Tensor pixels = patternImage(2 * 3, 2, 3).view({2, 3, 2, 3});
  const at::Tensor grid = imageGrid(toModelPixels(pixels), /*columns=*/4, /*padding=*/0, /*scale=*/1);
  ASSERT_EQ(grid.sizes().vec(), (std::vector<int64_t>{3, 2, 12}));  // four cells wide, two used
  EXPECT_TRUE(at::equal(grid.narrow(2, 0, 3), pixels[0]));
  EXPECT_TRUE(at::equal(grid.narrow(2, 3, 3), pixels[1]));
  EXPECT_TRUE((grid.narrow(2, 6, 6) == 128).all().item<bool>());
  EXPECT_THROW(imageGrid(toModelPixels(pixels), 0), Error);
  EXPECT_THROW(imageGrid(toModelPixels(pixels[0]), 2), Error);  // [C, H, W]: no batch
}

}  // namespace
}  // namespace tessera::imaging
