// libFuzzer target: an export's model metadata (safetensors __metadata__["tessera.model"],
// and the model descriptions tessera-export copies from trainer_state.json), checked as
// every reader checks it before building a model: checkedModelMetadata against the
// tensors the file holds. The first byte picks those tensors (none, a small MLP's, a
// small DiT's, a small GPT's); the rest is the JSON. Only tessera::Error may come out.
// Accepted metadata describes sizes the tensors could hold, and written again
// (modelMetadataJson) it reads back to the same description.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "common/errors.h"
#include "trainer/model_metadata.h"

namespace {

using Shapes = std::map<std::string, std::vector<int64_t>>;

// What files of the built-in models hold (their names do not matter to the check; sizes do).
const std::vector<Shapes>& fileTensors() {
  static const std::vector<Shapes> sets = {
      {},
      {{"net.0.weight", {64, 784}}, {"net.0.bias", {64}}, {"net.2.weight", {10, 64}}, {"net.2.bias", {10}}},
      {{"patch.weight", {96, 1, 4, 4}}, {"pos", {1, 49, 96}}, {"blocks.0.attn.qkv.weight", {288, 96}},
       {"blocks.0.mlp.fc1.weight", {384, 96}}, {"blocks.0.mlp.fc2.weight", {96, 384}}, {"final.weight", {16, 96}}},
      {{"wte.weight", {256, 64}}, {"wpe.weight", {128, 64}}, {"h.0.attn.c_attn.weight", {192, 64}},
       {"h.0.mlp.c_fc.weight", {256, 64}}, {"h.1.attn.c_attn.weight", {192, 64}}, {"ln_f.weight", {64}}},
  };
  return sets;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const Shapes& found = fileTensors()[data[0] % fileTensors().size()];
  const std::string json(reinterpret_cast<const char*>(data + 1), size - 1);
  using namespace tessera::trainer;
  try {
    const ModelDescription d = checkedModelMetadata(json, "fuzz.safetensors", found);
    if (d.model.layers < 0 || d.model.embed_dim < 0) std::abort();
    for (const int64_t dim : d.data.inputShape) {
      if (dim < 0) std::abort();
    }
    const std::string again = modelMetadataJson(d.model, d.data, d.dataset ? &*d.dataset : nullptr);
    const ModelDescription back = parseModelMetadata(again, "again");
    if (modelMetadataJson(back.model, back.data, back.dataset ? &*back.dataset : nullptr) != again) std::abort();
  } catch (const tessera::Error&) {
    // refused with a message naming the file and key
  }
  return 0;
}
