// What a launch is asked to do (see launcher.h): tessera-run's options checked and parsed,
// the environment each rank gets (torchrun's contract), and the small helpers the launcher
// and its programs share (a rank's error file, signal names, a free port).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "common/app_main.h"
#include "common/errors.h"
#include "common/file_open.h"
#include "common/limits.h"
#include "distributed/launcher.h"

namespace tessera::distributed {
namespace {

// Error-file text longer than this is cut (a rank may write anything there).
constexpr size_t kMaxErrorMessageBytes = 8 * 1024;

bool isExecutableFile(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

// Mirrors execvp()'s lookup so a missing program is a usage error, not N rank failures.
bool findProgram(const std::string& program) {
  if (program.find('/') != std::string::npos) return isExecutableFile(program);
  const char* pathEnv = std::getenv("PATH");
  const std::string path = pathEnv ? pathEnv : "/usr/local/bin:/usr/bin:/bin";
  size_t begin = 0;
  while (begin <= path.size()) {
    size_t end = path.find(':', begin);
    if (end == std::string::npos) end = path.size();
    const std::string dir = path.substr(begin, end - begin);
    if (isExecutableFile((dir.empty() ? std::string(".") : dir) + "/" + program)) return true;
    begin = end + 1;
  }
  return false;
}

std::string trim(const std::string& text) {
  const auto first = text.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return "";
  const auto last = text.find_last_not_of(" \t\r\n");
  return text.substr(first, last - first + 1);
}

}  // namespace

void validateLaunchOptions(const LaunchOptions& o) {
  if (o.command.empty()) throw UsageError("missing PROGRAM (usage: tessera-run [OPTIONS] PROGRAM [ARGS...])");
  const std::string& program = o.command[0];
  if (!program.empty() && program[0] == '-') {
    throw UsageError(strCat("unknown option '", program, "' (tessera-run's options go before PROGRAM)"));
  }
  if (o.nprocPerNode < 1) throw UsageError(strCat("--nproc-per-node must be at least 1, got ", o.nprocPerNode));
  if (o.nprocPerNode > kMaxLocalRanks) {
    throw UsageError(strCat("--nproc-per-node ", o.nprocPerNode, " is more than the ", kMaxLocalRanks,
                            " processes one tessera-run starts"));
  }
  if (o.nnodes < 1) throw UsageError(strCat("--nnodes must be at least 1, got ", o.nnodes));
  if (o.elastic()) {
    if (o.rdzvBackend != "c10d") {
      throw UsageError(strCat("--rdzv-backend '", o.rdzvBackend, "': tessera-run's elastic rendezvous is c10d-like; "
                              "give c10d (or leave it out)"));
    }
    const size_t colon = o.rdzvEndpoint.rfind(':');
    int port = 0;
    try {
      size_t used = 0;
      port = colon == std::string::npos ? 0 : std::stoi(o.rdzvEndpoint.substr(colon + 1), &used);
      if (colon != std::string::npos && used != o.rdzvEndpoint.size() - colon - 1) port = 0;
    } catch (const std::exception&) {
      port = 0;
    }
    if (colon == std::string::npos || colon == 0 || port < 1 || port > 65535) {
      throw UsageError(strCat("--rdzv-endpoint '", o.rdzvEndpoint, "' must be HOST:PORT (port 1..65535)"));
    }
    if (o.standalone) throw UsageError("--standalone runs a single node without a rendezvous; drop --rdzv-endpoint");
    if (!std::isfinite(o.rdzvTimeoutS) || o.rdzvTimeoutS <= 0 || !std::isfinite(o.rdzvLastCallS) ||
        o.rdzvLastCallS < 0) {
      throw UsageError(strCat("--rdzv-timeout (", o.rdzvTimeoutS, ") must be positive and last_call_timeout (",
                              o.rdzvLastCallS, ") not negative"));
    }
    if (boundedProduct(o.maxNodes, o.nprocPerNode, kMaxWorldSize) < 0) {
      throw UsageError(strCat("--nnodes max ", o.maxNodes, " x --nproc-per-node ", o.nprocPerNode,
                              " is more than the ", kMaxWorldSize, " ranks a run may have"));
    }
  } else if (o.minNodes != o.maxNodes) {
    throw UsageError(strCat("--nnodes ", o.minNodes, ":", o.maxNodes,
                            " is elastic: it needs --rdzv-endpoint HOST:PORT where the launchers meet"));
  }
  // Checked before any rank number is computed: nnodes x nproc-per-node in int wraps.
  if (boundedProduct(o.nnodes, o.nprocPerNode, kMaxWorldSize) < 0) {
    throw UsageError(strCat("--nnodes ", o.nnodes, " x --nproc-per-node ", o.nprocPerNode, " is more than the ",
                            kMaxWorldSize, " ranks a run may have"));
  }
  if (o.nodeRank < 0 || o.nodeRank >= o.nnodes) {
    throw UsageError(strCat("--node-rank ", o.nodeRank, " is out of range for --nnodes ", o.nnodes, " (0..",
                            o.nnodes - 1, ")"));
  }
  if (o.standalone && o.nnodes > 1) {
    throw UsageError(strCat("--standalone runs a single node; it cannot be combined with --nnodes ", o.nnodes));
  }
  if (o.masterPort < 1 || o.masterPort > 65535) {
    throw UsageError(strCat("--master-port ", o.masterPort, " is out of range (1..65535)"));
  }
  if (o.masterAddr.empty()) throw UsageError("--master-addr must not be empty");
  if (o.maxRestarts < 0) throw UsageError(strCat("--max-restarts must be at least 0, got ", o.maxRestarts));
  if (!std::isfinite(o.gracePeriodS) || o.gracePeriodS < 0) {
    throw UsageError(strCat("--grace-period-s must be a non-negative number of seconds, got ", o.gracePeriodS));
  }
  if (!findProgram(program)) {
    throw UsageError(program.find('/') != std::string::npos
                         ? strCat("PROGRAM '", program, "' is not an executable file")
                         : strCat("PROGRAM '", program, "' not found in PATH"));
  }
}

void parseNnodes(const std::string& text, LaunchOptions& options) {
  auto number = [&](const std::string& part) {
    size_t used = 0;
    int value = 0;
    try {
      value = std::stoi(part, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != part.size() || value < 1) {
      throw UsageError(strCat("--nnodes '", text, "' must be N or MIN:MAX (whole numbers, at least 1)"));
    }
    return value;
  };
  const size_t colon = text.find(':');
  options.minNodes = number(text.substr(0, colon));
  options.maxNodes = colon == std::string::npos ? options.minNodes : number(text.substr(colon + 1));
  if (options.maxNodes < options.minNodes) {
    throw UsageError(strCat("--nnodes '", text, "': MAX (", options.maxNodes, ") is below MIN (", options.minNodes, ")"));
  }
  options.nnodes = options.minNodes;
}

void parseRdzvConf(const std::string& text, LaunchOptions& options) {
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find(',', begin);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(begin, end - begin);
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    double value = -1;
    try {
      size_t used = 0;
      value = eq == std::string::npos ? -1 : std::stod(item.substr(eq + 1), &used);
      if (eq != std::string::npos && used != item.size() - eq - 1) value = -1;
    } catch (const std::exception&) {
      value = -1;
    }
    if (!std::isfinite(value) || value < 0) {
      throw UsageError(strCat("--rdzv-conf '", item, "': expected key=seconds"));
    }
    if (key == "join_timeout") {
      options.rdzvTimeoutS = value;
    } else if (key == "last_call_timeout") {
      options.rdzvLastCallS = value;
    } else {
      throw UsageError(strCat("--rdzv-conf: unknown key '", key, "' (join_timeout, last_call_timeout)"));
    }
    begin = end + 1;
  }
}

std::map<std::string, std::string> rankEnvironment(const LaunchOptions& o, int localRank, int restartCount,
                                                   const std::string& errorFile, const char* inheritedOmpThreads) {
  const int rank = o.nodeRank * o.nprocPerNode + localRank;
  const int world = o.nnodes * o.nprocPerNode;
  std::map<std::string, std::string> env = {
      {"RANK", std::to_string(rank)},
      {"LOCAL_RANK", std::to_string(localRank)},
      {"WORLD_SIZE", std::to_string(world)},
      {"LOCAL_WORLD_SIZE", std::to_string(o.nprocPerNode)},
      {"GROUP_RANK", std::to_string(o.nodeRank)},
      {"GROUP_WORLD_SIZE", std::to_string(o.nnodes)},
      {"ROLE_NAME", "default"},
      {"ROLE_RANK", std::to_string(rank)},
      {"ROLE_WORLD_SIZE", std::to_string(world)},
      {"MASTER_ADDR", o.masterAddr},
      {"MASTER_PORT", std::to_string(o.masterPort)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restartCount)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(o.maxRestarts)},
      {"TORCHELASTIC_RUN_ID", o.runId},
      // Rank 0 hosts the TCPStore itself (no agent store), as with torchrun's static rendezvous.
      {"TORCHELASTIC_USE_AGENT_STORE", "False"},
      {"TORCHELASTIC_ERROR_FILE", errorFile},
      {kLauncherReportsErrorsEnv, "1"},
  };
  if (o.nprocPerNode > 1 && (!inheritedOmpThreads || !*inheritedOmpThreads)) env["OMP_NUM_THREADS"] = "1";
  return env;
}

std::optional<std::string> readErrorFile(const std::string& path) {
  std::string content;
  try {
    // A rank's error report is small; anything that is not a small regular file is ignored.
    constexpr int64_t kMaxErrorFileBytes = int64_t{1} << 20;
    content = readRegularFile(path, kMaxErrorFileBytes, LinkPolicy::kRefuse);
  } catch (const Error&) {
    return std::nullopt;
  }
  const std::string text = trim(content);
  if (text.empty()) return std::nullopt;
  try {
    const auto json = nlohmann::json::parse(text);
    if (json.is_object() && json.contains("message")) {
      const auto& message = json.at("message");
      if (message.is_string()) return message.get<std::string>();
      if (message.is_object() && message.contains("message") && message.at("message").is_string()) {
        return message.at("message").get<std::string>();
      }
    }
  } catch (const nlohmann::json::exception&) {
    // Not JSON: the rank wrote plain text, which is reported as it is.
  }
  if (text.size() > kMaxErrorMessageBytes) return text.substr(0, kMaxErrorMessageBytes) + " [...]";
  return text;
}

std::vector<std::string> foldRankErrors(const std::map<int, std::string>& messages, int firstRank) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;  // message -> its ranks, first seen first
  auto add = [&](int rank, const std::string& message) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == message; });
    if (it == groups.end()) {
      groups.push_back({message, {rank}});
    } else {
      it->second.push_back(rank);
    }
  };
  if (const auto first = messages.find(firstRank); first != messages.end()) add(first->first, first->second);
  for (const auto& [rank, message] : messages) {
    if (rank != firstRank) add(rank, message);
  }
  std::vector<std::string> lines;
  for (auto& [message, ranks] : groups) {
    std::sort(ranks.begin(), ranks.end());
    std::string who = ranks.size() == 1 ? "rank " : "ranks ";
    for (size_t i = 0; i < ranks.size();) {
      size_t j = i;
      while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
      who += strCat(i > 0 ? ", " : "", ranks[i], j > i ? strCat("-", ranks[j]) : std::string());
      i = j + 1;
    }
    lines.push_back(strCat(who, " error: ", message));
  }
  return lines;
}

std::string signalName(int signal) {
  switch (signal) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    case SIGCHLD: return "SIGCHLD";
    case SIGCONT: return "SIGCONT";
    case SIGSTOP: return "SIGSTOP";
    case SIGTSTP: return "SIGTSTP";
    case SIGXCPU: return "SIGXCPU";
    case SIGXFSZ: return "SIGXFSZ";
    case SIGSYS: return "SIGSYS";
    default: return strCat("signal ", signal);
  }
}

int pickFreePort(const std::string& host) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(strCat("pickFreePort: socket() failed: ", errnoText(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    ::close(fd);
    throw Error(strCat("pickFreePort: '", host, "' is not an IPv4 address"));
  }
  socklen_t length = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
    const int error = errno;
    ::close(fd);
    throw Error(strCat("pickFreePort: cannot bind a port on ", host, ": ", errnoText(error)));
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace tessera::distributed
