// The elastic rendezvous's server (a thread in the launcher that binds the endpoint) and
// client (every launcher), see elastic_rendezvous.h.
#include "distributed/elastic_rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <map>
#include <random>
#include <set>

#include "common/errors.h"
#include "common/file_open.h"
#include "common/limits.h"
#include "common/logging.h"
#include "distributed/launcher.h"

namespace tessera::distributed {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

// Requests carry flight-recorder dumps (about 100 bytes per collective remembered).
constexpr size_t kMaxLineBytes = size_t{64} << 20;
constexpr size_t kMaxDumpBytesPerRound = size_t{256} << 20;

double secondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The IPv4 address of `host` (a name or a dotted address).
sockaddr_in resolve(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc != 0 || found == nullptr) {
    throw Error(strCat("rendezvous endpoint '", host, "': cannot resolve it: ", ::gai_strerror(rc)));
  }
  sockaddr_in addr = *reinterpret_cast<sockaddr_in*>(found->ai_addr);
  ::freeaddrinfo(found);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  return addr;
}

std::string addressText(const sockaddr_in& addr) {
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &addr.sin_addr, text, sizeof text);
  return text;
}

// Waits until `fd` is ready for `events`, up to `deadline`; false on timeout.
bool waitFd(int fd, short events, Clock::time_point deadline) {
  while (true) {
    const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(std::max(1.0, left * 1000.0)));
    if (rc > 0) return true;
    if (rc < 0 && errno != EINTR) return false;
  }
}

void sendAll(int fd, const std::string& data, Clock::time_point deadline) {
  size_t done = 0;
  while (done < data.size()) {
    if (!waitFd(fd, POLLOUT, deadline)) throw TimeoutError("rendezvous: timed out sending");
    const ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      throw Error(strCat("rendezvous: send failed: ", errnoText(errno)));
    }
    done += static_cast<size_t>(n);
  }
}

std::string readLine(int fd, Clock::time_point deadline) {
  std::string line;
  char buffer[4096];
  while (line.find('\n') == std::string::npos) {
    if (!waitFd(fd, POLLIN, deadline)) throw TimeoutError("rendezvous: timed out waiting for an answer");
    const ssize_t n = ::recv(fd, buffer, sizeof buffer, 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) throw Error("rendezvous: the connection closed before a whole line");
    line.append(buffer, static_cast<size_t>(n));
    if (line.size() > kMaxLineBytes) throw Error(strCat("rendezvous: a line longer than ", kMaxLineBytes >> 20, " MiB"));
  }
  return line.substr(0, line.find('\n'));
}

json nodeJson(const ElasticNode& n) {
  return {{"id", n.id}, {"host", n.host}, {"store_port", n.storePort}, {"nproc", n.nproc}};
}

// An answer of the server is input like any other (a stale or foreign process may hold the
// port): every field is checked where it is read, and a wrong one is an Error naming it,
// never a raw JSON exception or an out-of-range index.
json parseAnswer(const std::string& text, const std::string& where) {
  try {
    json j = json::parse(text);
    if (!j.is_object()) throw Error("not a JSON object");
    return j;
  } catch (const std::exception& e) {
    throw Error(strCat(where, ": its answer is not a rendezvous answer (", e.what(), ")"));
  }
}

int64_t intField(const json& j, const char* key, int64_t lo, int64_t hi, const std::string& where) {
  if (!j.contains(key) || !j.at(key).is_number_integer()) {
    throw Error(strCat(where, ": its answer lacks an integer '", key, "'"));
  }
  const int64_t v = j.at(key).get<int64_t>();
  if (v < lo || v > hi) throw Error(strCat(where, ": its answer's '", key, "' is ", v, ", outside [", lo, ", ", hi, "]"));
  return v;
}

std::string stringField(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || !j.at(key).is_string()) throw Error(strCat(where, ": its answer lacks a string '", key, "'"));
  std::string v = j.at(key).get<std::string>();
  const bool printable = std::all_of(v.begin(), v.end(), [](char c) { return c > ' ' && c < 127; });
  if (v.empty() || v.size() > 256 || !printable) {
    throw Error(strCat(where, ": its answer's '", key, "' is not 1 to 256 printable characters without spaces"));
  }
  return v;
}

bool boolField(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || !j.at(key).is_boolean()) throw Error(strCat(where, ": its answer lacks a boolean '", key, "'"));
  return j.at(key).get<bool>();
}

ElasticNode nodeFromJson(const json& j, const std::string& where) {
  if (!j.is_object()) throw Error(strCat(where, ": a node of its answer is not an object"));
  ElasticNode n;
  n.id = stringField(j, "id", where);
  n.host = stringField(j, "host", where);
  n.storePort = static_cast<int>(intField(j, "store_port", 1, 65535, where));
  n.nproc = static_cast<int>(intField(j, "nproc", 1, kMaxLocalRanks, where));
  return n;
}

// The round a closed answer describes, checked against what this launcher is: between
// MIN and MAX nodes, each once, this node at node_rank with its own --nproc-per-node.
ElasticRound roundFromAnswer(const json& state, const std::string& where, const ElasticOptions& options,
                             const std::string& nodeId, int nproc) {
  ElasticRound round;
  round.round = intField(state, "round", 0, kMaxCounter, where);
  if (!state.contains("nodes") || !state.at("nodes").is_array()) throw Error(strCat(where, ": its answer lacks 'nodes'"));
  const json& nodes = state.at("nodes");
  if (nodes.size() < static_cast<size_t>(options.minNodes) || nodes.size() > static_cast<size_t>(options.maxNodes)) {
    throw Error(strCat(where, ": its answer has ", nodes.size(), " nodes, this run has ", options.minNodes, " to ",
                       options.maxNodes, " (--nnodes)"));
  }
  std::set<std::string> ids;
  for (const json& n : nodes) {
    round.nodes.push_back(nodeFromJson(n, where));
    if (!ids.insert(round.nodes.back().id).second) throw Error(strCat(where, ": its answer names a node twice"));
  }
  round.nodeRank = static_cast<int>(intField(state, "node_rank", 0, static_cast<int64_t>(nodes.size()) - 1, where));
  const ElasticNode& me = round.nodes[static_cast<size_t>(round.nodeRank)];
  if (me.id != nodeId || me.nproc != nproc) {
    throw Error(strCat(where, ": its answer puts another node (", me.id, ", ", me.nproc, " ranks) at this node's rank ",
                       round.nodeRank));
  }
  return round;
}

}  // namespace

int ElasticRound::worldSize() const {
  int world = 0;
  for (const auto& n : nodes) world += n.nproc;
  return world;
}

// The rendezvous state and the thread that answers requests. One request at a time: each
// is a few microseconds of work.
class ElasticRendezvous::Server {
 public:
  Server(int listenFd, ElasticOptions options) : listenFd_(listenFd), options_(std::move(options)) {
    if (::pipe(stopPipe_) != 0) throw Error(strCat("rendezvous server: pipe() failed: ", errnoText(errno)));
    thread_ = std::thread([this] { serve(); });
  }
  ~Server() {
    const char byte = 0;
    [[maybe_unused]] const ssize_t ignored = ::write(stopPipe_[1], &byte, 1);
    if (thread_.joinable()) thread_.join();
    ::close(listenFd_);
    ::close(stopPipe_[0]);
    ::close(stopPipe_[1]);
  }

  // Answers one request (also called directly in tests of the state machine).
  json handle(const json& request, const std::string& peerHost) {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::string op = request.at("op").get<std::string>();
    if (request.value("run_id", "") != options_.runId) {
      return {{"error", strCat("this rendezvous belongs to run id '", options_.runId, "', not '",
                               request.value("run_id", ""), "' (--rdzv-id)")}};
    }
    const std::string node = request.at("node").get<std::string>();
    tick();
    if (op == "join") {
      ElasticNode n;
      n.id = node;
      n.host = peerHost;
      n.storePort = request.at("store_port").get<int>();
      n.nproc = request.at("nproc").get<int>();
      // Whatever reaches the port is checked: a bad join must not become a member.
      if (node.empty() || node.size() > 256 || n.storePort < 1 || n.storePort > 65535 || n.nproc < 1 ||
          n.nproc > kMaxLocalRanks) {
        return {{"error", strCat("a join needs a node id (1 to 256 characters), a store port in 1..65535 and 1 to ",
                                 kMaxLocalRanks, " ranks")}};
      }
      // A launcher started with other --nnodes would count the round otherwise.
      if (request.contains("min_nodes") && request.contains("max_nodes") &&
          (request.at("min_nodes") != options_.minNodes || request.at("max_nodes") != options_.maxNodes)) {
        return {{"error", strCat("this rendezvous is for ", options_.minNodes, " to ", options_.maxNodes,
                                 " nodes, this launcher asks for ", request.at("min_nodes").dump(), " to ",
                                 request.at("max_nodes").dump(), " (--nnodes must be the same on every node)")}};
      }
      if (nproc_ == 0) nproc_ = n.nproc;
      if (n.nproc != nproc_) {
        return {{"error", strCat("this node starts ", n.nproc, " ranks but the others ", nproc_,
                                 " (--nproc-per-node must be the same on every node)")}};
      }
      join(n);
    } else if (op == "finished") {
      if (request.at("round").get<int64_t>() == round_) finished_.insert(node);
    } else if (op == "put_dumps") {
      putDumps(request.at("round").get<int64_t>(), node, request.at("files"));
    } else if (op == "get_dumps") {
      json answer = state(node);
      const auto it = dumps_.find(request.at("round").get<int64_t>());
      answer["dumps"] = it == dumps_.end() ? json::object() : it->second;
      answer["dump_nodes"] = it == dumps_.end() ? 0 : dumpNodes_[it->first].size();
      return answer;
    } else if (op != "poll") {
      return {{"error", strCat("unknown request '", op, "'")}};
    }
    return state(node);
  }

 private:
  bool isMember(const std::string& id) const {
    return std::any_of(members_.begin(), members_.end(), [&](const ElasticNode& n) { return n.id == id; });
  }

  void join(const ElasticNode& n) {
    if (round_ == 0 || (!open_ && !failed_.empty())) {
      openRound({n});
      return;
    }
    if (open_) {
      auto it = std::find_if(members_.begin(), members_.end(), [&](const ElasticNode& m) { return m.id == n.id; });
      if (it != members_.end()) {
        *it = n;  // joined again (a new store port)
      } else {
        members_.push_back(n);
      }
      afterJoin();
      return;
    }
    // A round runs. One of its members asks for the next: open it. Anyone else waits for it.
    if (isMember(n.id)) {
      openRound({n});
    } else if (std::none_of(waiting_.begin(), waiting_.end(), [&](const ElasticNode& w) { return w.id == n.id; })) {
      waiting_.push_back(n);
    }
  }

  // A node's flight-recorder dumps of `round` (file name -> text), kept for the others'
  // verdicts; only the latest rounds', within a bound.
  void putDumps(int64_t round, const std::string& node, const json& files) {
    json& all = dumps_[round];
    for (const auto& [name, text] : files.items()) {
      const size_t bytes = text.get<std::string>().size();
      if (dumpBytes_ + bytes > kMaxDumpBytesPerRound) break;
      dumpBytes_ += bytes;
      all[name] = text;
    }
    dumpNodes_[round].insert(node);
    while (dumps_.size() > 2) {  // the rounds before are long over
      dumpBytes_ = 0;
      dumpNodes_.erase(dumps_.begin()->first);
      dumps_.erase(dumps_.begin());
    }
  }

  void openRound(std::vector<ElasticNode> first) {
    ++round_;
    open_ = true;
    failed_.clear();
    finished_.clear();
    members_ = std::move(first);
    for (const ElasticNode& w : waiting_) {
      if (!isMember(w.id)) members_.push_back(w);
    }
    waiting_.clear();
    openedAt_ = Clock::now();
    minReached_ = false;
    afterJoin();
  }

  void afterJoin() {
    if (!minReached_ && static_cast<int>(members_.size()) >= options_.minNodes) {
      minReached_ = true;
      minReachedAt_ = Clock::now();
    }
    if (static_cast<int>(members_.size()) >= options_.maxNodes) open_ = false;
  }

  // Closes or fails the open round when its time has come.
  void tick() {
    if (!open_) return;
    if (minReached_ && secondsSince(minReachedAt_) >= options_.lastCallS) {
      open_ = false;
    } else if (!minReached_ && secondsSince(openedAt_) >= options_.joinTimeoutS) {
      open_ = false;
      failed_ = strCat("only ", members_.size(), " of at least ", options_.minNodes, " nodes joined round ", round_,
                       " within ", options_.joinTimeoutS, " s");
    }
  }

  json state(const std::string& node) const {
    json nodes = json::array();
    int nodeRank = -1;
    for (size_t i = 0; i < members_.size(); ++i) {
      nodes.push_back(nodeJson(members_[i]));
      if (members_[i].id == node) nodeRank = static_cast<int>(i);
    }
    return {{"round", round_},      {"open", open_},          {"failed", failed_},
            {"nodes", nodes},       {"node_rank", nodeRank},  {"waiting", waiting_.size()},
            {"finished", finished_.size()}};
  }

  void serve() {
    // Signals go to the launcher's thread, whose handlers they are for.
    sigset_t all;
    sigfillset(&all);
    ::pthread_sigmask(SIG_BLOCK, &all, nullptr);
    while (true) {
      pollfd fds[2] = {{listenFd_, POLLIN, 0}, {stopPipe_[0], POLLIN, 0}};
      if (::poll(fds, 2, 1000) < 0 && errno != EINTR) return;
      if (fds[1].revents) return;
      if (!(fds[0].revents & POLLIN)) continue;
      sockaddr_in peer{};
      socklen_t length = sizeof peer;
      const int fd = ::accept4(listenFd_, reinterpret_cast<sockaddr*>(&peer), &length, SOCK_CLOEXEC);
      if (fd < 0) continue;
      try {
        const auto deadline = Clock::now() + std::chrono::seconds(5);
        const json request = json::parse(readLine(fd, deadline));
        sendAll(fd, handle(request, addressText(peer)).dump() + "\n", deadline);
      } catch (const std::exception& e) {
        try {
          sendAll(fd, json({{"error", strCat("bad request: ", e.what())}}).dump() + "\n",
                  Clock::now() + std::chrono::seconds(1));
        } catch (const std::exception&) {
          // The peer is gone; nothing to tell it.
        }
      }
      ::close(fd);
    }
  }

  int listenFd_;
  int stopPipe_[2] = {-1, -1};
  ElasticOptions options_;
  std::thread thread_;
  std::mutex mutex_;
  int64_t round_ = 0;
  bool open_ = false;
  std::string failed_;  // why the last round failed ("" when it did not)
  int nproc_ = 0;
  std::vector<ElasticNode> members_;
  std::vector<ElasticNode> waiting_;
  std::set<std::string> finished_;
  std::map<int64_t, json> dumps_;                       // round -> {file name: text}
  std::map<int64_t, std::set<std::string>> dumpNodes_;  // round -> nodes that sent theirs
  size_t dumpBytes_ = 0;
  Clock::time_point openedAt_, minReachedAt_;
  bool minReached_ = false;
};

ElasticRendezvous::ElasticRendezvous(ElasticOptions options, int nproc) : options_(std::move(options)), nproc_(nproc) {
  std::random_device random;
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  nodeId_ = strCat(host, ":", ::getpid(), ":", std::hex, random());
  // The launcher that can bind the endpoint hosts the server; the others get
  // EADDRINUSE (another launcher here has it) or EADDRNOTAVAIL (not this machine's address).
  const sockaddr_in addr = resolve(options_.host, options_.port);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(strCat("rendezvous: socket() failed: ", errnoText(errno)));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0 && ::listen(fd, 64) == 0) {
    server_ = std::make_unique<Server>(fd, options_);
    if (!options_.quiet) TLOG_INFO("tessera-run: hosting the rendezvous of run '" << options_.runId << "' at " << options_.host << ":"
              << options_.port << " (" << options_.minNodes << " to " << options_.maxNodes << " nodes)");
  } else {
    ::close(fd);
  }
}

ElasticRendezvous::~ElasticRendezvous() = default;

std::string ElasticRendezvous::request(const std::string& line, double timeoutS) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeoutS * 1000));
  const sockaddr_in addr = resolve(options_.host, options_.port);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) throw Error(strCat("rendezvous: socket() failed: ", errnoText(errno)));
  try {
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 && errno != EINPROGRESS) {
      throw Error(errnoText(errno));
    }
    if (!waitFd(fd, POLLOUT, deadline)) throw TimeoutError("timed out connecting");
    int error = 0;
    socklen_t length = sizeof error;
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
    if (error != 0) throw Error(errnoText(error));
    sendAll(fd, line + "\n", deadline);
    std::string answer = readLine(fd, deadline);
    ::close(fd);
    return answer;
  } catch (const std::exception& e) {
    ::close(fd);
    throw Error(strCat("rendezvous server at ", options_.host, ":", options_.port, " (--rdzv-endpoint): ", e.what(),
                       " (it runs in the launcher that bound that address; is it gone?)"));
  }
}

ElasticRound ElasticRendezvous::join(const std::function<bool()>& interrupted) {
  const int storePort = pickFreePort("0.0.0.0");
  const json joinRequest = {{"op", "join"},       {"run_id", options_.runId}, {"node", nodeId_},
                            {"store_port", storePort}, {"nproc", nproc_},
                            {"min_nodes", options_.minNodes}, {"max_nodes", options_.maxNodes}};
  const std::string where = strCat("rendezvous server at ", options_.host, ":", options_.port);
  const auto start = Clock::now();
  // The server may not be up yet (its launcher starts later): retry until the join timeout.
  // Only an unreachable server is waited for; an answer that is not one fails at once.
  std::string answer;
  while (true) {
    try {
      answer = request(joinRequest.dump(), 10);
      break;
    } catch (const Error& e) {
      if (secondsSince(start) > options_.joinTimeoutS) throw;
      if (interrupted()) throw Error("rendezvous: interrupted");
      ::usleep(200 * 1000);
    }
  }
  json state = parseAnswer(answer, where);
  const json pollRequest = {{"op", "poll"}, {"run_id", options_.runId}, {"node", nodeId_}};
  while (true) {
    if (state.contains("error")) {
      const json& error = state.at("error");
      throw Error(strCat("rendezvous: ", error.is_string() ? error.get<std::string>() : error.dump()));
    }
    const std::string failed = state.contains("failed") && state.at("failed").is_string() ? state.at("failed").get<std::string>() : "";
    if (!failed.empty()) throw TimeoutError(strCat("rendezvous: ", failed, " (--rdzv-timeout)"));
    if (!boolField(state, "open", where) && intField(state, "node_rank", -1, kMaxWorldSize, where) >= 0) break;
    if (interrupted()) throw Error("rendezvous: interrupted");
    if (secondsSince(start) > options_.joinTimeoutS + options_.lastCallS + 30) {
      throw TimeoutError(strCat("rendezvous: no round admitted this node within ", secondsSince(start), " s"));
    }
    ::usleep(100 * 1000);
    state = parseAnswer(request(pollRequest.dump(), 10), where);
  }
  return roundFromAnswer(state, where, options_, nodeId_, nproc_);
}

bool ElasticRendezvous::restartWanted(int64_t round) {
  try {
    const json state = json::parse(
        request(json({{"op", "poll"}, {"run_id", options_.runId}, {"node", nodeId_}}).dump(), 5));
    if (state.contains("error")) return false;
    if (state.at("round").get<int64_t>() > round) return true;
    return state.at("waiting").get<int64_t>() > 0 &&
           static_cast<int>(state.at("nodes").size()) < options_.maxNodes;
  } catch (const std::exception& e) {
    if (!warnedUnreachable_) {
      TLOG_WARN("tessera-run: " << e.what());
      warnedUnreachable_ = true;
    }
    return false;
  }
}

std::map<std::string, std::string> ElasticRendezvous::exchangeDumps(int64_t round,
                                                                   const std::map<std::string, std::string>& mine,
                                                                   double timeoutS, int expectedNodes) {
  std::map<std::string, std::string> all;
  try {
    json files = json::object();
    for (const auto& [name, text] : mine) files[name] = text;
    request(json({{"op", "put_dumps"}, {"run_id", options_.runId}, {"node", nodeId_}, {"round", round},
                  {"files", files}})
                .dump(),
            10);
    const json getRequest = {{"op", "get_dumps"}, {"run_id", options_.runId}, {"node", nodeId_}, {"round", round}};
    const auto start = Clock::now();
    json state = json::parse(request(getRequest.dump(), 10));
    // The other nodes fail at about the same time; a lost node never sends: wait a little.
    const size_t expected = expectedNodes > 0 ? static_cast<size_t>(expectedNodes) : state.at("nodes").size();
    while (state.at("round").get<int64_t>() == round && state.at("dump_nodes").get<size_t>() < expected &&
           secondsSince(start) < timeoutS) {
      ::usleep(200 * 1000);
      state = json::parse(request(getRequest.dump(), 10));
    }
    for (const auto& [name, text] : state.at("dumps").items()) all[name] = text.get<std::string>();
    // The server goes when this launcher exits: give the others a moment to read.
    if (hostsServer()) ::usleep(500 * 1000);
  } catch (const std::exception& e) {
    TLOG_WARN("tessera-run: the other nodes' flight dumps: " << e.what());
  }
  return all;
}

void ElasticRendezvous::finished(int64_t round, double timeoutS) {
  const json finishedRequest = {{"op", "finished"}, {"run_id", options_.runId}, {"node", nodeId_}, {"round", round}};
  try {
    json state = json::parse(request(finishedRequest.dump(), 5));
    if (!hostsServer()) return;
    const auto start = Clock::now();
    const json pollRequest = {{"op", "poll"}, {"run_id", options_.runId}, {"node", nodeId_}};
    while (state.at("finished").get<size_t>() < state.at("nodes").size() && secondsSince(start) < timeoutS) {
      ::usleep(100 * 1000);
      state = json::parse(request(pollRequest.dump(), 5));
    }
  } catch (const std::exception& e) {
    TLOG_WARN("tessera-run: " << e.what());
  }
}

}  // namespace tessera::distributed
