// A rank's memory breakdown (see memory_breakdown.h).
#include "trainer/memory_breakdown.h"

#include <malloc.h>

#include <algorithm>
#include <cstdio>

#include "common/errors.h"
#include "sharding/fully_shard.h"
#include "sharding/host_allocator.h"
#include "trainer/run_setup.h"

namespace tessera::trainer {

int64_t procStatusBytes(const char* field) {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  long long kib = 0;
  const std::string prefix = std::string(field) + ": %lld kB";
  while (std::fgets(line, sizeof(line), f)) {
    if (std::sscanf(line, prefix.c_str(), &kib) == 1) break;
  }
  std::fclose(f);
  return static_cast<int64_t>(kib) * 1024;
}

namespace {

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

// glibc's count of what malloc holds from the system: its arenas and its mapped chunks.
int64_t mallocHeapBytes() {
  const struct mallinfo2 info = ::mallinfo2();
  return static_cast<int64_t>(info.arena + info.hblkhd);
}

}  // namespace

std::vector<std::pair<std::string, double>> MemoryBreakdown::metrics() const {
  return {{"mem_runtime_mib", mib(runtime)},   {"mem_malloc_heap_mib", mib(mallocHeap)},
          {"mem_params_mib", mib(params)},
          {"mem_grads_mib", mib(grads)},       {"mem_optimizer_mib", mib(optimizer)},
          {"mem_buffers_mib", mib(buffers)},   {"mem_ema_mib", mib(ema)},
          {"mem_gathered_mib", mib(gathered)}, {"mem_activations_mib", mib(activations)},
          {"mem_slack_mib", mib(slack)},       {"mem_total_mib", mib(total())},
          {"mem_peak_rss_mib", mib(peakRss)}};
}

std::string MemoryBreakdown::str() const {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "runtime %.1f MiB, malloc heap %.1f, params %.1f, grads %.1f, optimizer %.1f, "
                "buffers %.1f, EMA %.1f, gathered units %.1f, activations and the rest %.1f, allocator slack %.1f: "
                "total %.1f MiB of a peak RSS of %.1f MiB",
                mib(runtime), mib(mallocHeap), mib(params), mib(grads), mib(optimizer), mib(buffers), mib(ema), mib(gathered),
                mib(activations), mib(slack), mib(total()), mib(peakRss));
  return buf;
}

int64_t runtimeBytes() {
  return std::max<int64_t>(0, procStatusBytes("VmRSS") - sharding::hostCacheStats().mappedBytes - mallocHeapBytes());
}

MemoryBreakdown measureMemory(const RunParts& run, int64_t runtimeBytes) {
  MemoryBreakdown out;
  out.runtime = runtimeBytes;
  out.mallocHeap = mallocHeapBytes();
  for (const ModelPart& part : run.models) {
    const sharding::ResidentBytes resident = part.strategy->residentBytes();
    out.params += resident.params;
    out.grads += resident.grads;
    out.optimizer += resident.optimizer;
    out.buffers += resident.buffers;
    if (part.ema) out.ema += part.ema->bytes();
    if (const auto* fsdp = dynamic_cast<const sharding::FullyShardStrategy*>(part.strategy.get())) {
      out.gathered += fsdp->peakUnshardedParamBytes();
    }
  }
  const sharding::HostCacheStats cache = sharding::hostCacheStats();
  const int64_t state = out.params + out.grads + out.optimizer + out.buffers + out.ema + out.gathered;
  out.activations = std::max<int64_t>(0, cache.windowPeakInUseBytes - state);
  out.slack = std::max<int64_t>(0, cache.windowPeakMappedBytes - std::max(cache.windowPeakInUseBytes, state));
  out.peakRss = procStatusBytes("VmHWM");
  return out;
}

void startMemoryWindow(const RunParts& run) {
  // "5" resets the peak resident set size to the current one (proc(5), clear_refs); a
  // kernel without it leaves VmHWM the run's peak, which the breakdown then undercounts.
  if (FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
    std::fputs("5", f);
    std::fclose(f);
  }
  sharding::resetHostCacheWindow();
  for (const ModelPart& part : run.models) {
    if (auto* fsdp = dynamic_cast<sharding::FullyShardStrategy*>(part.strategy.get())) fsdp->resetPeak();
  }
}

}  // namespace tessera::trainer
