// The shm backend: Communicator for ranks on one host, through one shared-memory segment
// (POSIX shm in /dev/shm) instead of sockets.
//
// Why: on one host gloo's TCP loopback costs 0.2-1 ms per collective however small
// (docs/benchmarks.md, "Training throughput"), which is the whole step of a small model. Here
// an operation is two copies through memory and two waits on an atomic counter: ranks
// sleep on a futex, so a waiting rank leaves its core to the peer it waits for.
//
// Layout: a header with each rank's progress counters, then one slot of
// ShmOptions::slotBytes per rank. An operation runs in pieces that fit a slot; for each
// piece every rank (1) waits until every rank has finished reading the previous piece,
// (2) copies its part into its own slot and publishes the piece number, (3) waits until
// every rank has published, (4) reads what it needs from the slots (reductions add the
// slots in rank order, so every rank computes the same bits, run to run), and (5)
// publishes that it has read. Operations run in issue order on one worker thread per
// communicator (as gloo's do), so ranks may interleave operations of different groups
// in different orders; a wait() on an operation not yet started runs it on the waiting
// thread instead (no hand-off for the synchronous forms).
//
// Failures: every wait has the operation's timeout, counted from when the operation starts
// (TimeoutError naming the ranks that did not arrive; a wait() on an operation queued
// behind others also waits for those, each bounded by its own timeout); a peer that exits
// or gives up is noticed within 50 ms (PeerLostError naming its rank), as is this process's
// abortCommunicators(). Creation checks that every
// rank can open the segment and see the others' processes; when one cannot (ranks in
// different containers, a full /dev/shm), every rank throws the same Error, so callers can
// fall back to gloo together (Runtime does for run.backend auto; split() does for its
// subgroups). CPU tensors only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "distributed/communicator.h"
#include "distributed/store.h"

namespace tessera::distributed {

struct ShmOptions {
  CommOptions comm;
  // Bytes of each rank's slot; larger operations run in pieces (the segment is world x
  // slotBytes, reserved in /dev/shm at creation).
  int64_t slotBytes = int64_t{4} << 20;
  // Start of the segment's name in /dev/shm (rank 0's pid and a random number follow); it
  // is unlinked as soon as every rank has opened it.
  std::string namePrefix = "/tessera-";
};

// Creates the shm group named options.comm.name over `store` (used only to agree on the
// segment); every rank of the group calls it with the same name, world and slotBytes.
std::shared_ptr<Communicator> makeShmCommunicator(std::shared_ptr<Store> store, int rank, int world,
                                                  const ShmOptions& options = {});

}  // namespace tessera::distributed
