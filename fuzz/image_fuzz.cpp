// libFuzzer target: the image readers on arbitrary bytes — PNG and JPEG decoding (libpng,
// TurboJPEG) into 0, 1 or 3 channels, and the IDX images and labels readers (raw or
// gzipped), handed the bytes as an in-memory file (memfd) opened by path as in a run. The
// first byte picks the reader. Only tessera::Error may come out; a decoded image must
// have the shape the reader promises.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/errors.h"
#include "fuzz/mem_file.h"
#include "imaging/image_io.h"
#include "datasets/image_dataset.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t selector = data[0];
  try {
    if (selector % 4 < 2) {
      const int channels = selector % 3 == 0 ? 0 : selector % 3 == 1 ? 1 : 3;
      const at::Tensor image = tessera::imaging::decodeImage(std::string(reinterpret_cast<const char*>(data + 1), size - 1),
                                                             "fuzz input", channels);
      if (image.dim() != 3 || image.scalar_type() != at::kByte) std::abort();
      if (channels != 0 && image.size(0) != channels) std::abort();
    } else {
      const tessera::fuzz::MemFile file(data + 1, size - 1);
      if (selector % 4 == 2) {
        const at::Tensor images = tessera::datasets::readIdxImages(file.path());
        if (images.dim() != 4 || images.size(1) != 1) std::abort();
      } else {
        const at::Tensor labels = tessera::datasets::readIdxLabels(file.path());
        if (labels.dim() != 1) std::abort();
      }
    }
  } catch (const tessera::Error&) {
    // refused with a message
  }
  return 0;
}
