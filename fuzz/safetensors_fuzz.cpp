// libFuzzer target: safetensors headers and sharded-export indexes (*.index.json) — the
// first byte picks the reader, the rest is the file. Only tessera::Error may come out.
// An accepted header describes a data section that is exactly the rest of the file, and is
// then checked as the dmd recipe's pairs cache is (safetensorsLayoutProblem: only then is
// its data read); an accepted index names only plain files next to it.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "checkpoint/safetensors.h"
#include "common/errors.h"

namespace ckpt = tessera::checkpoint;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t* file = data + 1;
  const size_t bytes = size - 1;
  try {
    if (data[0] % 2 == 0) {
      const auto h = ckpt::parseSafetensorsHeader(file, bytes, static_cast<int64_t>(bytes), "fuzz.safetensors");
      if (h.dataOffset() + h.dataBytes() != static_cast<int64_t>(bytes)) std::abort();
      int64_t next = 0;
      for (const auto& t : h.tensors) {
        if (t.begin != next || t.bytes() != t.numel() * ckpt::dtypeBytes(t.dtype)) std::abort();
        next = t.end;
      }
      // The pairs cache of 4 pairs of [1, 2, 2] images with labels: accepted only when the
      // header holds exactly those tensors.
      const ckpt::SafetensorsLayout pairs = {{"noise", {{4, 1, 2, 2}, at::kFloat}},
                                             {"samples", {{4, 1, 2, 2}, at::kFloat}},
                                             {"labels", {{4}, at::kLong}}};
      if (ckpt::safetensorsLayoutProblem(h, pairs).empty()) {
        if (h.tensors.size() != 3 || h.dataBytes() != 2 * 16 * 4 + 4 * 8) std::abort();
      }
    } else {
      const auto map = ckpt::parseSafetensorsIndex(std::string(reinterpret_cast<const char*>(file), bytes), "fuzz.index.json");
      for (const auto& [name, f] : map) {
        if (name.empty() || f.empty() || f == "." || f == ".." || f.find('/') != std::string::npos) std::abort();
      }
    }
  } catch (const tessera::Error&) {
    // refused with a message
  }
  return 0;
}
