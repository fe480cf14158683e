// Reading the dumps of every rank and finding who is behind, who disagrees, who died
// (see flight_verdict.h).
#include "diagnostics/flight_verdict.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <optional>
#include <regex>
#include <set>

#include "common/errors.h"
#include "common/file_open.h"
#include "common/limits.h"

namespace tessera::diagnostics {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int64_t kMaxDumpBytes = int64_t{256} << 20;

struct Entry {
  int64_t seq = 0;
  std::string op, dtype, tag, state, error;
  int64_t numel = 0, step = 0;
  double issuedAgo = 0, waitAgo = -1;

  bool completed() const { return state == "completed"; }
  // What must agree on every rank.
  std::string signature() const { return strCat(op, " ", dtype, " x", numel); }
};

struct RankRing {
  int64_t nextSeq = 0;
  std::map<int64_t, Entry> entries;
};

struct Group {
  std::string name, backend;
  std::vector<int> members;  // global ranks
  std::map<int, RankRing> rings;  // global rank -> its ring
};

struct Dump {
  int rank = -1;
  std::string reason;
  int64_t step = 0;
  std::vector<std::string> doing;  // per thread: "main: step 5 > forward (micro-batch) for 12.0 s"
};

std::string fixed(double v, int digits = 1) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string rankList(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

std::string describe(const Entry& e) {
  std::string out = strCat("#", e.seq, " ", e.op, " ", e.dtype, " x", e.numel);
  if (!e.tag.empty()) out += strCat(" '", e.tag, "'");
  if (e.step > 0) out += strCat(" at step ", e.step);
  return out;
}

// A dump's text as the verdict prints it: control characters escaped (a tag holding a
// newline would forge a line of the verdict), at most 300 characters.
std::string printable(const std::string& text) {
  std::string out;
  for (const char c : text) {
    if (out.size() >= 300) return out + "...";
    const auto u = static_cast<unsigned char>(c);
    if (c == '\n') {
      out += "\\n";
    } else if (u < 0x20 || u == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", u);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

std::string textField(const json& j, const char* key) { return printable(j.at(key).get<std::string>()); }
std::string textField(const json& j, const char* key, const char* fallback) { return printable(j.value(key, fallback)); }

Entry parseEntry(const json& j) {
  Entry e;
  e.seq = j.at("seq").get<int64_t>();
  e.op = textField(j, "op");
  e.dtype = textField(j, "dtype");
  e.numel = j.at("numel").get<int64_t>();
  e.tag = textField(j, "tag", "");
  e.step = j.value("step", int64_t{0});
  e.state = textField(j, "state");
  e.error = textField(j, "error", "");
  e.issuedAgo = j.value("issued_s_ago", 0.0);
  e.waitAgo = j.value("wait_s_ago", -1.0);
  return e;
}

// Reads one dump into `dumps` and `groups`; throws on anything malformed.
void readDump(const std::string& path, std::map<int, Dump>& dumps, std::map<std::string, Group>& groups) {
  const json j = json::parse(readRegularFile(path, kMaxDumpBytes, LinkPolicy::kRefuse));
  TESSERA_CHECK(j.is_object() && j.value("format", "") == "tessera.flight/1", "not a tessera.flight/1 dump");
  Dump d;
  d.rank = j.at("rank").get<int>();
  TESSERA_CHECK(d.rank >= 0 && d.rank < kMaxWorldSize, "rank ", d.rank, " is not a rank");
  d.reason = textField(j, "reason", "");
  d.step = j.value("step", int64_t{0});
  auto spanPath = [](const std::vector<std::string>& spans) {
    std::string out;
    for (size_t i = 0; i < spans.size(); ++i) out += (i ? " > " : "") + printable(spans[i]);
    return out;
  };
  for (const json& t : j.at("threads")) {
    const auto doing = t.at("doing").get<std::vector<std::string>>();
    const auto failedIn = t.value("failed_in", std::vector<std::string>{});
    if (doing.empty() && failedIn.empty()) continue;
    std::string line = strCat(textField(t, "thread"), ": ");
    if (!doing.empty()) line += spanPath(doing);
    if (t.contains("for_s")) line += strCat(" (for ", fixed(t.at("for_s").get<double>()), " s)");
    if (!failedIn.empty()) line += strCat(doing.empty() ? "" : ", ", "failed in ", spanPath(failedIn));
    d.doing.push_back(line);
  }
  for (const json& g : j.at("groups")) {
    const auto members = g.at("members").get<std::vector<int>>();
    const int groupRank = g.at("rank").get<int>();
    TESSERA_CHECK(groupRank >= 0 && groupRank < static_cast<int>(members.size()), "group rank ", groupRank,
                  " outside its ", members.size(), " members");
    const std::set<int> unique(members.begin(), members.end());
    TESSERA_CHECK(unique.size() == members.size() && *unique.begin() >= 0 && *unique.rbegin() < kMaxWorldSize,
                  "group members must be distinct ranks in [0, ", kMaxWorldSize, ")");
    std::string key = g.at("group").get<std::string>() + "|";
    for (int m : members) key += std::to_string(m) + ",";
    // Everything read before the group enters the map: a field that throws leaves no group
    // half made (one without members crashed the verdict).
    const std::string name = textField(g, "group");
    const std::string backend = textField(g, "backend", "");
    RankRing ring;
    ring.nextSeq = g.at("next_seq").get<int64_t>();
    for (const json& e : g.at("entries")) {
      Entry entry = parseEntry(e);
      ring.entries[entry.seq] = std::move(entry);
    }
    Group& group = groups[key];
    group.name = name;
    group.backend = backend;
    group.members = members;
    group.rings[members[static_cast<size_t>(groupRank)]] = std::move(ring);
  }
  TESSERA_CHECK(dumps.count(d.rank) == 0, "a second dump of rank ", d.rank);
  dumps[d.rank] = std::move(d);
}

std::string groupName(const Group& g) { return strCat("group '", g.name, "' (", g.backend, ")"); }

// The first collective the ranks of `g` disagree on, as a line; nullopt when none.
std::optional<std::string> mismatch(const Group& g) {
  std::set<int64_t> seqs;
  for (const auto& [rank, ring] : g.rings) {
    for (const auto& [seq, e] : ring.entries) seqs.insert(seq);
  }
  for (const int64_t seq : seqs) {
    std::map<std::string, std::vector<int>> bySignature;
    std::map<std::string, const Entry*> example;
    for (const auto& [rank, ring] : g.rings) {
      const auto it = ring.entries.find(seq);
      if (it == ring.entries.end()) continue;
      bySignature[it->second.signature()].push_back(rank);
      example[it->second.signature()] = &it->second;
    }
    if (bySignature.size() < 2) continue;
    std::string line = strCat("ranks disagree on collective #", seq, " of ", groupName(g), ":");
    for (const auto& [signature, ranks] : bySignature) {
      line += strCat(" ", rankList(ranks), " issued ", describe(*example[signature]), ";");
    }
    line.back() = '.';
    return line + " Every rank must issue the same collectives in the same order with the same sizes.";
  }
  return std::nullopt;
}

}  // namespace

namespace {

// What the dumps in a directory say: every rank's dump, the communicators' rings by group,
// the files that could not be read, and the world they cover.
struct Evidence {
  std::map<int, Dump> dumps;
  std::map<std::string, Group> groups;
  std::vector<std::string> problems;  // unreadable dumps, reported last
  int world = 0;
};

Evidence readEvidence(const VerdictInput& input) {
  std::error_code ec;
  TESSERA_CHECK(fs::is_directory(input.dir, ec), "flight dumps: '", input.dir, "' is not a directory");
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(input.dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (std::regex_match(name, std::regex("rank_[0-9]+\\.json"))) files.push_back(entry.path());
  }
  TESSERA_CHECK(!ec, "flight dumps: cannot list '", input.dir, "': ", ec.message());
  std::sort(files.begin(), files.end());
  Evidence ev;
  for (const auto& file : files) {
    try {
      readDump(file.string(), ev.dumps, ev.groups);
    } catch (const std::exception& e) {
      ev.problems.push_back(strCat("unreadable dump ", file.string(), ": ", e.what()));
    }
  }
  // The world the dumps describe: the launcher's, or their largest group's size. A rank
  // beyond it (a crafted member 2e9 would have the verdict list two billion ranks) makes
  // the groups naming it unusable evidence.
  ev.world = input.worldSize;
  for (const auto& [key, g] : ev.groups) ev.world = std::max(ev.world, static_cast<int>(g.members.size()));
  for (auto it = ev.groups.begin(); it != ev.groups.end();) {
    const std::vector<int>& members = it->second.members;  // never empty: readDump checks
    const int largest = *std::max_element(members.begin(), members.end());
    if (largest >= ev.world) {
      ev.problems.push_back(strCat("a dump's group '", it->second.name, "' names rank ", largest, ", outside the world of ",
                                   ev.world, " ranks the dumps describe; its records are ignored"));
      it = ev.groups.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = ev.dumps.begin(); it != ev.dumps.end();) {
    if (ev.world > 0 && it->first >= ev.world) {
      ev.problems.push_back(strCat("a dump of rank ", it->first, ", outside the world of ", ev.world, " ranks, is ignored"));
      it = ev.dumps.erase(it);
    } else {
      ++it;
    }
  }
  for (const auto& [rank, fate] : input.fates) ev.world = std::max(ev.world, rank + 1);
  return ev;
}

// The verdict's lines, most telling first: stopped ranks, then a disagreement (the root
// cause when there is one) or else where each group is stuck, then the ranks that left no
// dump, what every dump gave as its reason, and the ranks no one heard of.
class VerdictLines {
 public:
  VerdictLines(const VerdictInput& input, const Evidence& ev) : input_(input), ev_(ev) {}

  // A rank that was stopped: everything else follows from it.
  void stoppedRanks() {
    for (const int r : input_.stopped) {
      std::string line = strCat("rank ", r, " stopped answering: its process was stopped (SIGSTOP or a debugger) when "
                                "the run was torn down");
      for (const auto& [key, g] : ev_.groups) {
        const auto it = g.rings.find(r);
        if (it == g.rings.end() || it->second.entries.empty()) continue;
        const Entry& last = it->second.entries.rbegin()->second;
        line += strCat("; its last collective in ", groupName(g), " was ", describe(last), " (", last.state,
                       " when it dumped)");
      }
      lines_.push_back(withDoing(line, r, "; it was doing: ", "."));
    }
  }

  // Ranks that disagree on a collective; whether there were any.
  bool disagreements() {
    bool found = false;
    for (const auto& [key, g] : ev_.groups) {
      if (const auto line = mismatch(g)) {
        lines_.push_back(*line);
        found = true;
      }
    }
    return found;
  }

  // Where each group is stuck: its lowest collective some rank has not completed.
  void stuckCollectives() {
    for (const auto& [key, g] : ev_.groups) {
      if (g.members.size() >= 2) stuckCollective(g);
    }
  }

  // Ranks the launcher saw end without a dump (and no line named them yet).
  void ranksWithoutDumps() {
    for (const auto& [rank, fate] : input_.fates) {
      if (ev_.dumps.count(rank) == 0 && described_.count(rank) == 0) {
        lines_.push_back(strCat("rank ", rank, " wrote no dump: ", fate, "."));
      }
    }
  }

  // What every dump gave as its reason, then the ranks of the world nothing is known of,
  // then the dumps that could not be read.
  std::vector<std::string> finish() {
    if (lines_.empty() && !ev_.dumps.empty()) {
      lines_.push_back("no collective was pending on any rank and every rank agreed on all of them");
    }
    for (const auto& [rank, d] : ev_.dumps) {
      std::string line = strCat("rank ", rank, " dumped on ", d.reason.empty() ? "(no reason)" : d.reason);
      if (d.step > 0) line += strCat(" at step ", d.step);
      lines_.push_back(withDoing(line, rank, "; doing: ", ""));
    }
    if (ev_.dumps.empty()) lines_.push_back(strCat("no flight dumps in ", input_.dir));
    for (int r = 0; r < ev_.world; ++r) {
      if (ev_.dumps.count(r) == 0 && input_.fates.count(r) == 0) lines_.push_back(strCat("rank ", r, ": no dump here"));
    }
    lines_.insert(lines_.end(), ev_.problems.begin(), ev_.problems.end());
    return std::move(lines_);
  }

 private:
  // What `rank`'s threads were doing when it dumped, "a; b", or "".
  std::string doingOf(int rank) const {
    const auto it = ev_.dumps.find(rank);
    if (it == ev_.dumps.end() || it->second.doing.empty()) return std::string();
    std::string out;
    for (const auto& d : it->second.doing) out += (out.empty() ? "" : "; ") + d;
    return out;
  }
  std::string fateOf(int rank) const {
    const auto it = input_.fates.find(rank);
    return it == input_.fates.end() ? std::string("unknown") : it->second;
  }
  // `line` + (what `rank` was doing, after `lead`) + `end`; `line` + `end` without one.
  std::string withDoing(const std::string& line, int rank, const char* lead, const char* end) const {
    const std::string doing = doingOf(rank);
    return doing.empty() ? line + end : strCat(line, lead, doing, end);
  }

  void stuckCollective(const Group& g) {
    std::optional<int64_t> stuck;
    for (const auto& [rank, ring] : g.rings) {
      for (const auto& [seq, e] : ring.entries) {
        if (!e.completed() && (!stuck || seq < *stuck)) stuck = seq;
      }
    }
    if (!stuck) return;
    std::vector<int> waiting, behind, silent;
    const Entry* example = nullptr;
    double waitedS = 0;
    for (const int m : g.members) {
      const auto it = g.rings.find(m);
      if (it == g.rings.end()) {
        silent.push_back(m);
        continue;
      }
      const RankRing& ring = it->second;
      const auto e = ring.entries.find(*stuck);
      if (ring.nextSeq <= *stuck) {
        behind.push_back(m);
      } else if (e != ring.entries.end() && !e->second.completed()) {
        waiting.push_back(m);
        example = &e->second;
        waitedS = std::max(waitedS, e->second.waitAgo >= 0 ? e->second.waitAgo : e->second.issuedAgo);
      }
    }
    if (example == nullptr) return;
    const std::string waitLine = strCat(rankList(waiting), " waited in collective ", describe(*example), " of ",
                                        groupName(g), " for ", fixed(waitedS), " s");
    for (const int r : behind) {
      const RankRing& ring = g.rings.at(r);
      std::string line = strCat("rank ", r, " is behind: ", waitLine, ", which rank ", r, " never issued");
      if (const auto last = ring.entries.find(*stuck - 1); last != ring.entries.end()) {
        line += strCat(" (its last was ", describe(last->second), ", ", last->second.state, ")");
      }
      lines_.push_back(withDoing(line, r, "; it was doing: ", "."));
    }
    if (!silent.empty()) {
      std::string line = strCat(rankList(silent), " left no flight record; ", waitLine, ".");
      for (const int r : silent) {
        line += strCat(" Rank ", r, ": ", fateOf(r), ".");
        described_.insert(r);
      }
      lines_.push_back(line);
    }
    if (behind.empty() && silent.empty()) {
      std::string line = strCat("every rank of ", groupName(g), " issued collective ", describe(*example),
                                " and it did not complete on ", rankList(waiting));
      if (!example->error.empty()) line += strCat(": ", example->error);
      lines_.push_back(line + ".");
    }
  }

  const VerdictInput& input_;
  const Evidence& ev_;
  std::vector<std::string> lines_;
  std::set<int> described_;  // ranks without a dump whose fate a line already gave
};

}  // namespace

std::vector<std::string> flightVerdict(const VerdictInput& input) {
  const Evidence evidence = readEvidence(input);
  VerdictLines verdict(input, evidence);
  verdict.stoppedRanks();
  if (!verdict.disagreements()) verdict.stuckCollectives();
  verdict.ranksWithoutDumps();
  return verdict.finish();
}

std::map<std::string, int64_t> dumpCounters(const std::string& dir) {
  std::map<std::string, int64_t> counters;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (!std::regex_match(entry.path().filename().string(), std::regex("rank_[0-9]+\\.json"))) continue;
    try {
      const json j = json::parse(readRegularFile(entry.path().string(), kMaxDumpBytes, LinkPolicy::kRefuse));
      if (!j.contains("counters") || !j["counters"].is_object()) continue;
      for (const auto& [name, value] : j["counters"].items()) {
        // A count: a whole number from 0 up (a crafted one past int64 is no count).
        if (value.is_number_unsigned() && value.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
          counters[name] = std::max(counters[name], static_cast<int64_t>(value.get<uint64_t>()));
        }
      }
    } catch (const std::exception&) {
      // Not a dump this can read: the verdict reports those; counters are only a summary.
    }
  }
  return counters;
}

}  // namespace tessera::diagnostics
