// Reads the rank environment of torchrun / tessera-run, SLURM and OpenMPI (see rank_env.h).
#include "distributed/rank_env.h"

#include <cerrno>
#include <cstdlib>
#include <limits>
#include <vector>

#include "common/errors.h"
#include "common/limits.h"

namespace tessera::distributed {
namespace {

constexpr int kDefaultPort = 29500;
constexpr const char* kLoopback = "127.0.0.1";

// Variable reader that remembers where each value came from, for error messages.
class Reader {
 public:
  explicit Reader(const RankEnv::Lookup& lookup) : lookup_(lookup) {}

  std::optional<std::string> raw(const std::string& name) const {
    auto value = lookup_(name);
    // An empty value is treated as unset (as `export RANK=` in a shell script would mean).
    if (value && value->empty()) return std::nullopt;
    return value;
  }

  bool has(const std::string& name) const { return raw(name).has_value(); }

  std::optional<int> integer(const std::string& name) const {
    auto value = raw(name);
    if (!value) return std::nullopt;
    return parse(name, *value);
  }

  int required(const std::string& name, const std::string& why) const {
    auto value = integer(name);
    if (!value) {
      throw ConfigError(strCat("RankEnv: ", name, " is not set (", why, ")"));
    }
    return *value;
  }

  static int parse(const std::string& name, const std::string& value) {
    const char* begin = value.c_str();
    char* end = nullptr;
    errno = 0;
    const long long parsed = std::strtoll(begin, &end, 10);
    if (end == begin || *end != '\0' || errno == ERANGE || parsed < std::numeric_limits<int>::min() ||
        parsed > std::numeric_limits<int>::max()) {
      throw ConfigError(strCat("RankEnv: ", name, "='", value, "' is not an integer"));
    }
    return static_cast<int>(parsed);
  }

 private:
  const RankEnv::Lookup& lookup_;
};

// The variable names a source uses, so that one validation routine names the right ones.
struct Names {
  std::string rank, world, localRank, localWorld, groupRank, restart;
};

void validate(const RankEnv& env, const Names& n) {
  if (env.world_size < 1 || env.world_size > kMaxWorldSize) {
    throw ConfigError(strCat("RankEnv: ", n.world, "='", env.world_size, "' must be in 1..", kMaxWorldSize));
  }
  if (env.rank < 0 || env.rank >= env.world_size) {
    throw ConfigError(strCat("RankEnv: ", n.rank, "='", env.rank, "' is out of range for ", n.world, "='",
                             env.world_size, "' (need 0 <= rank < world size)"));
  }
  if (env.local_world_size < 1 || env.local_world_size > env.world_size) {
    throw ConfigError(strCat("RankEnv: ", n.localWorld, "='", env.local_world_size, "' must be in 1..", n.world,
                             " (", env.world_size, ")"));
  }
  if (env.local_rank < 0 || env.local_rank >= env.local_world_size) {
    throw ConfigError(strCat("RankEnv: ", n.localRank, "='", env.local_rank, "' is out of range for ", n.localWorld,
                             "='", env.local_world_size, "' (need 0 <= local rank < local world size)"));
  }
  if (env.group_rank < 0 || env.group_rank >= env.world_size) {
    throw ConfigError(strCat("RankEnv: ", n.groupRank, "='", env.group_rank, "' is out of range for ", n.world, "='",
                             env.world_size, "' (need 0 <= node rank < world size)"));
  }
  if (env.restart_count < 0) {
    throw ConfigError(strCat("RankEnv: ", n.restart, "='", env.restart_count, "' must be >= 0"));
  }
  if (env.max_restarts < 0) {
    throw ConfigError(strCat("RankEnv: TORCHELASTIC_MAX_RESTARTS='", env.max_restarts, "' must be >= 0"));
  }
}

void readMaster(const Reader& r, RankEnv& env, bool addrRequired, const std::string& why) {
  if (auto addr = r.raw("MASTER_ADDR")) {
    env.master_addr = *addr;
  } else if (addrRequired) {
    throw ConfigError(strCat("RankEnv: MASTER_ADDR is not set (", why, ")"));
  }
  if (auto port = r.integer("MASTER_PORT")) {
    if (*port < 1 || *port > 65535) {
      throw ConfigError(strCat("RankEnv: MASTER_PORT='", *port, "' is not a port (1..65535)"));
    }
    env.master_port = *port;
  }
}

RankEnv readTorchrun(const Reader& r) {
  RankEnv env;
  env.source = "torchrun";
  if (!r.has("RANK")) {
    throw ConfigError(strCat("RankEnv: WORLD_SIZE='", *r.raw("WORLD_SIZE"), "' is set but RANK is not"));
  }
  if (!r.has("WORLD_SIZE")) {
    throw ConfigError(strCat("RankEnv: RANK='", *r.raw("RANK"), "' is set but WORLD_SIZE is not"));
  }
  env.rank = r.required("RANK", "torchrun contract");
  env.world_size = r.required("WORLD_SIZE", "torchrun contract");
  env.local_rank = r.integer("LOCAL_RANK").value_or(env.rank);
  env.local_world_size = r.integer("LOCAL_WORLD_SIZE").value_or(env.world_size);
  if (env.local_world_size < 1) {
    throw ConfigError(strCat("RankEnv: LOCAL_WORLD_SIZE='", env.local_world_size, "' must be >= 1"));
  }
  env.group_rank = r.integer("GROUP_RANK").value_or(env.rank / env.local_world_size);
  env.restart_count = r.integer("TORCHELASTIC_RESTART_COUNT").value_or(0);
  env.max_restarts = r.integer("TORCHELASTIC_MAX_RESTARTS").value_or(0);
  env.use_agent_store = r.raw("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
  readMaster(r, env, env.world_size > 1, strCat("needed for WORLD_SIZE=", env.world_size));
  if (env.world_size > 1 && !r.has("MASTER_PORT")) {
    throw ConfigError(strCat("RankEnv: MASTER_PORT is not set (needed for WORLD_SIZE=", env.world_size, ")"));
  }
  validate(env, {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT"});
  return env;
}

// "2(x3),1" -> {2, 2, 2, 1}.
std::vector<int> expandTasksPerNode(const std::string& value) {
  std::vector<int> counts;
  size_t pos = 0;
  auto bad = [&]() {
    return ConfigError(strCat("RankEnv: SLURM_TASKS_PER_NODE='", value, "' is not of the form 2(x3),1"));
  };
  while (pos < value.size()) {
    size_t comma = value.find(',', pos);
    if (comma == std::string::npos) comma = value.size();
    const std::string item = value.substr(pos, comma - pos);
    int count = 0;
    int repeat = 1;
    const size_t paren = item.find("(x");
    try {
      if (paren == std::string::npos) {
        count = Reader::parse("SLURM_TASKS_PER_NODE", item);
      } else {
        if (item.back() != ')') throw bad();
        count = Reader::parse("SLURM_TASKS_PER_NODE", item.substr(0, paren));
        repeat = Reader::parse("SLURM_TASKS_PER_NODE", item.substr(paren + 2, item.size() - paren - 3));
      }
    } catch (const ConfigError&) {
      throw bad();
    }
    if (count < 1 || repeat < 1 || repeat > 1000000) throw bad();
    counts.insert(counts.end(), static_cast<size_t>(repeat), count);
    pos = comma + 1;
  }
  if (counts.empty()) throw bad();
  return counts;
}

// First host of a SLURM node list: "gpu[07-09,12],cpu1" -> "gpu07", "a1,a2" -> "a1".
std::string firstSlurmHost(const std::string& list) {
  const size_t bracket = list.find('[');
  const size_t comma = list.find(',');
  if (bracket == std::string::npos || (comma != std::string::npos && comma < bracket)) {
    return list.substr(0, comma);
  }
  const size_t close = list.find(']', bracket);
  if (close == std::string::npos) {
    throw ConfigError(strCat("RankEnv: SLURM_JOB_NODELIST='", list, "' has an unclosed '['"));
  }
  const std::string inside = list.substr(bracket + 1, close - bracket - 1);
  const std::string first = inside.substr(0, inside.find_first_of(",-"));
  const size_t suffixEnd = list.find(',', close);
  const std::string suffix = list.substr(close + 1, suffixEnd == std::string::npos ? std::string::npos : suffixEnd - close - 1);
  return list.substr(0, bracket) + first + suffix;
}

RankEnv readSlurm(const Reader& r) {
  RankEnv env;
  env.source = "slurm";
  env.rank = r.required("SLURM_PROCID", "SLURM contract");
  env.world_size = r.required("SLURM_NTASKS", "needed with SLURM_PROCID");
  env.local_rank = r.integer("SLURM_LOCALID").value_or(0);
  env.group_rank = r.integer("SLURM_NODEID").value_or(0);
  if (auto perNode = r.integer("SLURM_NTASKS_PER_NODE")) {
    env.local_world_size = *perNode;
  } else if (auto tasks = r.raw("SLURM_TASKS_PER_NODE")) {
    const auto counts = expandTasksPerNode(*tasks);
    if (env.group_rank < 0 || env.group_rank >= static_cast<int>(counts.size())) {
      throw ConfigError(strCat("RankEnv: SLURM_NODEID='", env.group_rank, "' has no entry in SLURM_TASKS_PER_NODE='",
                               *tasks, "'"));
    }
    env.local_world_size = counts[static_cast<size_t>(env.group_rank)];
  } else {
    env.local_world_size = env.world_size;
  }
  env.restart_count = r.integer("SLURM_RESTART_COUNT").value_or(0);
  if (auto addr = r.raw("MASTER_ADDR")) {
    env.master_addr = *addr;
  } else if (auto list = r.raw("SLURM_JOB_NODELIST") ? r.raw("SLURM_JOB_NODELIST") : r.raw("SLURM_NODELIST")) {
    env.master_addr = firstSlurmHost(*list);
  } else if (env.world_size > 1 && env.local_world_size < env.world_size) {
    throw ConfigError("RankEnv: MASTER_ADDR is not set and neither is SLURM_JOB_NODELIST (needed to find the store host)");
  }
  readMaster(r, env, false, "");
  if (!r.has("MASTER_PORT")) {
    if (auto job = r.integer("SLURM_JOB_ID")) {
      env.master_port = 20000 + (*job % 20000 + 20000) % 20000;
    }
  }
  validate(env, {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE/SLURM_TASKS_PER_NODE",
                 "SLURM_NODEID", "SLURM_RESTART_COUNT"});
  return env;
}

RankEnv readOpenMpi(const Reader& r) {
  RankEnv env;
  env.source = "openmpi";
  env.rank = r.required("OMPI_COMM_WORLD_RANK", "OpenMPI contract");
  env.world_size = r.required("OMPI_COMM_WORLD_SIZE", "needed with OMPI_COMM_WORLD_RANK");
  env.local_rank = r.integer("OMPI_COMM_WORLD_LOCAL_RANK").value_or(0);
  env.local_world_size = r.integer("OMPI_COMM_WORLD_LOCAL_SIZE").value_or(env.world_size);
  if (env.local_world_size < 1) {
    throw ConfigError(strCat("RankEnv: OMPI_COMM_WORLD_LOCAL_SIZE='", env.local_world_size, "' must be >= 1"));
  }
  env.group_rank = r.integer("OMPI_COMM_WORLD_NODE_RANK").value_or(env.rank / env.local_world_size);
  readMaster(r, env, env.local_world_size < env.world_size,
             "the ranks span several nodes; pass it with mpirun -x MASTER_ADDR=host");
  validate(env, {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK", "restart count"});
  return env;
}

}  // namespace

RankEnv RankEnv::fromLookup(const Lookup& lookup) {
  const Reader r(lookup);
  if (r.has("RANK") || r.has("WORLD_SIZE")) return readTorchrun(r);
  if (r.has("SLURM_PROCID")) return readSlurm(r);
  if (r.has("OMPI_COMM_WORLD_RANK")) return readOpenMpi(r);
  RankEnv env;
  env.source = "single";
  env.master_addr = kLoopback;
  env.master_port = kDefaultPort;
  return env;
}

RankEnv RankEnv::fromEnvironment() {
  return fromLookup([](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  });
}

RankEnv RankEnv::fromMap(const std::map<std::string, std::string>& vars) {
  return fromLookup([&vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

std::string RankEnv::describe() const {
  return strCat("rank ", rank, "/", world_size, " (local ", local_rank, "/", local_world_size, ", node ", group_rank,
                ", ", source, ", store ", master_addr, ":", master_port, use_agent_store ? " [agent]" : "",
                ", restart ", restart_count, "/", max_restarts, ")");
}

}  // namespace tessera::distributed
