// The prefetching batch loader (see batch_loader.h).
#include "datasets/batch_loader.h"

#include <chrono>

#include "common/counter_rng.h"
#include "common/errors.h"
#include "common/trace.h"
#include "datasets/text_dataset.h"

namespace tessera::datasets {
namespace {

constexpr uint64_t kFlipStream = 0x666c6970ULL;  // "flip"

}  // namespace

Batch sliceBatch(const Batch& batch, int64_t begin, int64_t end) {
  Batch out;
  out.inputs = batch.inputs.slice(0, begin, end);
  if (batch.targets.defined()) out.targets = batch.targets.slice(0, begin, end);
  if (!batch.noiseSeeds.empty()) {
    out.noiseSeeds.assign(batch.noiseSeeds.begin() + begin, batch.noiseSeeds.begin() + end);
  }
  return out;
}

void flipHalfHorizontally(Batch& batch) {
  TESSERA_CHECK(batch.inputs.dim() == 4 && static_cast<int64_t>(batch.noiseSeeds.size()) == batch.size(),
                "data.hflip: needs images [n, C, H, W] with a noise seed each, got ", batch.inputs.sizes());
  std::vector<int64_t> flipped;
  for (int64_t i = 0; i < batch.size(); ++i) {
    if (counterBits(batch.noiseSeeds[static_cast<size_t>(i)], kFlipStream) & 1U) flipped.push_back(i);
  }
  if (flipped.empty()) return;
  const at::Tensor rows = at::tensor(flipped, at::kLong);
  batch.inputs = batch.inputs.clone();
  batch.inputs.index_copy_(0, rows, batch.inputs.index_select(0, rows).flip({3}));
}

BatchLoader::BatchLoader(const Dataset& data, const DistributedSampler& sampler, int rank, int worldSize,
                         int64_t runSeed, bool hflip)
    : BatchLoader(data, sampler, sampler.positionsOf(rank, worldSize), runSeed, hflip) {}

BatchLoader::BatchLoader(const Dataset& data, const DistributedSampler& sampler, std::pair<int64_t, int64_t> positions,
                         int64_t runSeed, bool hflip)
    : data_(data), sampler_(sampler), begin_(positions.first), end_(positions.second), runSeed_(runSeed), hflip_(hflip) {}

BatchLoader::~BatchLoader() {
  if (pending_.valid()) pending_.wait();
}

StepBatch BatchLoader::prepare(int64_t step) const {
  StepBatch out;
  out.indices = sampler_.indicesOfRange(step, begin_, end_);
  out.batch = data_.trainBatch(out.indices);
  seedNoise(out.batch, runSeed_, step, out.indices);
  if (hflip_) flipHalfHorizontally(out.batch);
  return out;
}

void BatchLoader::startPrefetch(int64_t step) {
  pendingStep_ = step;
  pending_ = std::async(std::launch::async, [this, step] {
    trace::nameThisThread("data loader");
    const trace::Span span("data", strCat("prepare the batch of step ", step + 1));
    return prepare(step);
  });
}

StepBatch BatchLoader::take(int64_t step) {
  const trace::Span span("data", "data wait");
  const auto start = std::chrono::steady_clock::now();
  StepBatch out;
  if (pending_.valid() && pendingStep_ == step) {
    TESSERA_CHECK(pending_.wait_for(std::chrono::seconds(kTimeoutSeconds)) == std::future_status::ready,
                  "data: the batch of step ", step, " was not ready after ", kTimeoutSeconds,
                  " s (is data.path on a stalled file system?)");
    out = pending_.get();
  } else {
    if (pending_.valid()) pending_.wait();  // a batch for another step (the run jumped): dropped
    pending_ = {};
    out = prepare(step);
  }
  waited_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  startPrefetch(step + 1);
  return out;
}

double BatchLoader::takeWaitSeconds() {
  const double w = waited_;
  waited_ = 0;
  return w;
}

}  // namespace tessera::datasets
