// makeDataset and the per-sample noise seeds (see dataset.h).
#include "datasets/dataset.h"

#include "common/counter_rng.h"
#include "common/errors.h"
#include "datasets/image_dataset.h"
#include "datasets/tensor_dataset.h"
#include "datasets/text_dataset.h"
#include "datasets/webdataset.h"
#include "datasets/data_options.h"

namespace tessera::datasets {

DataSpec tokenWindowSpec(int64_t context, int64_t vocabSize, bool everyPosition) {
  DataSpec s;
  s.tokens = true;
  s.inputShape = {context};
  s.classes = vocabSize;
  if (everyPosition) s.targetShape = {context};
  return s;
}

std::unique_ptr<Dataset> makeDataset(const DataOptions& data, const TokenWindows& windows, int64_t orderSeed) {
  if (data.kind == "tensors") return std::make_unique<TensorDataset>(data.path, data.eval_fraction);
  if (data.kind == "idx") return makeIdxDataset(data);
  if (data.kind == "image_folder") return makeImageFolderDataset(data);
  if (data.kind == "webdataset") return makeWebDataset(data, orderSeed);
  return std::make_unique<TextDataset>(data.path, windows.context, data.eval_fraction,
                                       parseTokenFormat(data.kind, data.token_dtype), windows.vocabSize,
                                       windows.everyPosition);
}

uint64_t noiseSeed(int64_t runSeed, int64_t step, int64_t index) {
  return mix64(counterBits(static_cast<uint64_t>(runSeed), static_cast<uint64_t>(step)) ^ static_cast<uint64_t>(index));
}

void seedNoise(Batch& batch, int64_t runSeed, int64_t step, const std::vector<int64_t>& indices) {
  batch.noiseSeeds.clear();
  for (int64_t i : indices) batch.noiseSeeds.push_back(noiseSeed(runSeed, step, i));
}

}  // namespace tessera::datasets
