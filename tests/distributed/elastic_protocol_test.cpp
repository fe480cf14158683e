// The elastic rendezvous's server side (distributed/elastic_protocol.h): every request
// field checked where it enters, a bad request answered with an error naming the field
// and changing nothing; and the server's sockets, where idle or slow peers hold only
// their own connection, not the launchers' answers.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/errors.h"
#include "distributed/elastic_protocol.h"
#include "distributed/elastic_rendezvous.h"
#include "distributed/launcher.h"

namespace tessera::distributed {
namespace {

using nlohmann::json;

ElasticOptions options() {
  ElasticOptions o;
  o.runId = "proto";
  o.host = "127.0.0.1";
  o.minNodes = 1;
  o.maxNodes = 2;
  o.joinTimeoutS = 60;
  o.lastCallS = 60;
  o.quiet = true;
  return o;
}

json join(const std::string& node) {
  return {{"op", "join"}, {"run_id", "proto"}, {"node", node}, {"store_port", 29500},
          {"nproc", 2},   {"min_nodes", 1},    {"max_nodes", 2}};
}

json answerOf(RendezvousState& state, const std::string& line) { return json::parse(state.answer(line, "10.0.0.9")); }

TEST(ElasticProtocolTest, BadRequestsAreAnsweredWithTheFieldAndChangeNothing) {
  RendezvousState state(options());
  struct Case {
    std::string name;
    std::string line;
    std::string expected;
  };
  auto with = [](json j, const char* key, json value) {
    if (value.is_null()) {
      j.erase(key);
    } else {
      j[key] = value;
    }
    return j.dump();
  };
  const std::vector<Case> cases = {
      {"junk", "GET / HTTP/1.1", "not a JSON object"},
      {"array", "[1, 2]", "not a JSON object"},
      {"no op", with(join("a"), "op", nullptr), "lacks a string 'op'"},
      {"op of another type", with(join("a"), "op", 7), "lacks a string 'op'"},
      {"unknown op", with(join("a"), "op", "leave"), "unknown request 'leave'"},
      {"no run id", with(join("a"), "run_id", nullptr), "lacks a string 'run_id'"},
      {"another run", with(join("a"), "run_id", "other"), "belongs to run id 'proto', not 'other'"},
      {"empty node", with(join("a"), "node", ""), "'node' is not 1 to 256 printable"},
      {"node with a newline", with(join("a"), "node", "a\nb"), "'node' is not 1 to 256 printable"},
      {"store port 0", with(join("a"), "store_port", 0), "'store_port' is 0, outside [1, 65535]"},
      {"store port text", with(join("a"), "store_port", "29500"), "lacks an integer 'store_port'"},
      {"nproc 0", with(join("a"), "nproc", 0), "'nproc' is 0"},
      {"no min_nodes", with(join("a"), "min_nodes", nullptr), "lacks an integer 'min_nodes'"},
      {"other nnodes", with(join("a"), "max_nodes", 4), "--nnodes must be the same on every node"},
      {"round -1", json({{"op", "finished"}, {"run_id", "proto"}, {"node", "a"}, {"round", -1}}).dump(), "'round' is -1"},
      {"dumps not an object",
       json({{"op", "put_dumps"}, {"run_id", "proto"}, {"node", "a"}, {"round", 1}, {"files", "x"}}).dump(),
       "'files' is not an object"},
      {"a dump not text",
       json({{"op", "put_dumps"}, {"run_id", "proto"}, {"node", "a"}, {"round", 1}, {"files", {{"rank_0.json", 5}}}})
           .dump(),
       "'files' holds a value that is not a string"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const json answer = answerOf(state, c.line);
    ASSERT_TRUE(answer.contains("error")) << answer.dump();
    EXPECT_NE(answer.at("error").get<std::string>().find(c.expected), std::string::npos) << answer.dump();
  }
  // Nothing of it changed the state: no round was opened, no node joined.
  const json poll = answerOf(state, json({{"op", "poll"}, {"run_id", "proto"}, {"node", "a"}}).dump());
  EXPECT_EQ(poll.at("round"), 0) << poll.dump();
  EXPECT_TRUE(poll.at("nodes").empty()) << poll.dump();
  // The well-formed join is taken, and its answer is one the client accepts.
  const std::string joined = state.answer(join("a").dump(), "10.0.0.9");
  const RendezvousAnswer a = parseRendezvousAnswer(joined, "test");
  EXPECT_TRUE(a.error.empty()) << joined;
  EXPECT_EQ(a.round, 1);
  ASSERT_EQ(a.nodes.size(), 1u);
  EXPECT_EQ(a.nodes[0].host, "10.0.0.9");
  EXPECT_EQ(a.nodeRank, 0);
  // A node that sends no dumps (the fuzz target's first find: the round's set was null, an
  // answer its own launchers refused).
  state.answer(json({{"op", "put_dumps"}, {"run_id", "proto"}, {"node", "a"}, {"round", 1}}).dump(), "10.0.0.9");
  const RendezvousAnswer dumps = parseRendezvousAnswer(
      state.answer(json({{"op", "get_dumps"}, {"run_id", "proto"}, {"node", "a"}, {"round", 1}}).dump(), "10.0.0.9"),
      "test");
  EXPECT_EQ(dumps.dumpNodes, 1);
  EXPECT_TRUE(dumps.dumps.empty());
  // Bytes that are not UTF-8, echoed in an error, still make a JSON answer.
  const json binary = answerOf(state, "{\"op\": \"\xff\xfe\", \"run_id\": \"proto\", \"node\": \"a\"}");
  EXPECT_TRUE(binary.contains("error")) << binary.dump();
}

// A client connection that sends nothing.
int idleConnection(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  return fd;
}

json joinOf3(const std::string& node) {
  json j = join(node);
  j["max_nodes"] = 3;
  return j;
}

json poll(const std::string& node) { return {{"op", "poll"}, {"run_id", "proto"}, {"node", node}}; }

// A round after the first closes once every member of the round before that was heard from
// in the last 1.2 s has joined it: a lost node (silent) is not waited for (the last call is
// 60 s here); a live one is, even when the others are in.
TEST(ElasticProtocolTest, ALaterRoundClosesWhenTheLastRoundsLiveNodesJoined) {
  ElasticOptions o = options();
  o.maxNodes = 3;
  RendezvousState state(o);
  for (const char* node : {"a", "b", "c"}) answerOf(state, joinOf3(node).dump());
  json round1 = answerOf(state, poll("a").dump());
  ASSERT_FALSE(round1.at("open").get<bool>()) << round1;  // MAX nodes: closed at once
  ASSERT_EQ(round1.at("round").get<int>(), 1);
  // c is lost: a and b keep asking, c says nothing for longer than 1.2 s.
  for (int i = 0; i < 8; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    answerOf(state, poll("a").dump());
    answerOf(state, poll("b").dump());
  }
  answerOf(state, joinOf3("a").dump());  // a's ranks failed: it opens round 2
  json round2 = answerOf(state, poll("a").dump());
  EXPECT_TRUE(round2.at("open").get<bool>()) << round2;  // b, alive, is waited for
  round2 = answerOf(state, joinOf3("b").dump());
  EXPECT_EQ(round2.at("round").get<int>(), 2);
  EXPECT_FALSE(round2.at("open").get<bool>()) << round2;  // closed without c, 60 s early
  EXPECT_TRUE(round2.at("closed_by_quorum").get<bool>()) << round2;
  EXPECT_EQ(round2.at("nodes").size(), 2u) << round2;
  // Round 3 opened while every member of round 2 was just heard: it waits for both.
  answerOf(state, joinOf3("b").dump());
  json round3 = answerOf(state, poll("b").dump());
  EXPECT_EQ(round3.at("round").get<int>(), 3);
  EXPECT_TRUE(round3.at("open").get<bool>()) << round3;
  round3 = answerOf(state, joinOf3("a").dump());
  EXPECT_FALSE(round3.at("open").get<bool>()) << round3;
  EXPECT_TRUE(round3.at("closed_by_quorum").get<bool>()) << round3;
}

// Eight connections that send nothing and one that sends half a request: each holds its
// own connection for at most 5 s, while the launcher's join is answered at once (the
// server used to serve one connection at a time, 5 s each: 45 s here, past the join's
// 10 s request timeout).
TEST(ElasticProtocolTest, IdleConnectionsDoNotStallTheServer) {
  ElasticOptions o = options();
  o.port = pickFreePort("127.0.0.1");
  o.maxNodes = 1;
  ElasticRendezvous host(o, 2);
  ASSERT_TRUE(host.hostsServer());
  std::vector<int> idle;
  for (int i = 0; i < 8; ++i) idle.push_back(idleConnection(o.port));
  const int half = idleConnection(o.port);
  const std::string part = R"({"op": "poll", "run_id": "pr)";
  ASSERT_EQ(::send(half, part.data(), part.size(), MSG_NOSIGNAL), static_cast<ssize_t>(part.size()));
  const auto start = std::chrono::steady_clock::now();
  const ElasticRound round = host.join([] { return false; });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(round.nodeRank, 0);
  EXPECT_LT(seconds, 4.0) << "the join waited behind the idle connections";
  for (const int fd : idle) ::close(fd);
  ::close(half);
}

}  // namespace
}  // namespace tessera::distributed
