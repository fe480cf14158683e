// The gloo backend: Communicator over c10d's ProcessGroupGloo (host memory; CUDA tensors
// are staged through host copies, for ranks sharing a GPU and for the CPU group).
//
// LibTorch 1.13's Gloo group has no _allgather_base, no reduce_scatter and rejects AVG,
// and its allgather stages the whole output, so (gloo_communicator.cpp):
// - all-gather: small outputs as one all-to-all, large ones point to point straight into
//   the output's chunks;
// - reduce-scatter: small inputs as one all-to-all (rank r receives every rank's chunk r:
//   (N-1)/N of the input leaves each rank, as in a ring) and a local reduction in rank
//   order inside wait(); large ones point to point, two chunks of receive buffer at a time;
// - all-reduce: Gloo's allreduce, or for a range of sizes (GlooOptions::splitAllReduce*,
//   empty by default) the point-to-point reduce-scatter followed by the point-to-point
//   all-gather;
// - AVG = SUM, then a division in wait().
// Data-movement operations send raw bytes, so every dtype works (bool, bfloat16, ...);
// all-reduce of dtypes Gloo cannot reduce (bfloat16, int16) runs in float32 / int32.
// This is also the CPU group that GPU runs use for checkpoint and export traffic.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "distributed/communicator.h"
#include "distributed/store.h"

namespace tessera::distributed {

struct GlooOptions {
  CommOptions comm;
  // Address gloo's TCP transport binds to and advertises. "" = the interface named by
  // $GLOO_SOCKET_IFNAME when set, else the address this host name resolves to (c10d's
  // default). "127.0.0.1" when every rank runs on this machine (Runtime does this).
  std::string hostname = "";
  // c10d worker threads: how many asynchronous operations progress at once.
  int threads = 2;
  // Floating-point all-reduces of [splitAllReduceFromBytes, splitAllReduceBelowBytes) run
  // as a point-to-point reduce-scatter + all-gather instead of Gloo's allreduce. Empty by
  // default: in three runs of bench_allreduce_bench on loopback (docs/benchmarks.md) no
  // size was faster split in all of them, and Gloo's was faster for the 16-64 MiB
  // tensors (no_shard's 25 MiB buckets) at 2 ranks in every run.
  int64_t splitAllReduceFromBytes = 0;
  int64_t splitAllReduceBelowBytes = 0;
};

// Creates the gloo group named options.comm.name over `store`: waits for all `world`
// ranks (TimeoutError naming the missing ones), then connects every pair of ranks.
// Every rank of the group calls it with the same name and world.
std::shared_ptr<Communicator> makeGlooCommunicator(std::shared_ptr<Store> store, int rank, int world,
                                                   const GlooOptions& options = {});

}  // namespace tessera::distributed
