// The EMA update on the GPU: e = d*e + (1-d)*p over every fp32 parameter shard in ONE
// kernel launch. The update is bound by memory bandwidth (read e, read p, write e);
// torch's foreach lerp reached 0.55x of a device-to-device copy on an H100 over 1B
// parameters (bench/ema_bench --device cuda), this kernel's 16-byte loads and stores
// are meant to run at copy speed.
//
// The host passes a table of segments (ema pointer, live pointer, length): every tensor
// split into pieces of kEmaSegmentElements, one thread block per piece.
#include "ema/ema_blend_cuda.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace tessera::ema::cuda {
namespace {

__global__ void blendSegmentsKernel(const BlendSegment* segments, float d, float w) {
  const BlendSegment s = segments[blockIdx.x];
  const bool aligned = ((reinterpret_cast<uintptr_t>(s.ema) | reinterpret_cast<uintptr_t>(s.live)) & 15u) == 0;
  int64_t done = 0;
  if (aligned) {
    const int64_t n4 = s.n / 4;
    float4* e4 = reinterpret_cast<float4*>(s.ema);
    const float4* p4 = reinterpret_cast<const float4*>(s.live);
    for (int64_t i = threadIdx.x; i < n4; i += blockDim.x) {
      float4 e = e4[i];
      const float4 p = p4[i];
      e.x = d * e.x + w * p.x;
      e.y = d * e.y + w * p.y;
      e.z = d * e.z + w * p.z;
      e.w = d * e.w + w * p.w;
      e4[i] = e;
    }
    done = n4 * 4;
  }
  for (int64_t i = done + threadIdx.x; i < s.n; i += blockDim.x) s.ema[i] = d * s.ema[i] + w * s.live[i];
}

}  // namespace

std::string blendSegments(const BlendSegment* deviceSegments, int64_t count, float decay, float weight,
                          void* stream) {
  if (count == 0) return {};
  constexpr int kThreads = 256;
  blendSegmentsKernel<<<static_cast<unsigned>(count), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      deviceSegments, decay, weight);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
}

}  // namespace tessera::ema::cuda
