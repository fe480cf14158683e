// What the trainer reads: the Dataset interface shared by the token datasets
// (text_dataset.h) and the tensor dataset (tensor_dataset.h), the Batch it hands out, and
// the DataSpec from which the model is sized.
//
// Sample indices are global (the same sample has the same index at every world size);
// DistributedSampler (text_dataset.h) turns an optimizer step into each rank's indices.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/errors.h"

namespace tessera::datasets {

struct DataOptions;

// More classes than this in any dataset's labels is taken for a corrupt file.
inline constexpr int64_t kMaxClasses = int64_t{1} << 20;

struct Batch {
  at::Tensor inputs;   // [n, ...]: token ids (int64) or float32 features
  at::Tensor targets;  // [n] or [n, ...]: token ids or class ids (int64), float32 values; undefined when none
  // One seed per sample for the randomness a model's loss draws (a diffusion model's noise
  // and timestep). The trainer derives it from (run.seed, step, sample index), so the draws
  // do not depend on the world size or the micro-batching; models without noise ignore it.
  std::vector<uint64_t> noiseSeeds;
  int64_t size() const { return inputs.size(0); }
};

// The shapes a model needs to be built for the data.
struct DataSpec {
  bool tokens = false;             // inputs are token ids (data.kind text / tokens)
  std::vector<int64_t> inputShape; // one sample's input shape ([context] for tokens)
  bool hasTargets = true;
  int64_t classes = 0;             // integer targets: the number of classes (largest id + 1); 0 for float targets
  std::vector<int64_t> targetShape;  // float targets: one sample's shape
};

// Samples a dataset could not read and passed over (data.on_error skip), and why the last one.
struct SkipCount {
  int64_t samples = 0;
  std::string last;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t trainSamples() const = 0;
  virtual int64_t evalSamples() const = 0;
  // Train samples `indices` (each in [0, trainSamples())); tessera::Error otherwise.
  // A streaming dataset (streams() true) takes stream positions instead: the sampler hands
  // it step * global_batch + row (SampleOrder::kStream) and it orders the samples itself.
  virtual Batch trainBatch(const std::vector<int64_t>& indices) const = 0;
  // Held-out samples [first, first + n).
  virtual Batch evalBatch(int64_t first, int64_t n) const = 0;
  virtual DataSpec spec() const = 0;
  virtual std::string describe() const = 0;  // one line for the log: file and sizes
  virtual bool streams() const { return false; }
  // What the sample order depends on beyond the config (a shard set's names and counts),
  // kept in checkpoints so that a resume can say when it changed; "" when nothing.
  virtual std::string fingerprint() const { return ""; }
  virtual SkipCount skipped() const { return {}; }
};

// The spec of token windows of `context` ids below `vocabSize`: targets are the next token
// of each window, or with `everyPosition` of every position ([context]).
DataSpec tokenWindowSpec(int64_t context, int64_t vocabSize, bool everyPosition);

// How a model reads token data (data.kind text, tokens): windows of `context` ids below
// `vocabSize`, with a target per position when `everyPosition` (models that predict every
// position), else the token after the window.
struct TokenWindows {
  int64_t context = 0;
  int64_t vocabSize = 0;
  bool everyPosition = false;
};

// A data file other than data.path that is missing or unusable, with the key that named
// it ("data.labels", "data.eval_path", "data.eval_labels"), so that the trainer reports
// it at that key's line. `configError`: the config's fault (the file is not there, or
// does not fit the other keys), not the file's (damaged, unreadable).
class DataFileError : public Error {
 public:
  DataFileError(std::string key, const std::string& message, bool configError)
      : Error(message), key_(std::move(key)), configError_(configError) {}
  const std::string& key() const { return key_; }
  bool configError() const { return configError_; }

 private:
  std::string key_;
  bool configError_;
};

// The dataset data.kind names (text, tokens, tensors, idx, image_folder, webdataset), read
// from data.path (and, for images, data.labels, data.eval_path and data.eval_labels: their
// errors are DataFileErrors naming the key); token data is cut into `windows`. `orderSeed`
// (run.seed) seeds a streaming dataset's order; the others ignore it.
std::unique_ptr<Dataset> makeDataset(const DataOptions& data, const TokenWindows& windows, int64_t orderSeed = 0);

// The seed of sample `index`'s randomness at optimizer step `step` (step -1: evaluation),
// mixed from the run seed with splitmix64 so that neighbouring indices and steps give
// unrelated streams.
uint64_t noiseSeed(int64_t runSeed, int64_t step, int64_t index);

// Sets batch.noiseSeeds to noiseSeed(runSeed, step, i) for each sample index i of the batch
// (global indices, never the rank or the micro-batch).
void seedNoise(Batch& batch, int64_t runSeed, int64_t step, const std::vector<int64_t>& indices);

}  // namespace tessera::datasets
