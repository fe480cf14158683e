// Image files as tensors: PNG and JPEG decoded into [channels, height, width] uint8
// (channels 1 for grayscale, 3 for colour; alpha is composited away, palettes expanded),
// and PNG written from such a tensor. Every failure — a missing, truncated or undecodable
// file, a format that is neither PNG nor JPEG, a FIFO or device at the path — is a
// tessera::Error naming the file; nothing longjmps through C++ frames.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace tessera::imaging {

// Images larger than this (width x height) are refused as corrupt or hostile: decoding
// one would allocate gigabytes.
constexpr int64_t kMaxPixels = int64_t{1} << 26;

// Decodes the PNG or JPEG bytes `data` (the format from their signature). `what` names
// them in errors (a file name). `channels`: 1 or 3 converts to that many; 0 keeps the
// file's (1 for gray, 3 for colour).
at::Tensor decodeImage(const std::string& data, const std::string& what, int channels = 0);

// Reads and decodes the image file at `path` (a regular file of at most 256 MiB).
at::Tensor readImage(const std::string& path, int channels = 0);

// Encodes `image` ([1 or 3, H, W] uint8, or [H, W]) as PNG bytes.
std::string encodePng(const at::Tensor& image);

// Writes `image` as a PNG at `path`, replacing what is there by a rename (a link at the
// path is replaced, not followed).
void writePng(const std::string& path, const at::Tensor& image);

}  // namespace tessera::imaging
