// The tests' IDX image data sets (see idx_images.h).
#include "tests/support/idx_images.h"

#include <cstdint>
#include <filesystem>
#include <fstream>

namespace tessera::test {
namespace {

void putBigEndian(std::ofstream& out, uint32_t v) {
  const char bytes[4] = {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
                         static_cast<char>(v)};
  out.write(bytes, 4);
}

}  // namespace

std::pair<std::string, std::string> writeIdxImages(const std::string& dir) {
  std::filesystem::create_directories(dir);
  const std::string images = dir + "/images-idx3-ubyte", labels = dir + "/labels-idx1-ubyte";
  constexpr uint32_t kCount = 96, kSide = 8;
  std::ofstream img(images, std::ios::binary), lab(labels, std::ios::binary);
  putBigEndian(img, 0x803);
  for (uint32_t d : {kCount, kSide, kSide}) putBigEndian(img, d);
  putBigEndian(lab, 0x801);
  putBigEndian(lab, kCount);
  for (uint32_t i = 0; i < kCount; ++i) {
    const uint32_t c = (i * 7) % 4;
    lab.put(static_cast<char>(c));
    for (uint32_t y = 0; y < kSide; ++y) {
      for (uint32_t x = 0; x < kSide; ++x) {
        const uint32_t background = (i * 37 + y * 11 + x * 5) % 64;
        img.put(static_cast<char>(y == 2 * c ? 200 + (x * 7) % 50 : background));
      }
    }
  }
  return {images, labels};
}

}  // namespace tessera::test
