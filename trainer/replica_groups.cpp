// fault.survive's agreement on who goes on after a lost rank (see replica_groups.h).
#include "trainer/replica_groups.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <sstream>

#include "common/errors.h"
#include "common/logging.h"
#include "distributed/communicator.h"
#include "distributed/gloo_communicator.h"
#include "distributed/shm_communicator.h"
#include "distributed/store.h"
#include "trainer/train_config.h"

namespace tessera::trainer {

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kWatchEvery = std::chrono::milliseconds(100);
const std::string kPrefix = "tessera_fault";

std::string epochKey(int64_t epoch, const std::string& what) { return strCat(kPrefix, "/", epoch, "/", what); }

// "0-1, 4" for {0, 1, 4}.
std::string rankRanges(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += strCat(out.empty() ? "" : ", ", ranks[i], j > i ? strCat("-", ranks[j]) : std::string());
    i = j + 1;
  }
  return out;
}


// "0-1, 4" back into {0, 1, 4}.
std::vector<int> parseRanges(const std::string& text) {
  std::vector<int> out;
  std::istringstream ranges(text);
  std::string piece;
  while (std::getline(ranges, piece, ',')) {
    const size_t dash = piece.find('-');
    const int lo = std::stoi(piece.substr(0, dash));
    const int hi = dash == std::string::npos ? lo : std::stoi(piece.substr(dash + 1));
    for (int r = lo; r <= hi; ++r) out.push_back(r);
  }
  return out;
}

// Launcher rank r's join attempt when it asks to join now (more join()s than admissions),
// else 0.
int64_t pendingJoin(distributed::Store& store, int r) {
  const int64_t attempts = store.add(strCat(kPrefix, "/join_attempts/", r), 0);
  return attempts > store.add(strCat(kPrefix, "/join_admitted/", r), 0) ? attempts : 0;
}

// admit()'s decision: "<launcher ranks>;<joining ranks>;<steps done>;<skipped>".
Membership parseAdmission(int64_t epoch, const std::string& text) {
  std::vector<std::string> fields;
  std::istringstream in(text);
  for (std::string f; std::getline(in, f, ';');) fields.push_back(f);
  if (fields.size() != 4) throw Error(strCat("fault.survive: a rejoin's record '", text, "' is not understood"));
  Membership m;
  m.epoch = epoch;
  m.launcherRanks = parseRanges(fields[0]);
  const std::vector<int> joining = parseRanges(fields[1]);
  for (int r : m.launcherRanks) {
    m.joining.push_back(std::find(joining.begin(), joining.end(), r) != joining.end());
  }
  m.stepsDone = std::stoll(fields[2]);
  m.skippedSteps = std::stoll(fields[3]);
  return m;
}

}  // namespace

int replicaGroupSize(const TrainConfig& cfg, int world, int localRanks) {
  int size = std::max(1, localRanks);
  for (const ModelEntry& m : cfg.models) {
    if (m.sharding.strategy == sharding::StrategyKind::kHybrid) size = m.sharding.fullyShard.shardSize;
  }
  if (size <= 0 || size >= world || world % size != 0) {
    throw ConfigError(strCat("fault.survive: replica groups of ", size, " rank", size == 1 ? "" : "s",
                             size <= 0 ? " (hybrid's sharding.shard_size 0: one group of every rank)" : "", " on ",
                             world, " ranks leave ",
                             size > 0 && size < world && world % size == 0 ? "" : "no second group to go on after a loss",
                             ": run at least two groups (hybrid: sharding.shard_size a proper divisor of the world; "
                             "no_shard: two or more nodes)"));
  }
  return size;
}

int Membership::newRankOf(int oldRank) const {
  const auto it = std::find(members.begin(), members.end(), oldRank);
  return it == members.end() ? -1 : static_cast<int>(it - members.begin());
}

std::string Membership::describe() const {
  std::vector<int> left;
  for (int r = 0; r < worldBefore; ++r) {
    if (newRankOf(r) < 0) left.push_back(r);
  }
  return strCat("ranks ", rankRanges(members), " of ", worldBefore, " go on as a world of ", members.size(),
                " from step ", stepsDone, left.empty() ? std::string() : strCat(" (ranks ", rankRanges(left), " left)"));
}

ReplicaGroups::ReplicaGroups(const distributed::RankEnv& env, int groupSize, std::chrono::milliseconds quorumWait,
                             std::chrono::milliseconds lostAfter, std::chrono::milliseconds timeout, bool joining,
                             const std::string& backend)
    : groupSize_(groupSize),
      launcherRank_(env.rank),
      worldAtStart_(env.world_size),
      quorumWait_(quorumWait),
      lostAfter_(lostAfter),
      timeout_(timeout),
      backend_(backend) {
  store_ = distributed::Store::createTcp(env.master_addr, env.master_port, false, timeout);
  watchStore_ = distributed::Store::createTcp(env.master_addr, env.master_port, false, timeout);
  // Loopback when the run's store is on it (every rank on this machine), else gloo's default
  // device, as distributed::Runtime picks for the run's own communicator.
  const std::string& master = env.master_addr;
  glooHostname_ = master == "127.0.0.1" || master == "localhost" || master == "::1" ? "127.0.0.1" : "";
  if (joining) backend_ = store_->get(strCat(kPrefix, "/backend"), timeout);  // as the live ranks'
  TESSERA_CHECK_AS(ConfigError, backend_ == "shm" || backend_ == "gloo", "fault.survive: backend '", backend_,
                   "' (shm or gloo expected)");
  epochGeneration_ = distributed::commAbortGeneration();
  if (joining) return;  // join() learns the world and starts watching
  for (int r = 0; r < env.world_size; ++r) launcherRanks_.push_back(r);
  // The first beat: from now on rank 0's watcher expects this rank's (silentRanks()).
  store_->add(strCat(kPrefix, "/heartbeat/", launcherRank_), 1);
  if (env.rank == 0) {
    store_->set(strCat(kPrefix, "/backend"), backend_);
    store_->set(strCat(kPrefix, "/alive"), "1");
  }
  startWatching();
}

ReplicaGroups::~ReplicaGroups() {
  stop_.store(true);
  if (watcher_.joinable()) watcher_.join();
}

void ReplicaGroups::startWatching() {
  if (!watcher_.joinable()) watcher_ = std::thread([this] { watch(); });  // a second join() keeps the first's
}

bool ReplicaGroups::rejoins(const distributed::RankEnv& env, std::chrono::milliseconds timeout) {
  if (env.rank == 0 || env.restart_count == 0) return false;
  try {
    const auto store = distributed::Store::createTcp(env.master_addr, env.master_port, false, timeout);
    return store->check({strCat(kPrefix, "/alive")});
  } catch (const Error&) {
    return false;  // no store: the whole run restarts
  }
}

std::map<int, int64_t> ReplicaGroups::waitingGroups(distributed::Store& store) {
  std::vector<int> live;
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    live = launcherRanks_;
  }
  std::map<int, int64_t> waiting;
  for (int g = 0; g < worldAtStart_ / groupSize_; ++g) {
    std::map<int, int64_t> group;
    for (int r = g * groupSize_; r < (g + 1) * groupSize_; ++r) {
      if (std::find(live.begin(), live.end(), r) != live.end()) break;
      const int64_t attempt = pendingJoin(store, r);
      if (attempt == 0) break;
      group[r] = attempt;
    }
    if (static_cast<int>(group.size()) == groupSize_) waiting.insert(group.begin(), group.end());
  }
  return waiting;
}

std::vector<int> ReplicaGroups::silentRanks(distributed::Store& store) {
  std::vector<int> live;
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    live = launcherRanks_;
  }
  const int64_t round = ++heartbeatRounds_;
  const std::chrono::milliseconds lostAfter = silenceLosesARankAfter();
  const int64_t rounds = lostAfter / kWatchEvery;
  // A rank that left is forgotten: when it rejoins, its new process's beats start afresh.
  for (auto it = heartbeats_.begin(); it != heartbeats_.end();) {
    it = std::find(live.begin(), live.end(), it->first) == live.end() ? heartbeats_.erase(it) : std::next(it);
  }
  std::vector<int> silent;
  for (int r : live) {
    const int64_t count = store.add(strCat(kPrefix, "/heartbeat/", r), 0);
    if (count == 0) continue;  // its process has not started its replica groups yet
    const auto now = Clock::now();
    auto it = heartbeats_.find(r);
    if (it == heartbeats_.end() || it->second.count != count) {
      heartbeats_[r] = {count, round, now};  // first seen (a rank that joined) or moved
    } else if (round - it->second.round >= rounds && now - it->second.time >= lostAfter) {
      silent.push_back(r);
    }
  }
  return silent;
}

void ReplicaGroups::watch() {
  while (!stop_.load()) {
    std::this_thread::sleep_for(kWatchEvery);
    const int64_t next = epoch_.load() + 1;
    try {
      // Each watcher beats, rank 0's notices one that stopped beating (killed, SIGSTOP, a
      // frozen host) and starts the change for every rank: gloo cannot see a peer's process,
      // and while a change's communicators are built no backend watches its peers.
      const auto beat = [&] { watchStore_->add(strCat(kPrefix, "/heartbeat/", launcherRank_), 1); };
      beat();
      if (launcherRank_ == 0) {
        const std::vector<int> silent = silentRanks(*watchStore_);
        if (!silent.empty() && !watchStore_->check({epochKey(next, "start")})) {
          TLOG_WARN("fault.survive: launcher rank" << (silent.size() == 1 ? " " : "s ") << rankRanges(silent)
                    << " sent no heartbeat for " << silenceLosesARankAfter().count() << " ms: lost");
          watchStore_->set(epochKey(next, "start"), "1");
        }
      }
      bool started = false;
      {
        // Under epochMutex_: an abort never lands after this process moved to the next
        // epoch, whose communicators it would break.
        const std::lock_guard<std::mutex> lock(epochMutex_);
        started = epoch_.load() < next && watchStore_->check({epochKey(next, "start")});
        if (started) distributed::abortCommunicators();
      }
      if (started) {
        // Until recover() moves epoch_ on, the abort stands; abort again only for the next.
        // Beating on: rank 0's watcher may count rounds again before this rank's moves on.
        while (!stop_.load() && epoch_.load() < next) {
          std::this_thread::sleep_for(kWatchEvery);
          beat();
        }
        continue;
      }
      if (launcherRank_ == 0 && !groupWaiting_.load()) groupWaiting_.store(!waitingGroups(*watchStore_).empty());
    } catch (const std::exception&) {
      // The store is gone (rank 0 lost): the collectives fail by themselves, recover() says why.
      return;
    }
  }
}

bool ReplicaGroups::rejoinWaiting(distributed::Communicator& host) {
  const at::Tensor flag = at::full({1}, groupWaiting_.load() ? 1.0 : 0.0, at::kDouble);
  host.allReduce(flag, distributed::ReduceOp::kMax);
  return flag.item<double>() > 0;
}

Membership ReplicaGroups::recover(int rank, int world, int64_t stepsDone) {
  const int64_t epoch = epoch_.load() + 1;
  Membership out;
  out.epoch = epoch;
  out.worldBefore = world;
  try {
    store_->set(epochKey(epoch, "start"), "1");
    distributed::abortCommunicators();  // this process's other threads (an async save's)
    store_->set(epochKey(epoch, strCat("alive/", rank)), std::to_string(stepsDone));
    const std::string decision = epochKey(epoch, "members");
    if (rank == 0) {
      std::vector<std::string> keys;
      for (int r = 0; r < world; ++r) keys.push_back(epochKey(epoch, strCat("alive/", r)));
      const auto deadline = Clock::now() + quorumWait_;
      while (!store_->check(keys) && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      std::vector<int> members, lost;
      for (int g = 0; g < world / groupSize_; ++g) {
        bool whole = true;
        for (int r = g * groupSize_; r < (g + 1) * groupSize_; ++r) {
          if (!store_->check({keys[r]})) {
            whole = false;
            lost.push_back(r);
          }
        }
        if (!whole) continue;
        for (int r = g * groupSize_; r < (g + 1) * groupSize_; ++r) members.push_back(r);
      }
      std::string problem;
      int64_t steps = -1;
      for (int r : members) {
        const int64_t s = std::stoll(store_->get(keys[r], timeout_));
        if (steps >= 0 && s != steps) {
          problem = strCat("rank ", r, " completed ", s, " steps and rank ", members.front(), " ", steps,
                           ": the step the rank was lost in cannot be redone by both");
        }
        steps = std::max(steps, s);
      }
      if (members.empty() || members.front() != 0) {
        problem = strCat("rank 0's replica group lost rank", lost.size() == 1 ? " " : "s ", rankRanges(lost),
                         " (rank 0 hosts the run's store, so its group must live)");
      }
      store_->set(decision, problem.empty() ? strCat(rankRanges(members), ";", steps) : "!" + problem);
      if (!problem.empty()) throw Error(strCat("fault.survive: no replica group can go on: ", problem));
      out.members = members;
      out.stepsDone = steps;
    } else {
      const std::string text = store_->get(decision, quorumWait_ + timeout_);
      if (!text.empty() && text[0] == '!') {
        throw Error(strCat("fault.survive: no replica group can go on: ", text.substr(1)));
      }
      // "0-1, 4-5;42"
      const size_t semi = text.find(';');
      out.members = parseRanges(text.substr(0, semi));
      out.stepsDone = std::stoll(text.substr(semi + 1));
    }
  } catch (const TimeoutError& e) {
    throw Error(strCat("fault.survive: rank ", rank, " could not agree with the others on who goes on (rank 0, the "
                       "store's host, may be lost): ", e.what()));
  }
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    std::vector<int> live;
    for (int m : out.members) live.push_back(launcherRanks_.at(m));
    launcherRanks_ = live;
  }
  setEpoch(epoch);
  return out;
}


int Membership::rankOfLauncherRank(int launcherRank) const {
  const auto it = std::find(launcherRanks.begin(), launcherRanks.end(), launcherRank);
  return it == launcherRanks.end() ? -1 : static_cast<int>(it - launcherRanks.begin());
}

Membership ReplicaGroups::admit(int rank, int64_t stepsDone, int64_t skippedSteps) {
  const int64_t epoch = epoch_.load() + 1;
  const std::string decision = epochKey(epoch, "admit");
  std::string text;
  if (rank == 0) {
    const std::map<int, int64_t> waiting = waitingGroups(*store_);
    std::vector<int> all, joining;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      all = launcherRanks_;
    }
    for (const auto& [r, attempt] : waiting) {
      all.push_back(r);
      joining.push_back(r);
    }
    std::sort(all.begin(), all.end());
    text = strCat(rankRanges(all), ";", rankRanges(joining), ";", stepsDone, ";", skippedSteps);
    store_->set(decision, text);
    for (const auto& [r, attempt] : waiting) {
      store_->set(strCat(kPrefix, "/join_admitted/", r, "/", attempt), std::to_string(epoch));
      store_->add(strCat(kPrefix, "/join_admitted/", r), attempt - store_->add(strCat(kPrefix, "/join_admitted/", r), 0));
    }
    groupWaiting_.store(false);
  } else {
    text = store_->get(decision, timeout_);
  }
  Membership m = parseAdmission(epoch, text);
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    m.worldBefore = static_cast<int>(launcherRanks_.size());
    launcherRanks_ = m.launcherRanks;
  }
  setEpoch(epoch);
  return m;
}

void ReplicaGroups::setEpoch(int64_t epoch) {
  const std::lock_guard<std::mutex> lock(epochMutex_);
  epoch_.store(epoch);
  // From here the watcher aborts only for the next change, which this epoch's
  // communicators, built after this, must then see (CommOptions::abortGeneration).
  epochGeneration_ = distributed::commAbortGeneration();
}

std::chrono::milliseconds ReplicaGroups::silenceLosesARankAfter() const {
  // shm's collectives see a stopped or exited peer's process themselves (and say which):
  // there the heartbeats are the backstop for a change's builds, where nothing else looks.
  return backend_ == "gloo" ? lostAfter_ : 2 * lostAfter_;
}

int ReplicaGroups::rankNow() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  const auto it = std::find(launcherRanks_.begin(), launcherRanks_.end(), launcherRank_);
  TESSERA_CHECK(it != launcherRanks_.end(), "fault.survive: launcher rank ", launcherRank_,
                " is not in the world it agreed to");
  return static_cast<int>(it - launcherRanks_.begin());
}

int ReplicaGroups::worldNow() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int>(launcherRanks_.size());
}

void ReplicaGroups::finished() {
  try {
    store_->set(strCat(kPrefix, "/finished"), "1");
  } catch (const std::exception&) {
    // Nobody can be waiting on a store that does not answer.
  }
}

bool ReplicaGroups::wholeGroupAsks() {
  const int first = launcherRank_ / groupSize_ * groupSize_;
  for (int r = first; r < first + groupSize_; ++r) {
    if (pendingJoin(*store_, r) == 0) return false;
  }
  return true;
}

std::optional<Membership> ReplicaGroups::join(std::chrono::milliseconds groupAsksWithin) {
  const int64_t attempt = store_->add(strCat(kPrefix, "/join_attempts/", launcherRank_), 1);
  const std::string admitted = strCat(kPrefix, "/join_admitted/", launcherRank_, "/", attempt);
  const std::string done = strCat(kPrefix, "/finished");
  const auto asked = Clock::now();
  const auto deadline = asked + timeout_;
  bool groupAsked = groupAsksWithin.count() <= 0;
  while (!store_->check({admitted})) {
    const bool finished = store_->check({done});
    if (!groupAsked) {
      // A rank of its group that never asks is lost (dead, or stopped: then only this
      // process's error makes its launcher end the node), even when the run is over.
      groupAsked = wholeGroupAsks();
      if (!groupAsked && (finished || Clock::now() - asked >= groupAsksWithin)) {
        throw Error(strCat("fault.survive: launcher rank ", launcherRank_, "'s replica group did not ask to rejoin "
                           "with it ", finished ? "before the run finished" : "within " +
                           distributed::formatDuration(groupAsksWithin),
                           " (a rank of it is lost, not only late): it leaves the run"));
      }
    }
    if (finished) return std::nullopt;
    if (Clock::now() >= deadline) {
      throw Error(strCat("fault.survive: launcher rank ", launcherRank_, " waited ",
                         distributed::formatDuration(timeout_),
                         " to rejoin the run and was not admitted (its whole replica group must ask)"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const int64_t epoch = std::stoll(store_->get(admitted, timeout_));
  Membership m = parseAdmission(epoch, store_->get(epochKey(epoch, "admit"), timeout_));
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    launcherRanks_ = m.launcherRanks;
  }
  setEpoch(epoch);
  startWatching();
  return m;
}

std::pair<std::shared_ptr<distributed::Communicator>, int> ReplicaGroups::counterpartsOf(
    const Membership& membership, int rank, std::chrono::milliseconds timeout) {
  const int world = static_cast<int>(membership.launcherRanks.size());
  const int place = rank % groupSize_;
  // The last live group sends: rank 0's group last, so that a donor lost mid-rejoin leaves
  // the store's group to go on (and to send at the next try).
  int donor = -1;
  for (int r = place, i = 0; r < world; r += groupSize_, ++i) {
    if (!membership.joining[r]) donor = i;
  }
  TESSERA_CHECK(donor >= 0, "fault.survive: no live rank holds place ", place, " of a replica group");
  return {groupCommunicator(membership.epoch, strCat("counterparts_", place), rank / groupSize_, world / groupSize_,
                            timeout, distributed::CommOptions{}.flightEntries),
          donor};
}

std::shared_ptr<distributed::Communicator> ReplicaGroups::communicatorFor(const Membership& membership, int rank,
                                                                          std::chrono::milliseconds timeout,
                                                                          int flightEntries) {
  const size_t world = membership.launcherRanks.empty() ? membership.members.size() : membership.launcherRanks.size();
  return groupCommunicator(membership.epoch, "world_cpu", rank, static_cast<int>(world), timeout, flightEntries);
}

std::shared_ptr<distributed::Communicator> ReplicaGroups::groupCommunicator(int64_t epoch, const std::string& name,
                                                                            int rank, int world,
                                                                            std::chrono::milliseconds timeout,
                                                                            int flightEntries) {
  distributed::CommOptions comm;
  {
    const std::lock_guard<std::mutex> lock(epochMutex_);
    comm.abortGeneration = epochGeneration_;
  }
  comm.timeout = timeout;
  comm.flightEntries = flightEntries;
  comm.name = name;
  const std::shared_ptr<distributed::Store> store = store_->withPrefix(epochKey(epoch, "comm"));
  if (backend_ == "gloo") {
    distributed::GlooOptions options;
    options.comm = comm;
    options.hostname = glooHostname_;
    return distributed::makeGlooCommunicator(store, rank, world, options);
  }
  distributed::ShmOptions options;
  options.comm = comm;
  options.comm.lostWhenStoppedFor = lostAfter_;
  return distributed::makeShmCommunicator(store, rank, world, options);
}

}  // namespace tessera::trainer
