// Library-internal: the EMA's fused GPU kernel (ema_blend_cuda.cu), compiled only in
// CUDA builds (TESSERA_EMA_CUDA_KERNEL). Plain types only, so nvcc never sees LibTorch.
#pragma once

#include <cstdint>
#include <string>

namespace tessera::ema::cuda {

// Elements per segment: a multiple of 4, so splitting a 16-byte aligned tensor keeps
// every segment aligned.
constexpr int64_t kEmaSegmentElements = 16384;

struct BlendSegment {
  float* ema;
  const float* live;
  int64_t n;
};

// Launches e = decay*e + weight*p over `count` segments whose table lives in device
// memory, on `stream` (a cudaStream_t). Returns the launch error's text, "" on success.
std::string blendSegments(const BlendSegment* deviceSegments, int64_t count, float decay, float weight, void* stream);

}  // namespace tessera::ema::cuda
