// The elastic rendezvous's sockets: the server (a thread in the launcher that binds the
// endpoint) and the client (every launcher), see elastic_rendezvous.h. The messages and
// the rounds are elastic_protocol.cpp's.
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
#include <map>
#include <random>
#include <string_view>
#include <vector>

#include "common/clock.h"
#include "common/errors.h"
#include "common/file_open.h"
#include "common/logging.h"
#include "distributed/elastic_protocol.h"
#include "distributed/launcher.h"

namespace tessera::distributed {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;


// exchangeDumps in an elastic round: how long no further node sends before the wait ends.
// The nodes a failure reaches see it within a fraction of a second of each other (a
// closed connection); a node that comes later only misses the verdict of the ones before.
constexpr double kDumpQuietS = 1.5;

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
    if (line.size() > kMaxRendezvousLineBytes) {
      throw Error(strCat("rendezvous: a line longer than ", kMaxRendezvousLineBytes >> 20, " MiB"));
    }
  }
  return line.substr(0, line.find('\n'));
}

}  // namespace

int ElasticRound::worldSize() const {
  int world = 0;
  for (const auto& n : nodes) world += n.nproc;
  return world;
}

// The thread that answers requests: one poll loop over every open connection, each with
// its own deadline, so that a peer that connects and sends nothing (or sends slowly)
// holds only its own connection, never the others' answers.
class ElasticRendezvous::Server {
 public:
  Server(int listenFd, ElasticOptions options) : listenFd_(listenFd), state_(std::move(options)) {
    // Non-blocking: acceptAll() takes every pending connection and stops at EAGAIN.
    ::fcntl(listenFd_, F_SETFL, ::fcntl(listenFd_, F_GETFL) | O_NONBLOCK);
    if (::pipe(stopPipe_) != 0) throw Error(strCat("rendezvous server: pipe() failed: ", errnoText(errno)));
    thread_ = std::thread([this] { serve(); });
  }
  ~Server() {
    const char byte = 0;
    [[maybe_unused]] const ssize_t ignored = ::write(stopPipe_[1], &byte, 1);
    if (thread_.joinable()) thread_.join();
    for (const Connection& c : connections_) ::close(c.fd);
    ::close(listenFd_);
    ::close(stopPipe_[0]);
    ::close(stopPipe_[1]);
  }

 private:
  // A peer's request being read, or its answer being sent.
  struct Connection {
    int fd = -1;
    std::string peer;
    std::string in;    // what arrived so far (one line is a request)
    std::string out;   // the answer, once the request was read
    size_t sent = 0;
    Clock::time_point deadline;
  };

  // A connection has this long to send its request and take its answer.
  static constexpr auto kConnectionTime = std::chrono::seconds(5);
  // Open connections at once (launchers poll every 100 ms; each request takes microseconds).
  static constexpr size_t kMaxConnections = 256;
  // Bytes of requests being read at once, over all connections (dumps are large).
  static constexpr size_t kMaxBufferedBytes = size_t{512} << 20;

  void serve() {
    // Signals go to the launcher's thread, whose handlers they are for.
    sigset_t all;
    sigfillset(&all);
    ::pthread_sigmask(SIG_BLOCK, &all, nullptr);
    while (true) {
      std::vector<pollfd> fds = {{stopPipe_[0], POLLIN, 0}, {listenFd_, POLLIN, 0}};
      if (connections_.size() >= kMaxConnections) fds[1].events = 0;  // the backlog waits
      auto wake = Clock::now() + std::chrono::seconds(1);
      for (const Connection& c : connections_) {
        fds.push_back({c.fd, static_cast<short>(c.out.empty() ? POLLIN : POLLOUT), 0});
        wake = std::min(wake, c.deadline);
      }
      const auto waitMs = std::chrono::duration_cast<std::chrono::milliseconds>(wake - Clock::now()).count();
      if (::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(0, waitMs) + 1)) < 0 && errno != EINTR) return;
      if (fds[0].revents) return;
      // Connections first (their indices match fds), then new ones.
      for (size_t i = connections_.size(); i-- > 0;) {
        if (!progress(connections_[i], fds[i + 2].revents)) {
          ::close(connections_[i].fd);
          connections_.erase(connections_.begin() + static_cast<std::ptrdiff_t>(i));
        }
      }
      if (fds[1].revents & POLLIN) acceptAll();
    }
  }

  void acceptAll() {
    while (connections_.size() < kMaxConnections) {
      sockaddr_in peer{};
      socklen_t length = sizeof peer;
      const int fd = ::accept4(listenFd_, reinterpret_cast<sockaddr*>(&peer), &length, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) return;  // EAGAIN: none left (or a peer gone before it was accepted)
      Connection c;
      c.fd = fd;
      c.peer = addressText(peer);
      c.deadline = Clock::now() + kConnectionTime;
      connections_.push_back(std::move(c));
    }
  }

  // Reads or writes what connection `c` is ready for; false when it is done (answered,
  // gone or out of time) and is to be closed.
  bool progress(Connection& c, short revents) {
    if (Clock::now() >= c.deadline) return false;  // a silent or slow peer: no answer
    if (!c.out.empty()) {
      if (!(revents & (POLLOUT | POLLERR | POLLHUP))) return true;
      const ssize_t n = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
      if (n < 0) return errno == EINTR || errno == EAGAIN;
      c.sent += static_cast<size_t>(n);
      return c.sent < c.out.size();
    }
    if (!(revents & (POLLIN | POLLERR | POLLHUP))) return true;
    char buffer[65536];
    const ssize_t n = ::recv(c.fd, buffer, sizeof buffer, 0);
    if (n < 0) return errno == EINTR || errno == EAGAIN;
    if (n == 0) return false;  // closed before a whole line
    const size_t end = std::string_view(buffer, static_cast<size_t>(n)).find('\n');
    const size_t take = end == std::string_view::npos ? static_cast<size_t>(n) : end;
    if (c.in.size() + take > kMaxRendezvousLineBytes || buffered() + take > kMaxBufferedBytes) {
      answer(c, json({{"error", strCat("bad request: a line longer than ", kMaxRendezvousLineBytes >> 20,
                                       " MiB, or the server holds too many")}}).dump());
      return true;
    }
    c.in.append(buffer, take);
    if (end != std::string_view::npos) answer(c, state_.answer(c.in, c.peer));
    return true;
  }

  void answer(Connection& c, const std::string& line) {
    c.in.clear();
    c.in.shrink_to_fit();
    c.out = line + "\n";
  }

  size_t buffered() const {
    size_t bytes = 0;
    for (const Connection& c : connections_) bytes += c.in.size();
    return bytes;
  }

  int listenFd_;
  int stopPipe_[2] = {-1, -1};
  RendezvousState state_;
  std::vector<Connection> connections_;
  std::thread thread_;
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

std::string ElasticRendezvous::where() const { return strCat("rendezvous server at ", options_.host, ":", options_.port); }

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
  const std::string where = this->where();
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
  RendezvousAnswer state = parseRendezvousAnswer(answer, where);
  const json pollRequest = {{"op", "poll"}, {"run_id", options_.runId}, {"node", nodeId_}};
  while (true) {
    if (!state.error.empty()) throw Error(strCat("rendezvous: ", state.error));
    if (!state.failed.empty()) throw TimeoutError(strCat("rendezvous: ", state.failed, " (--rdzv-timeout)"));
    if (!state.open && state.nodeRank >= 0) break;
    if (interrupted()) throw Error("rendezvous: interrupted");
    if (secondsSince(start) > options_.joinTimeoutS + options_.lastCallS + 30) {
      throw TimeoutError(strCat("rendezvous: no round admitted this node within ", secondsSince(start), " s"));
    }
    ::usleep(100 * 1000);
    state = parseRendezvousAnswer(request(pollRequest.dump(), 10), where);
  }
  return closedRound(state, where, options_, nodeId_, nproc_);
}

bool ElasticRendezvous::restartWanted(int64_t round) {
  try {
    const RendezvousAnswer state = parseRendezvousAnswer(
        request(json({{"op", "poll"}, {"run_id", options_.runId}, {"node", nodeId_}}).dump(), 5), where());
    if (!state.error.empty()) return false;
    if (state.round > round) return true;
    return state.waiting > 0 && static_cast<int>(state.nodes.size()) < options_.maxNodes;
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
                                                                   double timeoutS, int expectedNodes,
                                                                   int64_t* othersFailed) {
  std::map<std::string, std::string> all;
  if (othersFailed) *othersFailed = -1;
  try {
    const json getRequest = {{"op", "get_dumps"}, {"run_id", options_.runId}, {"node", nodeId_}, {"round", round}};
    // The nodes that sent before this failure (earlier failures in this round, of nodes
    // restarted into it), this one among them when it did.
    const int64_t sentBefore = othersFailed ? parseRendezvousAnswer(request(getRequest.dump(), 10), where()).dumpNodes : 0;
    const bool sentBeforeMyself = !dumpedRounds_.insert(round).second;
    json files = json::object();
    for (const auto& [name, text] : mine) files[name] = text;
    request(json({{"op", "put_dumps"}, {"run_id", options_.runId}, {"node", nodeId_}, {"round", round},
                  {"files", files}})
                .dump(),
            10);
    const auto start = Clock::now();
    RendezvousAnswer state = parseRendezvousAnswer(request(getRequest.dump(), 10), where());
    // The other nodes fail at about the same time; a lost node never sends: wait a little,
    // and no longer than the others keep sending (see the header).
    const int64_t expected = expectedNodes > 0 ? expectedNodes : static_cast<int64_t>(state.nodes.size());
    auto lastNew = Clock::now();
    int64_t seen = state.dumpNodes;
    while (state.error.empty() && state.round == round && state.dumpNodes < expected && secondsSince(start) < timeoutS) {
      if (secondsSince(lastNew) >= kDumpQuietS) break;
      ::usleep(100 * 1000);
      state = parseRendezvousAnswer(request(getRequest.dump(), 10), where());
      if (state.dumpNodes > seen) {
        seen = state.dumpNodes;
        lastNew = Clock::now();
      }
    }
    if (!state.error.empty()) throw Error(state.error);
    all = std::move(state.dumps);
    if (othersFailed) *othersFailed = std::max<int64_t>(0, state.dumpNodes - sentBefore - (sentBeforeMyself ? 0 : 1));
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
    RendezvousAnswer state = parseRendezvousAnswer(request(finishedRequest.dump(), 5), where());
    if (!hostsServer()) return;
    const auto start = Clock::now();
    const json pollRequest = {{"op", "poll"}, {"run_id", options_.runId}, {"node", nodeId_}};
    while (state.error.empty() && state.finished < static_cast<int64_t>(state.nodes.size()) &&
           secondsSince(start) < timeoutS) {
      ::usleep(100 * 1000);
      state = parseRendezvousAnswer(request(pollRequest.dump(), 5), where());
    }
  } catch (const std::exception& e) {
    TLOG_WARN("tessera-run: " << e.what());
  }
}

}  // namespace tessera::distributed
