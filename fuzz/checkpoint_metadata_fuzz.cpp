// libFuzzer target: a checkpoint's metadata.json and the per-rank chunk tables
// (rank_N.json) — the first byte picks the reader, the rest is the document. Only
// tessera::Error (CheckpointError) may come out; what is accepted must survive the
// writer and the reader again unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "checkpoint/metadata.h"
#include "common/errors.h"

namespace ckpt = tessera::checkpoint;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  try {
    if (data[0] % 2 == 0) {
      const auto md = ckpt::parseMetadata(text, "fuzz metadata.json");
      const std::string written = ckpt::toJson(md);
      if (ckpt::toJson(ckpt::parseMetadata(written, "fuzz round trip")) != written) std::abort();
    } else {
      const auto index = ckpt::parseRankIndex(text, "fuzz rank index");
      const std::string written = ckpt::toJson(index);
      if (ckpt::toJson(ckpt::parseRankIndex(written, "fuzz round trip")) != written) std::abort();
    }
  } catch (const tessera::Error&) {
    // refused with a message
  }
  return 0;
}
