// Where a rank's host memory goes, at its peak in a window (a metrics window; startMemoryWindow
// begins the next): each model's state (parameters,
// gradients, optimizer state, buffers, EMA: their storages, measured), zero3's gathered
// units at their peak, the rest of the host allocator's peak in use (activations and
// temporaries, the data), the allocator's cached slack above that peak, malloc's heap
// (glibc's own count: tensors under the allocator's 1 MiB threshold, gloo's buffers, every
// other allocation), and the runtime (what the process held besides both before its first
// step: libraries' pages, LibTorch's, thread stacks). Each comes from its own accounting;
// their sum is set beside the kernel's peak resident set size (VmHWM): a gap is memory
// none of them accounts for, or parts that peaked at different times.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tessera::trainer {

struct RunParts;

struct MemoryBreakdown {
  int64_t runtime = 0, params = 0, grads = 0, optimizer = 0, buffers = 0, ema = 0, gathered = 0;
  int64_t mallocHeap = 0;   // glibc malloc's arenas and mapped chunks, now
  int64_t activations = 0;  // the allocator's peak in use beyond the state and the gathered units
  int64_t slack = 0;        // the allocator's peak mapped beyond its peak in use
  int64_t peakRss = 0;      // VmHWM
  int64_t total() const {
    return runtime + mallocHeap + params + grads + optimizer + buffers + ema + gathered + activations + slack;
  }
  // metrics.jsonl names, in MiB: mem_params_mib, ..., mem_total_mib, mem_peak_rss_mib.
  std::vector<std::pair<std::string, double>> metrics() const;
  // "params 12.0 MiB, grads ..., total 812.3 MiB of a peak RSS of 830.1 MiB".
  std::string str() const;
};

// What this process holds besides the host allocator and malloc's heap now (resident set
// size minus both): the runtime part of a breakdown, taken before the first step.
int64_t runtimeBytes();

// A field of /proc/self/status in bytes ("VmRSS", "VmHWM"); 0 where it cannot be read.
int64_t procStatusBytes(const char* field);

// This rank's breakdown of the window so far (host memory: a CPU run's; a CUDA run's state
// is on the GPU).
MemoryBreakdown measureMemory(const RunParts& run, int64_t runtimeBytes);
// Starts the next window: the kernel's peak RSS (VmHWM, through /proc/self/clear_refs), the
// host allocator's window peaks and zero3's gathered peak restart from now.
void startMemoryWindow(const RunParts& run);

}  // namespace tessera::trainer
