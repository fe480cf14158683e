// The CPU counterpart of CUDA's caching allocator, for training processes: large host
// blocks freed by LibTorch are kept and handed out again to the next request they fit
// (the smallest cached block at most 1/8 larger than the page-rounded request) instead
// of going back to the kernel.
//
// Why: a training step allocates the same large buffers every step (zero3 regrows each
// unit's parameters, gathers into flat buffers, reduces gradients through more), and
// fresh pages cost a page fault each: with glibc's defaults a 67M-parameter zero3 step ran
// 2.7x slower than with freed memory kept. Keeping it in glibc's heap instead (raised
// mmap/trim thresholds) fragments: blocks of one size are split for another and stay
// resident, measured at 2.6x the ZeRO-3 memory formula on 8 ranks. Reuse of nearly the
// same size keeps only what the step uses again.
//
// Blocks below minBytes go to the allocator that was there before (glibc's malloc, told
// to keep freed memory in its heap: small blocks fragment little and fault often); larger
// ones are mapped with mmap. Mapped memory grows only up to the most ever in use at once
// plus one largest block (the slack that lets a step whose sizes change over its course
// keep its blocks): on a miss beyond that, cached blocks of other sizes are unmapped
// first; and no more than maxCachedBytes sit unused.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tessera::sharding {

struct HostCacheOptions {
  size_t minBytes = size_t{1} << 20;       // smaller blocks: the previous allocator (malloc)
  size_t maxCachedBytes = size_t{4} << 30;  // unused bytes kept at most
};

// Makes the caching allocator LibTorch's CPU allocator for the rest of the process (call
// once, at start-up, before tensors are made; later calls do nothing). Nothing at all when
// TESSERA_HOST_ALLOCATOR=torch (a benchmark's like-for-like side).
void useCachingHostAllocator(const HostCacheOptions& options = {});

// This process's caching allocator, in bytes (all zero before useCachingHostAllocator):
// held unused in the cache now, mapped in all (in use + cached), in use, most in use.
struct HostCacheStats {
  int64_t cachedBytes = 0;
  int64_t mappedBytes = 0;
  int64_t inUseBytes = 0;      // blocks of this allocator in use now
  int64_t peakInUseBytes = 0;  // the most ever in use at once
  int64_t largestBlockBytes = 0;  // the largest block ever mapped: the slack above the peak
  int64_t mappings = 0;           // blocks mapped so far (each one's pages fault in anew)
  int64_t peakMappedBytes = 0;    // the most ever mapped at once
  // The most in use and mapped at once since resetHostCacheWindow() (or the start).
  int64_t windowPeakInUseBytes = 0;
  int64_t windowPeakMappedBytes = 0;
};
HostCacheStats hostCacheStats();
// Starts a new window for the window peaks (a metrics window's breakdown): they restart
// from what is in use and mapped now. The allocator's own policy keeps the run's peaks.
void resetHostCacheWindow();

}  // namespace tessera::sharding
