// The exit-status contract shared by every Tessera program:
//   0 success; 2 bad input (ConfigError, UsageError); 1 any other failure.
// On failure the message is logged and, when torchrun (or tessera-run) set
// TORCHELASTIC_ERROR_FILE, written there in torchelastic's JSON format so the launcher
// can report the failing rank's own message.
#pragma once

#include <functional>
#include <string>

namespace tessera {

// Runs `body` and maps exceptions to exit statuses as above.
int runMain(const std::string& programName, const std::function<int()>& body);

// Host allocator policy for training processes (glibc): freed blocks up to 32 MiB stay
// in the heap for reuse and up to 256 MiB of free heap top is kept, instead of glibc's
// default of returning them to the kernel (munmap/trim) and page-faulting them in again
// at the next step, which zero3's free-after-use makes frequent: +19% samples/s on the
// CPU main job (docs/benchmarks.md). The memory stays reusable by the process, like the
// CUDA caching allocator's. Does nothing when the user set a malloc tunable
// (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, GLIBC_TUNABLES) or on non-glibc systems.
void keepFreedHostMemoryForReuse();

// Writes {"message": {"message": ..., "extraInfo": {...}}} to $TORCHELASTIC_ERROR_FILE
// (no-op when the variable is unset; never throws).
void writeErrorFile(const std::string& message);

}  // namespace tessera
