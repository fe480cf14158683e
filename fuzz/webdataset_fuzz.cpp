// libFuzzer target: a WebDataset shard of arbitrary bytes — the tar reader (every member's
// header and data) and the webdataset dataset over it (no manifest: the shard is scanned),
// opened by path from an in-memory file as a run opens its shards. Only tessera::Error may
// come out; members must lie inside the file in order, and an accepted dataset must hand
// out a batch of its first sample with the shape its spec promises.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "common/errors.h"
#include "datasets/data_options.h"
#include "datasets/dataset.h"
#include "datasets/tar_file.h"
#include "fuzz/mem_file.h"

namespace datasets = tessera::datasets;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const tessera::fuzz::MemFile file(data, size);
  try {
    datasets::TarReader tar(file.path());
    datasets::TarMember m;
    int64_t end = 0;
    while (tar.next(m)) {
      if (m.offset < end || m.size < 0 || m.offset + m.size > static_cast<int64_t>(size)) std::abort();
      end = m.offset + m.size;
      if (m.size <= (1 << 20)) tar.readData(m, 1 << 20);
    }
  } catch (const tessera::Error&) {
    // refused with a message
  }
  try {
    datasets::DataOptions options;
    options.kind = "webdataset";
    options.path = file.path();
    options.shuffle = false;
    const auto dataset = datasets::makeDataset(options, {});
    const datasets::Batch batch = dataset->trainBatch({0});
    if (batch.size() != 1 || batch.inputs.dim() != 1 + static_cast<int64_t>(dataset->spec().inputShape.size())) {
      std::abort();
    }
  } catch (const tessera::Error&) {
    // refused with a message
  }
  return 0;
}
