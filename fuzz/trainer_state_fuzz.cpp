// libFuzzer target: trainer_state.json as a resume reads it — the checkpoint's check
// (a bounded JSON object), then the trainer's counters with every value range- and
// type-checked. Only tessera::Error may come out; accepted counters must write and read
// back equal.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "checkpoint/metadata.h"
#include "common/errors.h"
#include "trainer/train_counters.h"

using tessera::trainer::countersFromJson;
using tessera::trainer::countersToJson;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const auto c = countersFromJson(tessera::checkpoint::parseTrainerState(text, "fuzz"), "fuzz trainer_state.json");
    const int64_t emaUpdates = c.legacyEmaUpdates.value_or(0);
    if (c.step < 0 || emaUpdates < 0 || emaUpdates > c.step || c.skippedSteps > c.step || c.worldSize < 1 ||
        c.globalBatch < 1) {
      std::abort();  // accepted a value the trainer cannot use
    }
    const std::string written = countersToJson(c);
    if (countersToJson(countersFromJson(written, "fuzz round trip")) != written) std::abort();
  } catch (const tessera::Error&) {
    // refused with a message
  }
  return 0;
}
