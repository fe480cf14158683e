// fault.survive's agreement on who goes on after a lost rank (see replica_groups.h).
#include "trainer/replica_groups.h"

#include <algorithm>
#include <sstream>

#include "common/errors.h"
#include "common/logging.h"
#include "distributed/communicator.h"
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
                             std::chrono::milliseconds timeout)
    : groupSize_(groupSize), quorumWait_(quorumWait), timeout_(timeout) {
  store_ = distributed::Store::createTcp(env.master_addr, env.master_port, false, timeout);
  watchStore_ = distributed::Store::createTcp(env.master_addr, env.master_port, false, timeout);
  watcher_ = std::thread([this] { watch(); });
}

ReplicaGroups::~ReplicaGroups() {
  stop_.store(true);
  if (watcher_.joinable()) watcher_.join();
}

void ReplicaGroups::watch() {
  while (!stop_.load()) {
    std::this_thread::sleep_for(kWatchEvery);
    const int64_t next = epoch_.load() + 1;
    try {
      if (watchStore_->check({epochKey(next, "start")})) {
        distributed::abortCommunicators();
        // Until recover() moves epoch_ on, the abort stands; abort again only for the next.
        while (!stop_.load() && epoch_.load() < next) std::this_thread::sleep_for(kWatchEvery);
      }
    } catch (const std::exception&) {
      // The store is gone (rank 0 lost): the collectives fail by themselves, recover() says why.
      return;
    }
  }
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
      std::istringstream ranges(text.substr(0, semi));
      std::string piece;
      while (std::getline(ranges, piece, ',')) {
        const size_t dash = piece.find('-');
        const int lo = std::stoi(piece.substr(0, dash));
        const int hi = dash == std::string::npos ? lo : std::stoi(piece.substr(dash + 1));
        for (int r = lo; r <= hi; ++r) out.members.push_back(r);
      }
      out.stepsDone = std::stoll(text.substr(semi + 1));
    }
  } catch (const TimeoutError& e) {
    throw Error(strCat("fault.survive: rank ", rank, " could not agree with the others on who goes on (rank 0, the "
                       "store's host, may be lost): ", e.what()));
  }
  epoch_.store(epoch);
  return out;
}

std::shared_ptr<distributed::Communicator> ReplicaGroups::communicatorFor(const Membership& membership, int rank,
                                                                          std::chrono::milliseconds timeout,
                                                                          int flightEntries) {
  distributed::ShmOptions options;
  options.comm.timeout = timeout;
  options.comm.flightEntries = flightEntries;
  options.comm.name = "world_cpu";
  return distributed::makeShmCommunicator(store_->withPrefix(epochKey(membership.epoch, "comm")), rank,
                                          static_cast<int>(membership.members.size()), options);
}

}  // namespace tessera::trainer
