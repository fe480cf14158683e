// Coalesced collectives over lists of small tensors (initial parameters, BatchNorm
// buffers): tensors of one dtype are packed into flat buffers of at most `bucketBytes`
// and moved with one collective per buffer, instead of one per tensor (a model with
// hundreds of norm layers would otherwise pay hundreds of latencies per step).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "distributed/communicator.h"

namespace tessera::sharding {

// Every tensor becomes the root's value, in place (any dtype; defined, same shapes and
// dtypes in the same order on every rank). Collective over `comm`; nothing is sent in a
// world of one.
void broadcastCoalesced(const std::vector<at::Tensor>& tensors, distributed::Communicator& comm, int root,
                        int64_t bucketBytes);

// Every tensor becomes `op` over ranks of itself, in place (floating or integer dtypes
// the backend can reduce; kAvg floating only). Collective over `comm`.
void allReduceCoalesced(const std::vector<at::Tensor>& tensors, distributed::Communicator& comm,
                        distributed::ReduceOp op, int64_t bucketBytes);

}  // namespace tessera::sharding
