// Reused host staging buffers for checkpoint saves (see staging_buffers.h).
#include "checkpoint/staging_buffers.h"

namespace tessera::checkpoint {

at::Tensor StagingBuffers::bufferFor(size_t slot, const at::Tensor& source) {
  if (slot >= slots_.size()) slots_.resize(slot + 1);
  Slot& s = slots_[slot];
  const bool pinned = source.is_cuda();
  const int64_t need = source.numel() * static_cast<int64_t>(source.element_size());
  if (!s.bytes.defined() || s.bytes.numel() < need || s.pinned != pinned) {
    s.bytes = at::Tensor();  // free the old buffer before allocating its replacement
    s.bytes = at::empty({need}, at::TensorOptions().dtype(at::kByte).pinned_memory(pinned));
    s.pinned = pinned;
    allocated_ += need;
  }
  // Offset 0 of the buffer: aligned for any dtype.
  return s.bytes.narrow(0, 0, need).view(source.scalar_type()).view(source.sizes());
}

int64_t StagingBuffers::takeAllocatedBytes() {
  const int64_t out = allocated_;
  allocated_ = 0;
  return out;
}

}  // namespace tessera::checkpoint
