// Next-token datasets and the deterministic distributed sampler over them.
//
// The file is a flat sequence of token ids t: bytes (data.kind text: any file, byte-level)
// or little-endian uint16 / uint32 ids (data.kind tokens, as GPT-2-style preprocessing
// writes them). Sample i is (t[i .. i+context), t[i+context]): a context window and the
// next token to predict. The last `eval_fraction` of the tokens is held out.
// Sampling is defined on the global batch, so a run resumes at the same sample on any
// world size: optimizer step s of epoch e reads global batch rows
// perm_e[(s mod S)*G .. +G) where perm_e is a permutation seeded by (seed, e), S the
// steps per epoch and G the global batch; rank r takes rows [r*G/W, (r+1)*G/W).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "datasets/dataset.h"

namespace tessera::datasets {

enum class TokenFormat { kBytes, kUint16, kUint32 };
// data.kind + data.token_dtype -> format: "text" -> bytes; "tokens" + "uint16"/"uint32".
// tessera::ConfigError otherwise.
TokenFormat parseTokenFormat(const std::string& kind, const std::string& tokenDtype);

class TextDataset : public Dataset {
 public:
  // Reads `path` in `format`; throws tessera::Error naming the file if it is unreadable,
  // not a whole number of tokens, holds an id >= vocabSize (when vocabSize > 0; the
  // error names the position), or is too short for `context` + 1 tokens in both the
  // train and the held-out split.
  // Batches hold token ids [n, context] (int64) and targets: the next token [n], or with
  // everyPosition the next token of every position [n, context] (the inputs shifted by
  // one, for decoders trained on every position).
  TextDataset(const std::string& path, int64_t context, double evalFraction, TokenFormat format = TokenFormat::kBytes,
              int64_t vocabSize = 0, bool everyPosition = false);

  int64_t trainSamples() const override { return trainEnd_ - context_; }
  int64_t evalSamples() const override { return static_cast<int64_t>(tokens_.size()) - trainEnd_ - context_; }
  int64_t tokens() const { return static_cast<int64_t>(tokens_.size()); }

  Batch trainBatch(const std::vector<int64_t>& indices) const override;
  Batch evalBatch(int64_t first, int64_t n) const override;
  DataSpec spec() const override;
  std::string describe() const override;

 private:
  Batch gather(const std::vector<int64_t>& starts) const;
  std::string path_;
  std::vector<uint32_t> tokens_;
  int64_t context_;
  int64_t trainEnd_;  // tokens [0, trainEnd_) are the train split
  int64_t vocabSize_;
  bool everyPosition_;
};

// How a step's global batch picks its samples: a seeded permutation per epoch, the file
// order, or stream positions step * global_batch + row for a dataset that orders itself
// (Dataset::streams(), webdataset.h).
enum class SampleOrder { kShuffled, kFileOrder, kStream };

// Which samples each rank reads at each optimizer step.
class DistributedSampler {
 public:
  DistributedSampler(int64_t numSamples, int64_t globalBatch, int64_t seed, SampleOrder order);
  DistributedSampler(int64_t numSamples, int64_t globalBatch, int64_t seed, bool shuffle)
      : DistributedSampler(numSamples, globalBatch, seed, shuffle ? SampleOrder::kShuffled : SampleOrder::kFileOrder) {}

  int64_t stepsPerEpoch() const { return stepsPerEpoch_; }
  // Sample indices of global batch `step` (0-based optimizer step) for rank `rank`
  // of `worldSize`; globalBatch must be divisible by worldSize.
  std::vector<int64_t> indicesFor(int64_t step, int rank, int worldSize) const;
  // Sample indices of positions [begin, end) of global batch `step` (a rank's micro-batches
  // under run.deterministic, which need not split evenly).
  std::vector<int64_t> indicesOfRange(int64_t step, int64_t begin, int64_t end) const;
  // Rank `rank`'s even share of every global batch, as positions [begin, end);
  // globalBatch must be divisible by worldSize.
  std::pair<int64_t, int64_t> positionsOf(int rank, int worldSize) const;

 private:
  const std::vector<int64_t>& permutation(int64_t epoch) const;
  int64_t numSamples_, globalBatch_, seed_;
  SampleOrder order_;
  int64_t stepsPerEpoch_;
  mutable int64_t cachedEpoch_ = -1;
  mutable std::vector<int64_t> cachedPerm_;
};

}  // namespace tessera::datasets
