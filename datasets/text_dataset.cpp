// Next-token datasets (bytes, uint16 / uint32 token files) and the deterministic
// distributed sampler (see text_dataset.h).
#include "datasets/text_dataset.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <random>

#include "common/errors.h"
#include "common/file_open.h"

namespace tessera::datasets {

TokenFormat parseTokenFormat(const std::string& kind, const std::string& tokenDtype) {
  if (kind == "text") return TokenFormat::kBytes;
  TESSERA_CHECK_AS(ConfigError, kind == "tokens", "data.kind: unknown dataset kind '", kind, "' (text, tokens, tensors)");
  if (tokenDtype == "uint16") return TokenFormat::kUint16;
  if (tokenDtype == "uint32") return TokenFormat::kUint32;
  throw ConfigError(strCat("data.token_dtype: unknown token dtype '", tokenDtype, "' (uint16, uint32)"));
}

namespace {

// Little-endian ids of `width` bytes each.
std::vector<uint32_t> decodeTokens(const std::string& path, const std::string& bytes, int width) {
  const auto* raw = reinterpret_cast<const uint8_t*>(bytes.data());
  if (width == 1) return std::vector<uint32_t>(raw, raw + bytes.size());
  TESSERA_CHECK(bytes.size() % static_cast<size_t>(width) == 0, "dataset '", path, "': ", bytes.size(),
                " bytes is not a whole number of uint", 8 * width, " tokens (", width, " bytes each)");
  std::vector<uint32_t> tokens(bytes.size() / static_cast<size_t>(width));
  for (size_t i = 0; i < tokens.size(); ++i) {
    uint32_t v = 0;
    for (int b = width - 1; b >= 0; --b) v = (v << 8) | raw[i * static_cast<size_t>(width) + static_cast<size_t>(b)];
    tokens[i] = v;
  }
  return tokens;
}

}  // namespace

TextDataset::TextDataset(const std::string& path, int64_t context, double evalFraction, TokenFormat format,
                         int64_t vocabSize, bool everyPosition)
    : path_(path), context_(context), vocabSize_(vocabSize), everyPosition_(everyPosition) {
  std::string raw;
  try {
    raw = readRegularFile(path, std::numeric_limits<int64_t>::max());
  } catch (const Error& e) {
    throw Error(strCat("dataset: cannot read data file: ", e.what()));
  }
  const int width = format == TokenFormat::kBytes ? 1 : format == TokenFormat::kUint16 ? 2 : 4;
  tokens_ = decodeTokens(path, raw, width);
  if (vocabSize > 0) {
    const auto bad = std::find_if(tokens_.begin(), tokens_.end(),
                                  [vocabSize](uint32_t t) { return static_cast<int64_t>(t) >= vocabSize; });
    TESSERA_CHECK(bad == tokens_.end(), "dataset '", path, "': token ", bad - tokens_.begin(), " is ",
                  bad == tokens_.end() ? 0 : *bad, ", not below model.vocab_size ", vocabSize);
  }
  TESSERA_CHECK(context >= 1, "dataset: context must be >= 1, got ", context);
  const auto size = static_cast<int64_t>(tokens_.size());
  trainEnd_ = size - static_cast<int64_t>(static_cast<double>(size) * evalFraction);
  TESSERA_CHECK(trainSamples() >= 1, "dataset '", path, "' has ", size, " tokens: too short for context ", context,
                " (train split ", trainEnd_, " tokens)");
  TESSERA_CHECK(evalFraction == 0.0 || evalSamples() >= 1, "dataset '", path, "': held-out split of ",
                size - trainEnd_, " tokens is too short for context ", context, " (raise data.eval_fraction)");
}

Batch TextDataset::gather(const std::vector<int64_t>& starts) const {
  const auto n = static_cast<int64_t>(starts.size());
  at::Tensor inputs = at::empty({n, context_}, at::kLong);
  at::Tensor targets = everyPosition_ ? at::empty({n, context_}, at::kLong) : at::empty({n}, at::kLong);
  auto* in = inputs.data_ptr<int64_t>();
  auto* tg = targets.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = starts[i];
    for (int64_t j = 0; j < context_; ++j) in[i * context_ + j] = tokens_[s + j];
    if (everyPosition_) {
      for (int64_t j = 0; j < context_; ++j) tg[i * context_ + j] = tokens_[s + j + 1];
    } else {
      tg[i] = tokens_[s + context_];
    }
  }
  return Batch{inputs, targets, {}};
}

Batch TextDataset::trainBatch(const std::vector<int64_t>& indices) const {
  for (int64_t i : indices) {
    TESSERA_CHECK(i >= 0 && i < trainSamples(), "TextDataset::trainBatch: sample ", i, " out of range [0, ",
                  trainSamples(), ")");
  }
  return gather(indices);
}

Batch TextDataset::evalBatch(int64_t first, int64_t n) const {
  TESSERA_CHECK(first >= 0 && n >= 0 && first + n <= evalSamples(), "TextDataset::evalBatch: [", first, ", ",
                first + n, ") out of range [0, ", evalSamples(), ")");
  std::vector<int64_t> starts(n);
  for (int64_t i = 0; i < n; ++i) starts[i] = trainEnd_ + first + i;
  return gather(starts);
}

DataSpec TextDataset::spec() const { return tokenWindowSpec(context_, vocabSize_, everyPosition_); }

std::string TextDataset::describe() const {
  return strCat(path_, ": ", tokens(), " tokens, ", trainSamples(), " train and ", std::max<int64_t>(evalSamples(), 0),
                " held-out windows of ", context_);
}

DistributedSampler::DistributedSampler(int64_t numSamples, int64_t globalBatch, int64_t seed, SampleOrder order)
    : numSamples_(numSamples), globalBatch_(globalBatch), seed_(seed), order_(order) {
  TESSERA_CHECK(globalBatch >= 1, "DistributedSampler: global batch ", globalBatch);
  TESSERA_CHECK(numSamples >= globalBatch, "DistributedSampler: ", numSamples,
                " samples are fewer than one global batch of ", globalBatch);
  stepsPerEpoch_ = numSamples / globalBatch;  // the incomplete last batch is dropped
}

const std::vector<int64_t>& DistributedSampler::permutation(int64_t epoch) const {
  if (epoch != cachedEpoch_) {
    cachedPerm_.resize(numSamples_);
    std::iota(cachedPerm_.begin(), cachedPerm_.end(), 0);
    if (order_ == SampleOrder::kShuffled) {
      // mt19937_64 and a hand-rolled Fisher-Yates: std::shuffle's algorithm is
      // implementation-defined, and the order must not change with the toolchain.
      std::mt19937_64 rng(static_cast<uint64_t>(seed_) * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(epoch));
      for (int64_t i = numSamples_ - 1; i > 0; --i) {
        const auto j = static_cast<int64_t>(rng() % static_cast<uint64_t>(i + 1));
        std::swap(cachedPerm_[i], cachedPerm_[j]);
      }
    }
    cachedEpoch_ = epoch;
  }
  return cachedPerm_;
}

std::pair<int64_t, int64_t> DistributedSampler::positionsOf(int rank, int worldSize) const {
  TESSERA_CHECK(worldSize >= 1 && rank >= 0 && rank < worldSize, "DistributedSampler: rank ", rank, " of ", worldSize);
  TESSERA_CHECK(globalBatch_ % worldSize == 0, "DistributedSampler: global batch ", globalBatch_,
                " is not divisible by world size ", worldSize);
  const int64_t perRank = globalBatch_ / worldSize;
  return {rank * perRank, (rank + 1) * perRank};
}

std::vector<int64_t> DistributedSampler::indicesFor(int64_t step, int rank, int worldSize) const {
  const auto [begin, end] = positionsOf(rank, worldSize);
  return indicesOfRange(step, begin, end);
}

std::vector<int64_t> DistributedSampler::indicesOfRange(int64_t step, int64_t begin, int64_t end) const {
  TESSERA_CHECK(step >= 0, "DistributedSampler: step ", step, " is negative");
  TESSERA_CHECK(0 <= begin && begin <= end && end <= globalBatch_, "DistributedSampler: positions [", begin, ", ", end,
                ") of a global batch of ", globalBatch_);
  if (order_ == SampleOrder::kStream) {  // the dataset maps positions to samples (and epochs) itself
    std::vector<int64_t> positions(static_cast<size_t>(end - begin));
    std::iota(positions.begin(), positions.end(), step * globalBatch_ + begin);
    return positions;
  }
  const int64_t epoch = step / stepsPerEpoch_;
  const int64_t first = (step % stepsPerEpoch_) * globalBatch_;
  const auto& perm = permutation(epoch);
  return std::vector<int64_t>(perm.begin() + first + begin, perm.begin() + first + end);
}

}  // namespace tessera::datasets
