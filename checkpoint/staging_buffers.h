// StagingBuffers: the host memory an async save (or a save of device tensors) copies the
// shards into, allocated by the first save and reused by every later one, so that the
// training stall of a save is one copy into memory that is already there (no allocation,
// no page faults). Pinned for CUDA sources, so the device-to-host copy runs at full
// speed. The price: the Checkpointer keeps one copy of the rank's saved state for its
// lifetime (docs/checkpoint.md, "Async saves").
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tessera::checkpoint {

class StagingBuffers {
 public:
  // A contiguous CPU tensor shaped like `source` (its dtype and sizes) to copy it into:
  // slot `slot`'s buffer from an earlier call when it is large enough and pinned alike,
  // a new one otherwise. The caller must be done with the previous contents.
  at::Tensor bufferFor(size_t slot, const at::Tensor& source);
  // Bytes allocated since the last takeAllocatedBytes() (0 when every slot was reused).
  int64_t takeAllocatedBytes();

 private:
  struct Slot {
    at::Tensor bytes;  // uint8, the slot's capacity
    bool pinned = false;
  };
  std::vector<Slot> slots_;
  int64_t allocated_ = 0;
};

}  // namespace tessera::checkpoint
