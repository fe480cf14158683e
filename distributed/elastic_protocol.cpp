// The elastic rendezvous's messages, checked on both sides, and the server's rounds (see
// elastic_protocol.h and, for the rounds, elastic_rendezvous.h).
#include "distributed/elastic_protocol.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <utility>

#include "common/clock.h"
#include "common/errors.h"
#include "common/limits.h"

namespace tessera::distributed {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr size_t kMaxDumpBytesPerRound = size_t{256} << 20;
// A member of the last round is alive when the server heard from it this recently as the
// next round opened: a launcher asks every 0.5-1.0 s while its ranks run (launcher.cpp),
// and one whose ranks failed sends its dumps (every 100 ms) before it joins. The round
// opens at least 1.5 s after a lost node's last request (the failed launchers' dump
// exchange waits that long for it), so a lost node falls outside.
constexpr double kAliveWithinS = 1.2;


// Field readers shared by requests and answers: `where` names the message ("request",
// "rendezvous server at H:P: its answer"), the error names the field.
int64_t intField(const json& j, const char* key, int64_t lo, int64_t hi, const std::string& where) {
  if (!j.contains(key) || !j.at(key).is_number_integer()) throw Error(strCat(where, " lacks an integer '", key, "'"));
  const int64_t v = j.at(key).get<int64_t>();
  if (v < lo || v > hi) throw Error(strCat(where, "'s '", key, "' is ", v, ", outside [", lo, ", ", hi, "]"));
  return v;
}

int64_t optionalIntField(const json& j, const char* key, int64_t lo, int64_t hi, const std::string& where) {
  return j.contains(key) ? intField(j, key, lo, hi, where) : 0;
}

// A name, host or id: 1 to 256 printable characters without spaces.
std::string nameField(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || !j.at(key).is_string()) throw Error(strCat(where, " lacks a string '", key, "'"));
  std::string v = j.at(key).get<std::string>();
  const bool printable = std::all_of(v.begin(), v.end(), [](char c) { return c > ' ' && c < 127; });
  if (v.empty() || v.size() > 256 || !printable) {
    throw Error(strCat(where, "'s '", key, "' is not 1 to 256 printable characters without spaces"));
  }
  return v;
}

std::string stringField(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || !j.at(key).is_string()) throw Error(strCat(where, " lacks a string '", key, "'"));
  return j.at(key).get<std::string>();
}

bool boolField(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || !j.at(key).is_boolean()) throw Error(strCat(where, " lacks a boolean '", key, "'"));
  return j.at(key).get<bool>();
}

// A JSON object of strings (flight dumps: file name -> text).
std::map<std::string, std::string> stringsField(const json& j, const char* key, const std::string& where) {
  std::map<std::string, std::string> out;
  if (!j.contains(key)) return out;
  if (!j.at(key).is_object()) throw Error(strCat(where, "'s '", key, "' is not an object"));
  for (const auto& [name, text] : j.at(key).items()) {
    if (!text.is_string()) throw Error(strCat(where, "'s '", key, "' holds a value that is not a string"));
    out[name] = text.get<std::string>();
  }
  return out;
}

json parseObject(const std::string& text, const std::string& where, const char* what) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(strCat(where, ": ", what, " (", e.what(), ")"));
  }
  if (!j.is_object()) throw Error(strCat(where, ": ", what, " (a JSON ", j.type_name(), ")"));
  return j;
}

json nodeJson(const ElasticNode& n) {
  return {{"id", n.id}, {"host", n.host}, {"store_port", n.storePort}, {"nproc", n.nproc}};
}

ElasticNode nodeFromJson(const json& j, const std::string& where) {
  if (!j.is_object()) throw Error(strCat(where, ": a node of its answer is not an object"));
  ElasticNode n;
  n.id = nameField(j, "id", where);
  n.host = nameField(j, "host", where);
  n.storePort = static_cast<int>(intField(j, "store_port", 1, 65535, where));
  n.nproc = static_cast<int>(intField(j, "nproc", 1, kMaxLocalRanks, where));
  return n;
}

}  // namespace

// ---- The server's side ----

struct RendezvousState::Impl {
  ElasticOptions options;
  int64_t round = 0;
  bool open = false;
  std::string failed;  // why the last round failed ("" when it did not)
  int nproc = 0;
  std::vector<ElasticNode> members;
  std::vector<ElasticNode> waiting;
  std::set<std::string> finished;
  std::map<int64_t, json> dumps;                       // round -> {file name: text}
  std::map<int64_t, std::set<std::string>> dumpNodes;  // round -> nodes that sent theirs
  size_t dumpBytes = 0;
  Clock::time_point openedAt, minReachedAt;
  bool minReached = false;
  std::map<std::string, Clock::time_point> heard;  // node -> its last request
  // The quorum of a round after the first: the last round's members still alive when it
  // opened (kAliveWithinS). Once all of them (and MIN nodes) joined it closes, without the
  // last call: the nodes that are lost will not come, and one that comes later is admitted
  // at a restart the members make for it.
  std::set<std::string> quorum;
  bool closedByQuorum = false;

  json handle(const json& request, const std::string& peerHost);
  bool isMember(const std::string& id) const {
    return std::any_of(members.begin(), members.end(), [&](const ElasticNode& n) { return n.id == id; });
  }
  void join(const ElasticNode& n);
  void putDumps(int64_t forRound, const std::string& node, const std::map<std::string, std::string>& files);
  void openRound(std::vector<ElasticNode> first);
  void afterJoin();
  void tick();
  json state(const std::string& node) const;
};

RendezvousState::RendezvousState(ElasticOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
}

RendezvousState::~RendezvousState() = default;

std::string RendezvousState::answer(const std::string& line, const std::string& peerHost) {
  try {
    // Replace: a request's bytes (echoed in an error) need not be UTF-8.
    return impl_->handle(parseObject(line, "request", "not a JSON object"), peerHost)
        .dump(-1, ' ', false, json::error_handler_t::replace);
  } catch (const std::exception& e) {
    return json({{"error", strCat("bad request: ", e.what())}}).dump(-1, ' ', false, json::error_handler_t::replace);
  }
}

json RendezvousState::Impl::handle(const json& request, const std::string& peerHost) {
  const std::string where = "request";
  const std::string op = stringField(request, "op", where);
  const std::string runId = stringField(request, "run_id", where);
  if (runId != options.runId) {
    return {{"error", strCat("this rendezvous belongs to run id '", options.runId, "', not '", runId.substr(0, 256),
                             "' (--rdzv-id)")}};
  }
  const std::string node = nameField(request, "node", where);
  if (heard.size() < static_cast<size_t>(2 * kMaxWorldSize) || heard.count(node)) heard[node] = Clock::now();
  tick();
  if (op == "join") {
    ElasticNode n;
    n.id = node;
    n.host = peerHost;
    n.storePort = static_cast<int>(intField(request, "store_port", 1, 65535, where));
    n.nproc = static_cast<int>(intField(request, "nproc", 1, kMaxLocalRanks, where));
    // A launcher started with other --nnodes would count the round otherwise.
    const int64_t minNodes = intField(request, "min_nodes", 1, kMaxWorldSize, where);
    const int64_t maxNodes = intField(request, "max_nodes", 1, kMaxWorldSize, where);
    if (minNodes != options.minNodes || maxNodes != options.maxNodes) {
      return {{"error", strCat("this rendezvous is for ", options.minNodes, " to ", options.maxNodes,
                               " nodes, this launcher asks for ", minNodes, " to ", maxNodes,
                               " (--nnodes must be the same on every node)")}};
    }
    if (nproc == 0) nproc = n.nproc;
    if (n.nproc != nproc) {
      return {{"error", strCat("this node starts ", n.nproc, " ranks but the others ", nproc,
                               " (--nproc-per-node must be the same on every node)")}};
    }
    join(n);
  } else if (op == "finished") {
    if (intField(request, "round", 0, kMaxCounter, where) == round) finished.insert(node);
  } else if (op == "put_dumps") {
    putDumps(intField(request, "round", 0, kMaxCounter, where), node, stringsField(request, "files", where));
  } else if (op == "get_dumps") {
    const int64_t forRound = intField(request, "round", 0, kMaxCounter, where);
    json answer = state(node);
    const auto it = dumps.find(forRound);
    answer["dumps"] = it == dumps.end() ? json::object() : it->second;
    answer["dump_nodes"] = it == dumps.end() ? 0 : dumpNodes[it->first].size();
    return answer;
  } else if (op != "poll") {
    return {{"error", strCat("unknown request '", op.substr(0, 64), "' (join, poll, finished, put_dumps, get_dumps)")}};
  }
  return state(node);
}

void RendezvousState::Impl::join(const ElasticNode& n) {
  if (round == 0 || (!open && !failed.empty())) {
    openRound({n});
    return;
  }
  if (open) {
    auto it = std::find_if(members.begin(), members.end(), [&](const ElasticNode& m) { return m.id == n.id; });
    if (it != members.end()) {
      *it = n;  // joined again (a new store port)
    } else {
      members.push_back(n);
    }
    afterJoin();
    return;
  }
  // A round runs. One of its members asks for the next: open it. Anyone else waits for it.
  if (isMember(n.id)) {
    openRound({n});
  } else if (std::none_of(waiting.begin(), waiting.end(), [&](const ElasticNode& w) { return w.id == n.id; }) &&
             static_cast<int64_t>(waiting.size()) < options.maxNodes) {
    waiting.push_back(n);
  }
}

// A node's flight-recorder dumps of `forRound` (file name -> text), kept for the others'
// verdicts; only the latest rounds', within a bound.
void RendezvousState::Impl::putDumps(int64_t forRound, const std::string& node,
                                     const std::map<std::string, std::string>& files) {
  json& all = dumps[forRound];
  if (all.is_null()) all = json::object();  // a node with no dumps: an empty set, not null
  for (const auto& [name, text] : files) {
    if (dumpBytes + text.size() > kMaxDumpBytesPerRound) break;
    dumpBytes += text.size();
    all[name] = text;
  }
  dumpNodes[forRound].insert(node);
  while (dumps.size() > 2) {  // the rounds before are long over
    dumpBytes = 0;
    dumpNodes.erase(dumps.begin()->first);
    dumps.erase(dumps.begin());
  }
}

void RendezvousState::Impl::openRound(std::vector<ElasticNode> first) {
  quorum.clear();
  if (round > 0 && failed.empty()) {
    for (const ElasticNode& m : members) {
      const auto it = heard.find(m.id);
      if (it != heard.end() && secondsSince(it->second) <= kAliveWithinS) quorum.insert(m.id);
    }
  }
  closedByQuorum = false;
  ++round;
  open = true;
  failed.clear();
  finished.clear();
  members = std::move(first);
  for (const ElasticNode& w : waiting) {
    if (!isMember(w.id)) members.push_back(w);
  }
  waiting.clear();
  openedAt = Clock::now();
  minReached = false;
  afterJoin();
}

void RendezvousState::Impl::afterJoin() {
  if (!minReached && static_cast<int>(members.size()) >= options.minNodes) {
    minReached = true;
    minReachedAt = Clock::now();
  }
  if (static_cast<int>(members.size()) >= options.maxNodes) open = false;
  if (open && minReached && !quorum.empty() &&
      std::all_of(quorum.begin(), quorum.end(), [&](const std::string& id) { return isMember(id); })) {
    open = false;
    closedByQuorum = true;
  }
}

// Closes or fails the open round when its time has come.
void RendezvousState::Impl::tick() {
  if (!open) return;
  if (minReached && secondsSince(minReachedAt) >= options.lastCallS) {
    open = false;
  } else if (!minReached && secondsSince(openedAt) >= options.joinTimeoutS) {
    open = false;
    failed = strCat("only ", members.size(), " of at least ", options.minNodes, " nodes joined round ", round,
                    " within ", options.joinTimeoutS, " s");
  }
}

json RendezvousState::Impl::state(const std::string& node) const {
  json nodes = json::array();
  int nodeRank = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    nodes.push_back(nodeJson(members[i]));
    if (members[i].id == node) nodeRank = static_cast<int>(i);
  }
  return {{"round", round},  {"open", open},         {"failed", failed},
          {"nodes", nodes},  {"node_rank", nodeRank}, {"waiting", waiting.size()},
          {"finished", finished.size()}, {"closed_by_quorum", closedByQuorum}};
}

// ---- The launcher's side ----

RendezvousAnswer parseRendezvousAnswer(const std::string& text, const std::string& where) {
  const json j = parseObject(text, where, "its answer is not a rendezvous answer");
  RendezvousAnswer a;
  if (j.contains("error")) {
    const json& error = j.at("error");
    a.error = error.is_string() ? error.get<std::string>() : error.dump();
    if (a.error.size() > 4096) a.error = a.error.substr(0, 4096) + " [...]";
    return a;
  }
  const std::string field = strCat(where, ": its answer");
  a.open = boolField(j, "open", field);
  a.round = intField(j, "round", 0, kMaxCounter, field);
  if (j.contains("failed")) a.failed = stringField(j, "failed", field).substr(0, 4096);
  if (!j.contains("nodes") || !j.at("nodes").is_array()) throw Error(strCat(field, " lacks 'nodes'"));
  const json& nodes = j.at("nodes");
  if (nodes.size() > static_cast<size_t>(kMaxWorldSize)) throw Error(strCat(field, " has ", nodes.size(), " nodes"));
  std::set<std::string> ids;
  for (const json& n : nodes) {
    a.nodes.push_back(nodeFromJson(n, field));
    if (!ids.insert(a.nodes.back().id).second) throw Error(strCat(field, " names a node twice"));
  }
  // Checked against the nodes where it is used (closedRound): a round's nodes may still be few.
  a.nodeRank = static_cast<int>(intField(j, "node_rank", -1, kMaxWorldSize, field));
  a.waiting = optionalIntField(j, "waiting", 0, kMaxWorldSize, field);
  a.finished = optionalIntField(j, "finished", 0, kMaxWorldSize, field);
  a.dumpNodes = optionalIntField(j, "dump_nodes", 0, kMaxWorldSize, field);
  a.dumps = stringsField(j, "dumps", field);
  a.closedByQuorum = j.contains("closed_by_quorum") && boolField(j, "closed_by_quorum", field);
  return a;
}

ElasticRound closedRound(const RendezvousAnswer& answer, const std::string& where, const ElasticOptions& options,
                         const std::string& nodeId, int nproc) {
  const size_t count = answer.nodes.size();
  if (count < static_cast<size_t>(options.minNodes) || count > static_cast<size_t>(options.maxNodes)) {
    throw Error(strCat(where, ": its answer has ", count, " nodes, this run has ", options.minNodes, " to ",
                       options.maxNodes, " (--nnodes)"));
  }
  if (answer.nodeRank < 0 || static_cast<size_t>(answer.nodeRank) >= count) {
    throw Error(strCat(where, ": its answer's 'node_rank' is ", answer.nodeRank, ", outside [0, ", count - 1, "]"));
  }
  const ElasticNode& me = answer.nodes[static_cast<size_t>(answer.nodeRank)];
  if (me.id != nodeId || me.nproc != nproc) {
    throw Error(strCat(where, ": its answer puts another node (", me.id, ", ", me.nproc, " ranks) at this node's rank ",
                       answer.nodeRank));
  }
  ElasticRound round;
  round.round = answer.round;
  round.nodeRank = answer.nodeRank;
  round.nodes = answer.nodes;
  round.closedByQuorum = answer.closedByQuorum;
  return round;
}

}  // namespace tessera::distributed
