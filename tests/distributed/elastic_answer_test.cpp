// The elastic rendezvous client against a server that answers wrongly (a stale or foreign
// process on the port, a crafted reply): every answer is refused with an Error naming the
// server and the field, before any rank would start — never a crash, a raw JSON exception
// or a rank for a node that does not exist. And a launcher with other --nnodes is refused
// by a real server.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/errors.h"
#include "distributed/elastic_rendezvous.h"

namespace tessera::distributed {
namespace {

// Listens on a free local port and answers every request line with `answer(request)`.
class FakeServer {
 public:
  explicit FakeServer(std::function<std::string(const nlohmann::json&)> answer) : answer_(std::move(answer)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    EXPECT_EQ(::listen(fd_, 16), 0);
    socklen_t length = sizeof addr;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &length);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~FakeServer() {
    stop_ = true;
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    thread_.join();
  }
  int port() const { return port_; }

 private:
  void serve() {
    while (!stop_) {
      const int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      std::string line;
      char ch = 0;
      while (::read(c, &ch, 1) == 1 && ch != '\n') line += ch;
      nlohmann::json request;
      try {
        request = nlohmann::json::parse(line);
      } catch (...) {
      }
      const std::string reply = answer_(request) + "\n";
      [[maybe_unused]] const ssize_t n = ::write(c, reply.data(), reply.size());
      ::close(c);
    }
  }
  std::function<std::string(const nlohmann::json&)> answer_;
  int fd_ = -1, port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

ElasticOptions optionsFor(int port) {
  ElasticOptions o;
  o.runId = "answers";
  o.host = "127.0.0.1";
  o.port = port;
  o.minNodes = 1;
  o.maxNodes = 2;
  o.joinTimeoutS = 2;
  o.lastCallS = 1;
  o.quiet = true;
  return o;
}

// The join's error for a server that answers every request with `reply(request)`.
std::string joinError(const std::function<std::string(const nlohmann::json&)>& reply) {
  FakeServer server(reply);
  ElasticRendezvous client(optionsFor(server.port()), 2);
  EXPECT_FALSE(client.hostsServer());
  try {
    client.join([] { return false; });
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "the join was accepted";
  return "";
}

// A closed round holding the joining node (its id from the request) and `nodes` otherwise.
nlohmann::json closedRound(const nlohmann::json& request, nlohmann::json nodes, int nodeRank) {
  for (auto& n : nodes) {
    if (n.is_object() && n.value("id", "") == "ME") n["id"] = request.value("node", "");
  }
  return {{"open", false}, {"round", 1}, {"node_rank", nodeRank}, {"nodes", nodes}, {"waiting", 0}};
}

nlohmann::json me() { return {{"id", "ME"}, {"host", "10.0.0.1"}, {"store_port", 29500}, {"nproc", 2}}; }

TEST(ElasticAnswerTest, WrongAnswersAreRefusedNamingTheField) {
  struct Case {
    std::string name;
    std::function<std::string(const nlohmann::json&)> reply;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"junk", [](const nlohmann::json&) { return std::string("HTTP/1.1 400 Bad Request"); }, "not a rendezvous answer"},
      {"not an object", [](const nlohmann::json&) { return std::string("[1, 2]"); }, "not a rendezvous answer"},
      {"no fields", [](const nlohmann::json&) { return std::string("{}"); }, "lacks a boolean 'open'"},
      {"empty nodes", [](const nlohmann::json& r) { return closedRound(r, nlohmann::json::array(), 0).dump(); },
       "has 0 nodes"},
      {"node rank outside", [](const nlohmann::json& r) { return closedRound(r, {me()}, 5).dump(); }, "'node_rank' is 5"},
      {"port 0", [](const nlohmann::json& r) {
         nlohmann::json n = me();
         n["store_port"] = 0;
         return closedRound(r, {n}, 0).dump();
       }, "'store_port' is 0"},
      {"empty host", [](const nlohmann::json& r) {
         nlohmann::json n = me();
         n["host"] = "";
         return closedRound(r, {n}, 0).dump();
       }, "'host' is not 1 to 256"},
      {"another node at my rank", [](const nlohmann::json& r) {
         nlohmann::json n = me();
         n["id"] = "someone-else";
         return closedRound(r, {n}, 0).dump();
       }, "puts another node"},
      {"too many nodes", [](const nlohmann::json& r) {
         nlohmann::json a = me(), b = me(), c = me();
         b["id"] = "b";
         c["id"] = "c";
         return closedRound(r, {a, b, c}, 0).dump();
       }, "has 3 nodes, this run has 1 to 2"},
      {"a node twice", [](const nlohmann::json& r) { return closedRound(r, {me(), me()}, 0).dump(); }, "names a node twice"},
      {"error of another type", [](const nlohmann::json&) { return std::string(R"({"error": 7})"); }, "rendezvous: 7"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string error = joinError(c.reply);
    EXPECT_NE(error.find(c.expected), std::string::npos) << error;
  }
  // The well-formed answer is accepted (the check is not refusing everything).
  FakeServer good([](const nlohmann::json& r) { return closedRound(r, {me()}, 0).dump(); });
  ElasticRendezvous client(optionsFor(good.port()), 2);
  const ElasticRound round = client.join([] { return false; });
  EXPECT_EQ(round.nodeRank, 0);
  EXPECT_EQ(round.worldSize(), 2);
}

TEST(ElasticAnswerTest, ALauncherWithOtherNnodesIsRefused) {
  // A real server (the first launcher binds the port), 1 to 2 nodes; a second launcher
  // asking for 3 to 4 is told so instead of being counted in the round.
  ElasticOptions hostOptions = optionsFor(0);
  // Find a free port for the real server: bind 0, read it, release it.
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  socklen_t length = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length);
  ::close(fd);
  hostOptions.port = ntohs(addr.sin_port);
  ElasticRendezvous host(hostOptions, 2);
  ASSERT_TRUE(host.hostsServer());
  ElasticOptions other = hostOptions;
  other.minNodes = 3;
  other.maxNodes = 4;
  ElasticRendezvous stranger(other, 2);
  try {
    stranger.join([] { return false; });
    ADD_FAILURE() << "joined a round of other --nnodes";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--nnodes must be the same on every node"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera::distributed
