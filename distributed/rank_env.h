// The rank environment: who this process is in the job (rank, local rank, world size,
// node) and where the job's rendezvous store lives, read from the variables that the
// launcher set.
//
// Four sources, tried in this order (the first whose marker variable is present wins,
// so torchrun inside a SLURM allocation is read as torchrun):
//
//   torchrun / tessera-run   marker RANK or WORLD_SIZE
//     RANK, WORLD_SIZE                       required (both, or neither)
//     LOCAL_RANK, LOCAL_WORLD_SIZE           default RANK, WORLD_SIZE (one node)
//     GROUP_RANK                             default RANK / LOCAL_WORLD_SIZE
//     MASTER_ADDR, MASTER_PORT               required when WORLD_SIZE > 1
//                                            (default 127.0.0.1:29500 for one rank)
//     TORCHELASTIC_RESTART_COUNT, _MAX_RESTARTS   default 0
//     TORCHELASTIC_USE_AGENT_STORE           "True": torchrun's agent hosts the store at
//                                            MASTER_ADDR:MASTER_PORT (static rendezvous),
//                                            so rank 0 connects instead of hosting it
//   SLURM (srun)             marker SLURM_PROCID
//     SLURM_PROCID, SLURM_NTASKS             required
//     SLURM_LOCALID, SLURM_NODEID            default 0
//     local world size                       SLURM_NTASKS_PER_NODE, else this node's entry of
//                                            SLURM_TASKS_PER_NODE ("2(x3),1" = 2,2,2,1),
//                                            else SLURM_NTASKS (one node)
//     MASTER_ADDR                            if set; else the first host of
//                                            SLURM_JOB_NODELIST / SLURM_NODELIST
//                                            ("gpu[07-09,12]" -> gpu07); else an error
//     MASTER_PORT                            if set; else 20000 + SLURM_JOB_ID % 20000, so
//                                            two jobs sharing a node do not collide
//     SLURM_RESTART_COUNT                    restart count (requeues), default 0
//   OpenMPI (mpirun)         marker OMPI_COMM_WORLD_RANK
//     OMPI_COMM_WORLD_RANK, _SIZE            required
//     OMPI_COMM_WORLD_LOCAL_RANK, _LOCAL_SIZE   default 0 and _SIZE
//     OMPI_COMM_WORLD_NODE_RANK              default RANK / LOCAL_SIZE
//     MASTER_ADDR, MASTER_PORT               MASTER_ADDR required when ranks span nodes
//                                            (pass it with mpirun -x); default 127.0.0.1
//                                            on one node; MASTER_PORT default 29500
//   single                   none of the markers: rank 0 of 1 on 127.0.0.1:29500
//
// Every value is validated: a non-numeric value, a missing partner (RANK without
// WORLD_SIZE), a rank out of range (RANK >= WORLD_SIZE, LOCAL_RANK >= LOCAL_WORLD_SIZE)
// or a port outside 1..65535 throws tessera::ConfigError naming the variable and value.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>

namespace tessera::distributed {

struct RankEnv {
  int rank = 0;              // global rank, 0 <= rank < world_size
  int local_rank = 0;        // rank on this node, 0 <= local_rank < local_world_size
  int world_size = 1;
  int local_world_size = 1;  // ranks on this node
  int group_rank = 0;        // node rank (torchrun's GROUP_RANK)
  std::string master_addr = "127.0.0.1";  // host of the rendezvous store
  int master_port = 29500;
  int restart_count = 0;     // how many times the launcher restarted the ranks
  int max_restarts = 0;
  bool use_agent_store = false;  // torchrun's agent already hosts the store (see above)
  std::string source = "single";  // "torchrun" | "slurm" | "openmpi" | "single"

  // Returns nullopt when the variable is unset.
  using Lookup = std::function<std::optional<std::string>(const std::string&)>;

  // Reads the process environment (getenv).
  static RankEnv fromEnvironment();
  // Reads through `lookup`; the testable core of fromEnvironment().
  static RankEnv fromLookup(const Lookup& lookup);
  // Reads from a map of variable -> value (missing key = unset).
  static RankEnv fromMap(const std::map<std::string, std::string>& vars);

  // True when every rank runs on this node (loopback is then enough for transports).
  bool singleNode() const { return local_world_size == world_size; }

  // "rank 1/4 (local 1/2, node 0, torchrun, store 10.0.0.1:29500, restart 0/3)".
  std::string describe() const;
};

}  // namespace tessera::distributed
