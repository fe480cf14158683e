// Counts the threads of one at::parallel_for (see cpu_threads.h).
#include "kernels/cpu_threads.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>

namespace tessera::kernels {

int parallelLoopThreads() {
  const int64_t threads = at::get_num_threads();
  // One element per thread at grain 1: each thread of the region gets one chunk.
  std::atomic<int> ran{0};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) { ran.fetch_add(1); });
  return ran.load();
}

}  // namespace tessera::kernels
