// libFuzzer target for every reader of untrusted checkpoint bytes: the first byte picks
// the reader, the rest is the document. A reader may only return or throw
// tessera::Error (CheckpointError); a crash, hang, sanitizer report or any other
// exception is a bug. Parsed results are re-serialised and re-parsed to check that what
// the readers accept, the writers reproduce.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "checkpoint/format.h"
#include "checkpoint/metadata.h"
#include "checkpoint/safetensors.h"
#include "common/errors.h"

namespace ckpt = tessera::checkpoint;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int which = data[0] % 4;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  try {
    switch (which) {
      case 0: {
        const auto md = ckpt::parseMetadata(text, "fuzz metadata.json");
        // What the reader accepted must survive a round trip through the writer.
        const auto again = ckpt::parseMetadata(ckpt::toJson(md), "fuzz round trip");
        if (again.tensors.size() != md.tensors.size() || again.tensorBytes() != md.tensorBytes()) std::abort();
        break;
      }
      case 1: {
        const auto idx = ckpt::parseRankIndex(text, "fuzz rank index");
        ckpt::parseRankIndex(ckpt::toJson(idx), "fuzz round trip");
        break;
      }
      case 2:
        ckpt::parseTrainerState(text, "fuzz trainer_state.json");
        break;
      default: {
        const auto* bytes = data + 1;
        const auto h = ckpt::parseSafetensorsHeader(bytes, size - 1, static_cast<int64_t>(size - 1), "fuzz.safetensors");
        // Accepted headers describe a data section exactly the file's remainder.
        if (h.dataOffset() + h.dataBytes() != static_cast<int64_t>(size - 1)) std::abort();
        break;
      }
    }
  } catch (const tessera::Error&) {
    // Rejected with a message: the expected outcome for malformed input.
  }
  return 0;
}
