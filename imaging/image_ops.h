// Pixel conventions and image arithmetic shared by datasets, samplers and pictures:
// models see pixels scaled to [-1, 1]; files hold uint8. A grid lays samples out one
// class per row for a reader to look at.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace tessera::imaging {

// uint8 pixels -> float32 in [-1, 1] (0 -> -1, 255 -> 1).
at::Tensor toModelPixels(const at::Tensor& uint8Pixels);
// float pixels in [-1, 1] -> uint8, clamped and rounded (-1 -> 0, 1 -> 255; NaN -> 0).
at::Tensor toUint8Pixels(const at::Tensor& modelPixels);

// [C, H, W] uint8 resized to [C, height, width] (bilinear, align_corners false, as
// torchvision's Resize on tensors without antialiasing; area averaging when shrinking by
// an integer factor, which is what antialiasing does there).
at::Tensor resizeImage(const at::Tensor& image, int64_t height, int64_t width);

// Images [N, C, H, W] (float in [-1, 1]) as one uint8 picture [C, H', W']: `columns` per
// row in order, `padding` pixels of gray between them, each pixel repeated `scale` times
// in both directions (28x28 samples are too small to look at otherwise).
at::Tensor imageGrid(const at::Tensor& images, int64_t columns, int64_t padding = 2, int64_t scale = 1);

}  // namespace tessera::imaging
