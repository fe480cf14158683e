// Runtime: one process's view of the distributed job, set up in one call from the rank
// environment: rendezvous (store), the main communicator, and a CPU communicator (shm or
// gloo) that is always there, also in GPU runs, for checkpoint and export traffic.
//
//   auto env = RankEnv::fromEnvironment();          // torchrun, tessera-run, srun, mpirun
//   auto runtime = Runtime::init(env);              // or: auto comm = initProcessGroup(env);
//   runtime->comm()->allReduce(t, ReduceOp::kAvg);
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "distributed/communicator.h"
#include "distributed/rank_env.h"
#include "distributed/store.h"

namespace tessera::distributed {

struct RuntimeOptions {
  // "gloo" (CPU tensors, TCP), "shm" (CPU tensors, every rank on this host, shared memory:
  // shm_communicator.h), "cpu" (shm when every rank is on this host — started by one
  // launcher, or by several on one machine: rank 0 compares host names and boot ids — and
  // the segment can be set up, else gloo, with a warning when shm was possible but failed), "nccl" (CUDA
  // tensors; needs a TESSERA_WITH_CUDA build), or "auto": nccl when this build has it and a
  // CUDA device is present, else "cpu".
  std::string backend = "gloo";
  // Store host + all ranks arriving; then each communicator's creation.
  std::chrono::milliseconds rendezvousTimeout = std::chrono::seconds(300);
  // Every collective.
  std::chrono::milliseconds commTimeout = std::chrono::seconds(300);
  // CommOptions::checkCollectives of every communicator.
  bool checkCollectives = false;
  // CommOptions::flightEntries of every communicator.
  int flightEntries = 2000;
  // CommOptions::lostWhenStoppedFor of every communicator (shm).
  std::chrono::milliseconds lostWhenStoppedFor{0};
};

class Runtime {
 public:
  // Rendezvous and communicator creation; every rank of env calls it. Throws TimeoutError
  // naming missing ranks, ConfigError for an unknown or unavailable backend.
  static std::shared_ptr<Runtime> init(const RankEnv& env, const RuntimeOptions& options = {});

  const std::shared_ptr<Store>& store() const { return store_; }
  // The backend's world communicator (options.backend).
  const std::shared_ptr<Communicator>& comm() const { return comm_; }
  // A CPU world communicator (shm or gloo): the same object as comm() unless the backend
  // is nccl, then comm()'s host twin (comm()->host(); its subgroups have theirs; gloo).
  const std::shared_ptr<Communicator>& cpuComm() const { return cpuComm_; }
  // Seconds from init() to all ranks past rendezvous and connected.
  double startupSeconds() const { return startupSeconds_; }

 private:
  Runtime() = default;
  RankEnv env_;
  std::shared_ptr<Store> store_;
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<Communicator> cpuComm_;
  double startupSeconds_ = 0;
};

// Runtime::init(env, options)->comm(): the world communicator (it keeps the store alive).
std::shared_ptr<Communicator> initProcessGroup(const RankEnv& env, const RuntimeOptions& options = {});

}  // namespace tessera::distributed
