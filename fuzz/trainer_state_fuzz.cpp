// libFuzzer target: trainer_state.json as a resume reads it — the checkpoint's check
// (a bounded JSON object), then the trainer's counters with every value range- and
// type-checked — and the same bytes as a post-hoc EMA snapshot's state
// (ema/posthoc_state.h). Only tessera::Error may come out; accepted counters must write
// and read back equal, accepted snapshot profiles be usable.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "checkpoint/metadata.h"
#include "common/errors.h"
#include "ema/posthoc_state.h"
#include "ema/power_ema.h"
#include "trainer/train_counters.h"

using tessera::trainer::countersFromJson;
using tessera::trainer::countersToJson;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const auto c = countersFromJson(tessera::checkpoint::parseTrainerState(text, "fuzz"), "fuzz trainer_state.json");
    const int64_t emaUpdates = c.formerEmaCounts.single.value_or(0);
    if (c.step < 0 || emaUpdates < 0 || emaUpdates > c.step || c.skippedSteps > c.step || c.worldSize < 1 ||
        c.globalBatch < 1) {
      std::abort();  // accepted a value the trainer cannot use
    }
    const std::string written = countersToJson(c);
    if (countersToJson(countersFromJson(written, "fuzz round trip")) != written) std::abort();
  } catch (const tessera::Error&) {
    // refused with a message
  }
  try {
    const auto state = tessera::ema::parsePosthocState(text, "fuzz posthoc trainer_state.json");
    if (state.profiles.empty() || state.run.empty()) std::abort();
    for (const auto& [name, sigma] : state.profiles) {
      if (!(sigma > 0 && sigma < tessera::ema::kMaxPowerEmaStd)) std::abort();  // unusable, yet accepted
    }
  } catch (const tessera::Error&) {
    // refused with a message
  }
  return 0;
}
