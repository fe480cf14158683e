// Elastic rendezvous of tessera-run launchers (`--nnodes MIN:MAX --rdzv-endpoint HOST:PORT`),
// torchrun's c10d rendezvous in spirit: the launchers meet at HOST:PORT, where the launcher
// that can bind it hosts a small server (a thread); each round gathers between MIN and MAX
// nodes, gives each a node rank in the order they joined, and names the master (node 0's
// address and a port it reserved) whose rank 0 hosts the workers' store.
//
// Rounds: the first join opens round 1. A round closes when MAX nodes joined, or, once MIN
// have, after the last-call window (more nodes may still come); with fewer than MIN after
// the join timeout it fails. A later round also closes, without the last call, once every
// member of the round before that the server heard from in the second before it opened
// (the live ones: a lost node's launcher is silent) has joined it. While a round runs, a member that wants a new one (its workers
// failed) opens the next round by joining again; the other members see it in their polls,
// stop their workers and join it, and a node that is gone never does, so the next round
// closes without it. A node that joins while a round runs waits for the next one, which
// the members open for it as soon as they see it waiting (when the round has room).
//
// The server lives in the launcher that hosts it: when that launcher is gone, so is the
// rendezvous (as with torchrun's c10d backend, whose store is in one agent).
//
// Wire format: one JSON object per line, one request and one answer per TCP connection
// (elastic_protocol.h). Pure POSIX + C++17 + nlohmann-json (no LibTorch): tessera-run
// compiles it in.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace tessera::distributed {

struct ElasticOptions {
  std::string runId = "none";  // --rdzv-id: launchers of another run are refused
  std::string host;            // --rdzv-endpoint HOST:PORT
  int port = 29400;
  int minNodes = 1;
  int maxNodes = 1;
  double joinTimeoutS = 900;   // --rdzv-timeout, --rdzv-conf join_timeout: MIN nodes must arrive in time
  double lastCallS = 30;       // --rdzv-conf last_call_timeout: how long a round with MIN nodes waits for more
  bool quiet = false;          // no log line when this launcher hosts it (a static run's dump exchange)
};

struct ElasticNode {
  std::string id;    // unique per launcher process
  std::string host;  // its address as the server saw it: where its rank 0 would host the store
  int storePort = 0; // a port it reserved for that store
  int nproc = 1;
};

struct ElasticRound {
  int64_t round = 0;
  int nodeRank = 0;                 // this launcher's index in `nodes`
  std::vector<ElasticNode> nodes;   // in node-rank order
  bool closedByQuorum = false;      // closed once every node still alive from the last round joined
  int worldSize() const;
  const ElasticNode& master() const { return nodes.front(); }
};

// One launcher's side of the rendezvous (and the server, when this launcher can bind the
// endpoint). Not thread-safe: the launcher's one thread calls it.
class ElasticRendezvous {
 public:
  ElasticRendezvous(ElasticOptions options, int nproc);
  ~ElasticRendezvous();
  ElasticRendezvous(const ElasticRendezvous&) = delete;
  ElasticRendezvous& operator=(const ElasticRendezvous&) = delete;

  bool hostsServer() const { return server_ != nullptr; }

  // Joins the next round (the first, or the one after `previous`) and waits until it
  // closes. `interrupted` is polled while waiting (a signal to the launcher). Throws
  // TimeoutError when fewer than MIN nodes came within the join timeout, Error when the
  // server is unreachable or refuses (another run id, another --nproc-per-node).
  ElasticRound join(const std::function<bool()>& interrupted);
  // While round `round` runs: true when this launcher must stop its workers and join
  // again (a newer round is open, or a node waits and the round has room). Cheap (one
  // request); an unreachable server answers false and is logged once.
  bool restartWanted(int64_t round);
  // After a failure in round `round`: sends this node's flight-recorder dumps (file name ->
  // text) and returns every node's that reached the server within `timeoutS` (a node that
  // is gone sends none), this node's included; it waits for `expectedNodes` senders (0:
  // the round's nodes), and stops once no further node has sent for 1.5 s
  // (elastic_rendezvous.cpp): the nodes a failure reaches fail together, and a lost node (or,
  // under fault.survive, a live one that never fails) would otherwise cost every restart the
  // whole timeout. Never throws (a warning instead). Static multi-node runs use it too, on a
  // server of their own (round 0, no joins).
  // `othersFailed` (when given) gets how many other nodes sent theirs since this one's
  // failure began (-1 when the server did not answer): in an elastic round, the nodes whose
  // ranks failed with this node's. 0 means they went on (fault.survive) or have not noticed
  // yet; the launcher restarts its ranks into the running round then (launcher.cpp).
  std::map<std::string, std::string> exchangeDumps(int64_t round, const std::map<std::string, std::string>& mine,
                                                   double timeoutS, int expectedNodes = 0,
                                                   int64_t* othersFailed = nullptr);
  // This node's workers finished round `round`. The server's host then waits (up to
  // `timeoutS`) until every node of the round has said so, so that none loses the server
  // before it has heard the round is over.
  void finished(int64_t round, double timeoutS);

  class Server;

 private:
  std::string request(const std::string& line, double timeoutS);
  std::string where() const;  // "rendezvous server at HOST:PORT", for messages

  ElasticOptions options_;
  int nproc_;
  std::string nodeId_;
  std::unique_ptr<Server> server_;
  bool warnedUnreachable_ = false;
  std::set<int64_t> dumpedRounds_;  // rounds this launcher sent its dumps for
};

}  // namespace tessera::distributed
