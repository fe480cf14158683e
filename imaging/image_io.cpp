// PNG (libpng's simplified API) and JPEG (TurboJPEG) decoding and PNG writing (see
// image_io.h).
#include "imaging/image_io.h"

#include <png.h>
#include <turbojpeg.h>

#include <cstring>
#include <memory>

#include "common/errors.h"
#include "common/file_open.h"

namespace tessera::imaging {
namespace {

constexpr int64_t kMaxFileBytes = int64_t{256} << 20;

bool isPng(const std::string& data) {
  static const unsigned char kSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  return data.size() >= 8 && std::memcmp(data.data(), kSignature, 8) == 0;
}

bool isJpeg(const std::string& data) {
  return data.size() >= 3 && static_cast<unsigned char>(data[0]) == 0xFF && static_cast<unsigned char>(data[1]) == 0xD8 &&
         static_cast<unsigned char>(data[2]) == 0xFF;
}

void checkSize(int64_t width, int64_t height, const std::string& what) {
  TESSERA_CHECK(width >= 1 && height >= 1 && width * height <= kMaxPixels, "image '", what, "': ", width, "x", height,
                " pixels (at most ", kMaxPixels, " are read)");
}

// [H, W, C] interleaved pixels as the [C, H, W] tensor callers use.
at::Tensor toChannelsFirst(at::Tensor hwc) { return hwc.permute({2, 0, 1}).contiguous(); }

at::Tensor decodePng(const std::string& data, const std::string& what, int channels) {
  png_image image;
  std::memset(&image, 0, sizeof image);
  image.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&image, data.data(), data.size())) {
    throw Error(strCat("image '", what, "': not a readable PNG (", image.message, ")"));
  }
  const bool colour = channels == 3 || (channels == 0 && (image.format & PNG_FORMAT_FLAG_COLOR) != 0);
  // Alpha is composited onto black: libpng does it when the format has no alpha channel.
  image.format = colour ? PNG_FORMAT_RGB : PNG_FORMAT_GRAY;
  try {
    checkSize(image.width, image.height, what);
  } catch (...) {
    png_image_free(&image);
    throw;
  }
  const int c = colour ? 3 : 1;
  at::Tensor hwc = at::empty({static_cast<int64_t>(image.height), static_cast<int64_t>(image.width), c}, at::kByte);
  png_color black{0, 0, 0};
  if (!png_image_finish_read(&image, &black, hwc.data_ptr<uint8_t>(), 0, nullptr)) {
    const std::string message = image.message;
    png_image_free(&image);
    throw Error(strCat("image '", what, "': PNG data is truncated or corrupt (", message, ")"));
  }
  return toChannelsFirst(hwc);
}

struct TurboJpegHandle {
  tjhandle handle = tjInitDecompress();
  ~TurboJpegHandle() {
    if (handle != nullptr) tjDestroy(handle);
  }
};

at::Tensor decodeJpeg(const std::string& data, const std::string& what, int channels) {
  TurboJpegHandle tj;
  TESSERA_CHECK(tj.handle != nullptr, "image '", what, "': TurboJPEG could not start: ", tjGetErrorStr2(nullptr));
  auto* bytes = reinterpret_cast<unsigned char*>(const_cast<char*>(data.data()));
  int width = 0, height = 0, subsampling = 0, colorspace = 0;
  if (tjDecompressHeader3(tj.handle, bytes, data.size(), &width, &height, &subsampling, &colorspace) != 0) {
    throw Error(strCat("image '", what, "': not a readable JPEG (", tjGetErrorStr2(tj.handle), ")"));
  }
  checkSize(width, height, what);
  const bool colour = channels == 3 || (channels == 0 && colorspace != TJCS_GRAY);
  const int c = colour ? 3 : 1;
  at::Tensor hwc = at::empty({height, width, c}, at::kByte);
  // TJFLAG_STOPONWARNING: a truncated file is an error, not an image padded with gray.
  if (tjDecompress2(tj.handle, bytes, data.size(), hwc.data_ptr<uint8_t>(), width, 0, height,
                    colour ? TJPF_RGB : TJPF_GRAY, TJFLAG_STOPONWARNING) != 0) {
    throw Error(strCat("image '", what, "': JPEG data is truncated or corrupt (", tjGetErrorStr2(tj.handle), ")"));
  }
  return toChannelsFirst(hwc);
}

}  // namespace

at::Tensor decodeImage(const std::string& data, const std::string& what, int channels) {
  TESSERA_CHECK(channels == 0 || channels == 1 || channels == 3, "decodeImage: channels ", channels, " (0, 1 or 3)");
  if (isPng(data)) return decodePng(data, what, channels);
  if (isJpeg(data)) return decodeJpeg(data, what, channels);
  throw Error(strCat("image '", what, "': neither a PNG nor a JPEG file (", data.size(), " bytes)"));
}

at::Tensor readImage(const std::string& path, int channels) {
  return decodeImage(readRegularFile(path, kMaxFileBytes), quote(path), channels);
}

std::string encodePng(const at::Tensor& image) {
  const at::Tensor chw = image.dim() == 2 ? image.unsqueeze(0) : image;
  TESSERA_CHECK(chw.dim() == 3 && (chw.size(0) == 1 || chw.size(0) == 3) && chw.scalar_type() == at::kByte &&
                    chw.size(1) >= 1 && chw.size(2) >= 1,
                "encodePng: expected a [1 or 3, H, W] uint8 image, got ", image.scalar_type(), " ", image.sizes());
  checkSize(chw.size(2), chw.size(1), "to encode");
  const at::Tensor hwc = chw.permute({1, 2, 0}).contiguous().cpu();
  png_image png;
  std::memset(&png, 0, sizeof png);
  png.version = PNG_IMAGE_VERSION;
  png.width = static_cast<png_uint_32>(chw.size(2));
  png.height = static_cast<png_uint_32>(chw.size(1));
  png.format = chw.size(0) == 3 ? PNG_FORMAT_RGB : PNG_FORMAT_GRAY;
  png_alloc_size_t bytes = 0;
  if (!png_image_write_to_memory(&png, nullptr, &bytes, 0, hwc.data_ptr<uint8_t>(), 0, nullptr)) {
    throw Error(strCat("encodePng: ", png.message));
  }
  std::string out(bytes, '\0');
  if (!png_image_write_to_memory(&png, out.data(), &bytes, 0, hwc.data_ptr<uint8_t>(), 0, nullptr)) {
    throw Error(strCat("encodePng: ", png.message));
  }
  out.resize(bytes);
  return out;
}

void writePng(const std::string& path, const at::Tensor& image) { replaceFile(path, encodePng(image)); }

}  // namespace tessera::imaging
