// The caching host allocator (see host_allocator.h).
#include "sharding/host_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <torch/version.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace tessera::sharding {
namespace {

constexpr size_t kPage = 4096;

class CachingHostAllocator;
CachingHostAllocator* gAllocator = nullptr;  // lives until the process ends, as its blocks do

// LibTorch's raw allocation protocol (raw_allocate / raw_deallocate, used by some CPU
// kernels) needs a DataPtr whose context is the pointer itself, so the sizes of the
// blocks in use live in a table here rather than in the context.
class CachingHostAllocator final : public c10::Allocator {
 public:
  CachingHostAllocator(c10::Allocator* previous, HostCacheOptions options) : previous_(previous), options_(options) {}

  // c10::Allocator::allocate is const in LibTorch 1.x and not in 2.x: the const one here
  // overrides the first, the forwarder the second (no `override`, so both compile).
  c10::DataPtr allocate(size_t bytes) { return static_cast<const CachingHostAllocator*>(this)->allocate(bytes); }
  c10::DataPtr allocate(size_t bytes) const {
    if (bytes < options_.minBytes) return previous_->allocate(bytes);
    const size_t size = (bytes + kPage - 1) / kPage * kPage;
    std::lock_guard<std::mutex> lock(mutex_);
    // The smallest cached block that fits, if it is at most 1/8 larger: buffers of nearly
    // one size (a unit's weight and its padded flat buffer) share blocks, and no large
    // block is spent on a small request.
    void* ptr = nullptr;
    size_t blockSize = size;
    auto it = free_.lower_bound(size);
    if (it != free_.end() && it->first <= size + size / 8) {
      blockSize = it->first;
      ptr = it->second.back().ptr;  // the most recently freed of that size
      it->second.pop_back();
      if (it->second.empty()) free_.erase(it);
      cached_ -= blockSize;
    } else {
      // A miss. Mapped memory may grow up to the largest amount ever in use at once (the
      // step's peak) plus one largest block: beyond that, cached blocks of other sizes are
      // given back first, the least recently freed first (blocks a step no longer uses
      // before those it uses every step), so unused memory is never kept beside a new
      // block. Without the slack and that order, a step whose sizes change over its
      // course (zero3 gathers 16 MiB units, then reduces 4 MiB chunks, then gathers
      // again) unmapped blocks and faulted them in again every step: many times the page
      // faults, and a much slower step (docs/benchmarks.md, "Memory").
      const size_t limit = std::max(peakInUse_ + std::max(largestBlock_, size), inUse_ + size);
      while (mapped_ + size > limit && !free_.empty()) {
        auto oldest = free_.begin();
        for (auto candidate = free_.begin(); candidate != free_.end(); ++candidate) {
          if (candidate->second.front().freedAt < oldest->second.front().freedAt) oldest = candidate;
        }
        ::munmap(oldest->second.front().ptr, oldest->first);
        cached_ -= oldest->first;
        mapped_ -= oldest->first;
        oldest->second.erase(oldest->second.begin());
        if (oldest->second.empty()) free_.erase(oldest);
      }
      ptr = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      TORCH_CHECK(ptr != MAP_FAILED, "CachingHostAllocator: cannot map ", size, " bytes: ", std::strerror(errno));
      mapped_ += size;
      peakMapped_ = std::max(peakMapped_, mapped_);
      windowPeakMapped_ = std::max(windowPeakMapped_, mapped_);
      ++mappings_;
      largestBlock_ = std::max(largestBlock_, size);
    }
    blocks_[ptr] = blockSize;
    inUse_ += blockSize;
    peakInUse_ = std::max(peakInUse_, inUse_);
    windowPeakInUse_ = std::max(windowPeakInUse_, inUse_);
    return c10::DataPtr(ptr, ptr, &CachingHostAllocator::release, c10::Device(c10::kCPU));
  }

  c10::DeleterFnPtr raw_deleter() const override { return &CachingHostAllocator::release; }
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
#endif

  HostCacheStats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return {static_cast<int64_t>(cached_),       static_cast<int64_t>(mapped_),
            static_cast<int64_t>(inUse_),        static_cast<int64_t>(peakInUse_),
            static_cast<int64_t>(largestBlock_), static_cast<int64_t>(mappings_),
            static_cast<int64_t>(peakMapped_),   static_cast<int64_t>(windowPeakInUse_),
            static_cast<int64_t>(windowPeakMapped_)};
  }

  void resetWindow() {
    std::lock_guard<std::mutex> lock(mutex_);
    windowPeakInUse_ = inUse_;
    windowPeakMapped_ = mapped_;
  }

 private:
  // A block of ours goes back to the cache (or is unmapped past maxCachedBytes); anything
  // else came from the previous allocator (a small block, through raw_deallocate).
  static void release(void* ptr) {
    CachingHostAllocator& self = *gAllocator;
    size_t size = 0;
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      auto it = self.blocks_.find(ptr);
      if (it != self.blocks_.end()) {
        size = it->second;
        self.blocks_.erase(it);
        self.inUse_ -= size;
        if (self.cached_ + size <= self.options_.maxCachedBytes) {
          self.free_[size].push_back({ptr, ++self.frees_});
          self.cached_ += size;
          return;
        }
        self.mapped_ -= size;
      }
    }
    if (size == 0) {
      self.previous_->raw_deleter()(ptr);
      return;
    }
    ::munmap(ptr, size);
  }

  c10::Allocator* previous_;
  HostCacheOptions options_;
  mutable std::mutex mutex_;
  struct CachedBlock {
    void* ptr;
    uint64_t freedAt;  // this allocator's count of frees when it was freed
  };
  mutable std::map<size_t, std::vector<CachedBlock>> free_;  // by size, oldest first
  mutable uint64_t frees_ = 0;
  mutable std::unordered_map<void*, size_t> blocks_;  // in use, by pointer
  mutable size_t inUse_ = 0, peakInUse_ = 0;
  mutable size_t cached_ = 0;
  mutable size_t mapped_ = 0;
  mutable size_t largestBlock_ = 0;  // the largest request so far: the slack above the peak
  mutable size_t mappings_ = 0;
  mutable size_t peakMapped_ = 0;
  mutable size_t windowPeakInUse_ = 0, windowPeakMapped_ = 0;
};

// Blocks below minBytes stay with glibc's malloc, told to keep freed memory for reuse
// (up to 32 MiB blocks in its heap, 256 MiB of free heap top) rather than giving it back and
// faulting it in again at the next step, which makes the main job, whose buffers are all
// small, markedly faster (docs/benchmarks.md, "Training throughput"). Not when the user
// set malloc tunables, nor on other C libraries.
void keepSmallBlocksInTheHeap() {
#if defined(__GLIBC__)
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"}) {
    if (std::getenv(name)) return;
  }
  // Both together: setting either alone turns off glibc's dynamic mmap threshold, which
  // then stays at 128 KiB and makes things slower, not faster.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest allowed value on 64-bit
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
#endif
}

}  // namespace

void useCachingHostAllocator(const HostCacheOptions& options) {
  // TESSERA_HOST_ALLOCATOR=torch: LibTorch's own allocator and glibc's malloc as they are,
  // as a PyTorch program has them (a benchmark's like-for-like side; docs/environment.md).
  if (const char* which = std::getenv("TESSERA_HOST_ALLOCATOR"); which != nullptr && std::string(which) == "torch") return;
  static std::once_flag once;
  std::call_once(once, [&] {
    keepSmallBlocksInTheHeap();
    gAllocator = new CachingHostAllocator(c10::GetCPUAllocator(), options);
    c10::SetCPUAllocator(gAllocator, /*priority=*/1);
  });
}

HostCacheStats hostCacheStats() { return gAllocator != nullptr ? gAllocator->stats() : HostCacheStats{}; }

void resetHostCacheWindow() {
  if (gAllocator != nullptr) gAllocator->resetWindow();
}

}  // namespace tessera::sharding
