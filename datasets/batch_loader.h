// Prepares each step's training batch on its own thread while the previous step computes,
// as a DataLoader with workers and prefetching does: decoding images, gathering samples,
// seeding their noise and flipping them happen off the step's critical path. The time a
// step still waits for its batch is counted (metrics' data_wait_ms), so a reader can see
// whether data keeps up.
#pragma once

#include <cstdint>
#include <future>
#include <utility>
#include <vector>

#include "datasets/dataset.h"

namespace tessera::datasets {

class DistributedSampler;

// One rank's batch of one step, and the global sample indices it holds.
struct StepBatch {
  std::vector<int64_t> indices;
  Batch batch;
};

// Rows [begin, end) of `batch` (inputs, targets, noise seeds): one micro-batch.
Batch sliceBatch(const Batch& batch, int64_t begin, int64_t end);

// Flips the images [n, C, H, W] of `batch` horizontally, each with probability 1/2 from
// its noise seed (a stream of its own: the flip does not correlate with the noise), so the
// flips depend on the run seed, the step and the sample alone.
void flipHalfHorizontally(Batch& batch);

class BatchLoader {
 public:
  // `data` and `sampler` must outlive the loader; the loader is their only user during
  // training (the sampler caches its permutation).
  BatchLoader(const Dataset& data, const DistributedSampler& sampler, int rank, int worldSize, int64_t runSeed,
              bool hflip);
  // The samples of positions [begin, end) of every global batch (run.deterministic's ranges).
  BatchLoader(const Dataset& data, const DistributedSampler& sampler, std::pair<int64_t, int64_t> positions,
              int64_t runSeed, bool hflip);
  ~BatchLoader();  // waits for a batch in flight (its errors are dropped)
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  // This rank's batch of step `step` (prefetched when the previous call was for step - 1),
  // then starts on step + 1. Rethrows what preparing it threw; tessera::Error when it takes
  // longer than `kTimeout`.
  StepBatch take(int64_t step);
  // Seconds take() spent waiting since the last call (then reset).
  double takeWaitSeconds();

  static constexpr int kTimeoutSeconds = 600;

 private:
  StepBatch prepare(int64_t step) const;
  void startPrefetch(int64_t step);

  const Dataset& data_;
  const DistributedSampler& sampler_;
  int64_t begin_, end_;  // positions in the global batch
  int64_t runSeed_;
  bool hflip_;
  int64_t pendingStep_ = -1;
  std::future<StepBatch> pending_;
  double waited_ = 0;
};

}  // namespace tessera::datasets
