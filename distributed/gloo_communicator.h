// The gloo backend: Communicator over c10d's ProcessGroupGloo (host memory; CUDA tensors
// are staged through host copies, for ranks sharing a GPU and for the CPU group).
//
// LibTorch 1.13's Gloo group has no _allgather_base, no reduce_scatter and rejects AVG,
// so: all-gather = allgather into views of flat_out's chunks; reduce-scatter = one
// all-to-all (rank r receives every rank's chunk r: (N-1)/N of the input leaves each
// rank, as in a ring reduce-scatter, not the 2x of all-reduce + narrow) followed by a
// local reduction in rank order inside wait(); AVG = SUM, then a division in wait().
// Data-movement operations send raw bytes, so every dtype works (bool, bfloat16, ...);
// all-reduce of dtypes Gloo cannot reduce (bfloat16, int16) runs in float32 / int32.
// This is also the CPU group that GPU runs use for checkpoint and export traffic.
#pragma once

#include <chrono>
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
};

// Creates the gloo group named options.comm.name over `store`: waits for all `world`
// ranks (TimeoutError naming the missing ones), then connects every pair of ranks.
// Every rank of the group calls it with the same name and world.
std::shared_ptr<Communicator> makeGlooCommunicator(std::shared_ptr<Store> store, int rank, int world,
                                                   const GlooOptions& options = {});

}  // namespace tessera::distributed
