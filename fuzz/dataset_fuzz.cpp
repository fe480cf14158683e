// libFuzzer target: the dataset readers on a file of arbitrary bytes — byte-level text,
// uint16 and uint32 token files (with a vocabulary bound) and safetensors tensor data.
// The first byte picks the reader and a context length; the rest is the file, handed over
// as an in-memory file (memfd) so that the readers open it by path as they do in a run.
// Only tessera::Error may come out; an accepted dataset must hand out a batch of its
// first and last train samples with the shapes its spec promises.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "common/errors.h"
#include "fuzz/mem_file.h"
#include "datasets/tensor_dataset.h"
#include "datasets/text_dataset.h"

namespace datasets = tessera::datasets;

namespace {

std::unique_ptr<datasets::Dataset> open(uint8_t selector, const std::string& path) {
  const int64_t context = 1 + (selector >> 2) % 8;
  switch (selector % 4) {
    case 0:
      return std::make_unique<datasets::TextDataset>(path, context, 0.25, datasets::TokenFormat::kBytes, 256);
    case 1:
      return std::make_unique<datasets::TextDataset>(path, context, 0.25, datasets::TokenFormat::kUint16, 1000, true);
    case 2:
      return std::make_unique<datasets::TextDataset>(path, context, 0.25, datasets::TokenFormat::kUint32, 70000);
    default:
      return std::make_unique<datasets::TensorDataset>(path, 0.25);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const tessera::fuzz::MemFile file(data + 1, size - 1);
  try {
    const auto dataset = open(data[0], file.path());
    const int64_t n = dataset->trainSamples();
    if (n < 1 || dataset->evalSamples() < 1) std::abort();  // the readers promise both splits
    const datasets::Batch batch = dataset->trainBatch({0, n - 1});
    const datasets::DataSpec spec = dataset->spec();
    if (batch.size() != 2 || batch.inputs.dim() != 1 + static_cast<int64_t>(spec.inputShape.size())) std::abort();
    dataset->evalBatch(0, 1);
  } catch (const tessera::Error&) {
    // refused with a message
  }
  return 0;
}
