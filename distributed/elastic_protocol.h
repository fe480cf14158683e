// The elastic rendezvous's messages and the server's state machine, apart from the
// sockets (elastic_rendezvous.cpp) so that both can be read, tested and fuzzed alone.
//
// One JSON object per line. A request: {"op", "run_id", "node", ...}; op is join (with
// store_port, nproc, min_nodes, max_nodes), poll, finished (round), put_dumps (round,
// files) or get_dumps (round). An answer: the round's state {"round", "open", "failed",
// "nodes", "node_rank", "waiting", "finished", "closed_by_quorum"} (get_dumps adds "dumps",
// "dump_nodes"), or
// {"error": "..."}. Both sides check every field where it enters: a request or an answer
// that is not one is refused with a message naming the field, never trusted.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "distributed/elastic_rendezvous.h"

namespace tessera::distributed {

// The longest line either side reads: requests carry flight-recorder dumps (about 100
// bytes per collective remembered).
constexpr size_t kMaxRendezvousLineBytes = size_t{64} << 20;

// The rendezvous state of one run, as the server keeps it. Not thread-safe (the server's
// one thread calls it).
class RendezvousState {
 public:
  explicit RendezvousState(ElasticOptions options);
  ~RendezvousState();
  RendezvousState(const RendezvousState&) = delete;
  RendezvousState& operator=(const RendezvousState&) = delete;

  // The answer (one JSON line, without its newline) to request line `line` from a peer at
  // `peerHost`. Never throws: a request that is not one is answered {"error": ...} naming
  // what is wrong, and changes nothing.
  std::string answer(const std::string& line, const std::string& peerHost);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// An answer of the server, checked: every field present with its type and range. A
// stale or foreign process may hold the port, so an answer is input like any other.
struct RendezvousAnswer {
  std::string error;            // the server's refusal; the other fields are unset when set
  int64_t round = 0;
  bool open = false;
  std::string failed;           // why the round failed ("" when it did not)
  int nodeRank = -1;            // this node's index in `nodes`; -1: not a member
  std::vector<ElasticNode> nodes;
  int64_t waiting = 0;          // nodes waiting for the next round
  int64_t finished = 0;         // nodes whose workers finished the round
  int64_t dumpNodes = 0;        // get_dumps: nodes that sent their flight dumps
  bool closedByQuorum = false;  // the round closed when every live node of the last one joined
  std::map<std::string, std::string> dumps;  // get_dumps: file name -> text
};

// Parses and checks answer line `text`; tessera::Error "<where>: ..." naming the field.
RendezvousAnswer parseRendezvousAnswer(const std::string& text, const std::string& where);

// The round a closed answer describes, checked against what this launcher is: between
// MIN and MAX nodes, this node at node_rank with its own --nproc-per-node.
ElasticRound closedRound(const RendezvousAnswer& answer, const std::string& where, const ElasticOptions& options,
                         const std::string& nodeId, int nproc);

}  // namespace tessera::distributed
