// Small IDX image data sets written by the tests that train image models (DiT, webdataset).
#pragma once

#include <string>
#include <utility>

namespace tessera::test {

// 96 images of 8x8 in 4 classes, as IDX files under `dir` (images, labels): class c is a
// bright bar at row 2c over a noisy background, so that the classes differ.
std::pair<std::string, std::string> writeIdxImages(const std::string& dir);

}  // namespace tessera::test
