// The nccl backend: Communicator over NCCL called directly (CUDA tensors).
//
// Built only with TESSERA_WITH_CUDA (CUDA LibTorch + NCCL; distributed/nccl_*.cpp are
// excluded otherwise and makeCommunicator("nccl") then throws ConfigError).
//
// - The ncclUniqueId is created by the group's rank 0 and passed through the Store; the
//   communicator is initialised non-blocking (NCCL >= 2.14) and polled, so a rank that
//   never arrives gives TimeoutError, not a hang.
// - Three CUDA streams of its own: one for all-gathers, one for reduce-scatters (so an
//   FSDP prefetch all-gather and a gradient reduce-scatter overlap each other and
//   compute), one for everything else. Each operation first waits (cudaStreamWaitEvent)
//   for an event recorded on the caller's current stream, so it sees the inputs
//   compute produced; CommHandle::wait() makes the current stream wait for the
//   operation's completion event. The current stream is c10's current CUDA stream
//   when LibTorch has CUDA (TESSERA_TORCH_HAS_CUDA), else the legacy default stream.
// - By default wait() only orders streams, so the host runs ahead of the GPU (a step has
//   no device-wide synchronisation); a watchdog thread polls each operation's completion
//   and, past the timeout, aborts the communicator (in-flight kernels return) and marks
//   it broken, so the next call throws naming the operation. With blockingWait, wait()
//   also blocks the host until the operation is done, polling ncclCommGetAsyncError, and
//   throws TimeoutError (naming operation, rank and bytes) itself.
// - gatherToRoot is a group (ncclGroupStart/End) of ncclSend/ncclRecv; broadcast,
//   all-gather and gather move raw bytes (any dtype); reductions support float, double,
//   half, bfloat16, int8, uint8, int32, int64 (AVG via ncclAvg).
#pragma once

#include <memory>

#include "distributed/communicator.h"
#include "distributed/store.h"

namespace tessera::distributed {

struct NcclOptions {
  CommOptions comm;
  int device = -1;          // CUDA device of this rank; -1 = the current device
  bool blockingWait = false;  // see above
};

// Every rank of the group calls it with the same name and world. Throws TimeoutError when
// ranks are missing, tessera::Error for CUDA / NCCL failures.
std::shared_ptr<Communicator> makeNcclCommunicator(std::shared_ptr<Store> store, int rank, int world,
                                                   const NcclOptions& options = {});

}  // namespace tessera::distributed
