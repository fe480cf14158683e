// Bounds shared by every reader of sizes that come from outside the program (command
// lines, the rank environment, configs, checkpoints): one value per bound, so that what
// the launcher starts, a config accepts and a checkpoint may record agree.
#pragma once

#include <cstdint>

namespace tessera {

// The most ranks a run may have: what the launcher starts, what RANK/WORLD_SIZE may say,
// what a checkpoint's world_size and chunk ranks may record. Far beyond any cluster, small
// enough that a rank times any per-rank count stays far from overflow.
constexpr int64_t kMaxWorldSize = int64_t{1} << 20;

// The most ranks one tessera-run starts on its machine: each is a process.
constexpr int64_t kMaxLocalRanks = 1024;

// The most samples a run may count: steps x global batch (the data position), and every
// counter a checkpoint's trainer state records, stay below 2^53 (exact in a double, as
// JSON readers elsewhere hold numbers).
constexpr int64_t kMaxCounter = int64_t{1} << 53;

// Upper bounds of the sizes a config may ask for (model.*, data.*, run.steps). Far above
// any run this code can do, and low enough that the products the trainer forms from two
// of them (context x embed_dim, micro_batch x world size, bucket bytes) stay far from
// int64 overflow: a product that wrapped would pass a divisibility check, divide by zero
// or allocate a negative size.
constexpr double kMaxSteps = double(int64_t{1} << 40);
constexpr double kMaxVocab = double(int64_t{1} << 31);
constexpr double kMaxWidth = double(int64_t{1} << 24);
constexpr double kMaxLayers = 1 << 16;
constexpr double kMaxBatch = double(int64_t{1} << 31);

// Product of two non-negative counts, or -1 when it exceeds `limit` (or int64).
// For cross-field checks of sizes that came from outside: a product that wrapped would
// pass a divisibility check or divide by zero.
constexpr int64_t boundedProduct(int64_t a, int64_t b, int64_t limit) {
  int64_t out = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &out) || out > limit) return -1;
  return out;
}

}  // namespace tessera
