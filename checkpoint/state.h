// The unit of sharded state the checkpointer saves and loads: a named local buffer and
// the ShardSpec that places it (ARCHITECTURE.md §1). Names are the caller's; the trainer
// uses "model/<param>", "optim/<state>/<param>", "ema/<ema name>/<param>" so exports can
// select a prefix and strip it back to the user's module names.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "sharding/shard_spec.h"

namespace tessera::checkpoint {

struct StateEntry {
  std::string name;
  // Layout of `local` on this rank. Placement::kReplicate: every rank holds the whole
  // tensor; only rank 0 writes it, every rank reads it.
  sharding::ShardSpec spec;
  // Shard(0): the padded local buffer (spec.paddedNumel() elements, rows past
  // spec.localRows() are padding). Replicate: the full tensor. dtype == spec.dtype().
  // CPU or CUDA; any shape with the right element count; contiguity not required.
  at::Tensor local;
};

// Throws tessera::Error naming the entry when local does not fit spec (element count,
// dtype) or the name is empty; `where` prefixes the message.
void checkEntry(const StateEntry& entry, const char* where);

}  // namespace tessera::checkpoint
