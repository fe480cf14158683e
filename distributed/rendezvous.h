// Rendezvous: the ranks of a job find each other through one key-value store.
//
// rank 0 hosts a c10d TCPStore on MASTER_PORT (all interfaces), every other rank connects
// to MASTER_ADDR:MASTER_PORT; under torchrun's static rendezvous
// (TORCHELASTIC_USE_AGENT_STORE=True) the agent already hosts it and every rank connects,
// under the key prefix "/worker/attempt_<restart>" as PyTorch does. Then each rank
// announces itself and waits for all others, so that a rank that never arrives is
// reported by name within the timeout instead of hanging the job in its first collective.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "distributed/rank_env.h"
#include "distributed/store.h"

namespace tessera::distributed {

struct RendezvousOptions {
  // How long every rank waits for the store host and then for all ranks to arrive.
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
  // Store key namespace of the arrival keys (one rendezvous per key per store).
  std::string key = "tessera/rendezvous";
};

// Creates (rank 0) or connects to (others) the job's store as `env` says and waits for
// all env.world_size ranks. A world of one gets an in-process store (no port is bound).
// Throws TimeoutError "rendezvous: waited 5 s for ranks [2, 3] of 4 at tcp
// 127.0.0.1:29500" when ranks are missing, or naming rank 0 when no store host answers.
std::shared_ptr<Store> rendezvous(const RankEnv& env, const RendezvousOptions& options = {});

// Announces `rank` under `key` in `store` and blocks until all `world` ranks have, polling
// the store. Every rank must call it with the same key and world. Throws TimeoutError
// naming the ranks that did not arrive within `timeout`, the world size and the store.
// `whileWaiting`, when given, runs between polls: what it throws ends the wait (a
// communicator's build abandoned by abortCommunicators()).
void waitForRanks(Store& store, const std::string& key, int rank, int world, std::chrono::milliseconds timeout,
                  const std::function<void()>& whileWaiting = {});

}  // namespace tessera::distributed
