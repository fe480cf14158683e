// Byte-level text dataset and the deterministic distributed sampler over it.
//
// Sample i of a file of bytes b is (b[i .. i+context), b[i+context]): a context window
// and the next byte to predict. The last `eval_fraction` of the file is held out.
// Sampling is defined on the global batch, so a run resumes at the same sample on any
// world size: optimizer step s of epoch e reads global batch rows
// perm_e[(s mod S)*G .. +G) where perm_e is a permutation seeded by (seed, e), S the
// steps per epoch and G the global batch; rank r takes rows [r*G/W, (r+1)*G/W).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tessera::trainer {

class TextDataset {
 public:
  // Reads `path` as bytes; throws tessera::Error naming the file if unreadable or too
  // short for `context` + 1 bytes in both the train and the held-out split.
  TextDataset(const std::string& path, int64_t context, double evalFraction);

  int64_t trainSamples() const { return trainEnd_ - context_; }
  int64_t evalSamples() const { return static_cast<int64_t>(bytes_.size()) - trainEnd_ - context_; }
  int64_t context() const { return context_; }
  const std::string& path() const { return path_; }

  // Token ids [n, context] (int64) and targets [n] for train samples `indices`.
  std::pair<at::Tensor, at::Tensor> trainBatch(const std::vector<int64_t>& indices) const;
  // Held-out samples [first, first + n).
  std::pair<at::Tensor, at::Tensor> evalBatch(int64_t first, int64_t n) const;

 private:
  std::pair<at::Tensor, at::Tensor> gather(const std::vector<int64_t>& starts) const;
  std::string path_;
  std::vector<uint8_t> bytes_;
  int64_t context_;
  int64_t trainEnd_;  // bytes [0, trainEnd_) are the train split
};

// Which samples each rank reads at each optimizer step.
class DistributedSampler {
 public:
  DistributedSampler(int64_t numSamples, int64_t globalBatch, int64_t seed, bool shuffle);

  int64_t stepsPerEpoch() const { return stepsPerEpoch_; }
  // Sample indices of global batch `step` (0-based optimizer step) for rank `rank`
  // of `worldSize`; globalBatch must be divisible by worldSize.
  std::vector<int64_t> indicesFor(int64_t step, int rank, int worldSize) const;

 private:
  const std::vector<int64_t>& permutation(int64_t epoch) const;
  int64_t numSamples_, globalBatch_, seed_;
  bool shuffle_;
  int64_t stepsPerEpoch_;
  mutable int64_t cachedEpoch_ = -1;
  mutable std::vector<int64_t> cachedPerm_;
};

}  // namespace tessera::trainer
