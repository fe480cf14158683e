// Pixel scaling, resizing and grids (see image_ops.h).
#include "imaging/image_ops.h"

#include "common/errors.h"

namespace tessera::imaging {

at::Tensor toModelPixels(const at::Tensor& uint8Pixels) {
  return uint8Pixels.to(at::kFloat).div(127.5).sub(1.0);
}

at::Tensor toUint8Pixels(const at::Tensor& modelPixels) {
  // NaN (a diverged model's samples) shows as black rather than reaching an undefined cast.
  return at::nan_to_num(modelPixels.to(at::kFloat), -1.0).add(1.0).mul(127.5).round().clamp(0, 255).to(at::kByte);
}

at::Tensor resizeImage(const at::Tensor& image, int64_t height, int64_t width) {
  TESSERA_CHECK(image.dim() == 3 && image.scalar_type() == at::kByte, "resizeImage: expected [C, H, W] uint8, got ",
                image.scalar_type(), " ", image.sizes());
  TESSERA_CHECK(height >= 1 && width >= 1, "resizeImage: target ", height, "x", width);
  if (image.size(1) == height && image.size(2) == width) return image;
  const at::Tensor x = image.to(at::kFloat).unsqueeze(0);
  at::Tensor y;
  if (image.size(1) % height == 0 && image.size(2) % width == 0) {
    y = at::adaptive_avg_pool2d(x, {height, width});
  } else {
    y = at::upsample_bilinear2d(x, {height, width}, /*align_corners=*/false);
  }
  return y.squeeze(0).round().clamp(0, 255).to(at::kByte);
}

at::Tensor imageGrid(const at::Tensor& images, int64_t columns, int64_t padding, int64_t scale) {
  TESSERA_CHECK(images.dim() == 4 && images.size(0) >= 1, "imageGrid: expected images [N, C, H, W], got ",
                images.sizes());
  TESSERA_CHECK(columns >= 1 && padding >= 0 && scale >= 1, "imageGrid: columns ", columns, ", padding ", padding,
                ", scale ", scale);
  const int64_t n = images.size(0), c = images.size(1);
  at::Tensor pixels = toUint8Pixels(images.detach().cpu());
  if (scale > 1) pixels = pixels.repeat_interleave(scale, 2).repeat_interleave(scale, 3);
  const int64_t h = pixels.size(2), w = pixels.size(3);
  const int64_t rows = (n + columns - 1) / columns;
  at::Tensor grid = at::full({c, padding + rows * (h + padding), padding + columns * (w + padding)}, 128, at::kByte);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t top = padding + (i / columns) * (h + padding), left = padding + (i % columns) * (w + padding);
    grid.narrow(1, top, h).narrow(2, left, w).copy_(pixels[i]);
  }
  return grid;
}

}  // namespace tessera::imaging
