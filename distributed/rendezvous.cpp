// Rendezvous through a c10d TCPStore with arrival checks that name missing ranks (see
// rendezvous.h).
#include "distributed/rendezvous.h"

#include <algorithm>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "common/logging.h"

namespace tessera::distributed {
namespace {

using Clock = std::chrono::steady_clock;

std::string arrivalKey(const std::string& key, int rank) { return strCat(key, "/arrived/", rank); }

// "[2, 3]"; long lists are shortened: "[4, 5, 6, ... (120 ranks)]".
std::string rankList(const std::vector<int>& ranks) {
  constexpr size_t kMaxShown = 16;
  std::string out = "[";
  for (size_t i = 0; i < ranks.size() && i < kMaxShown; ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(ranks[i]);
  }
  if (ranks.size() > kMaxShown) out += strCat(", ... (", ranks.size(), " ranks)");
  return out + "]";
}

}  // namespace

void waitForRanks(Store& store, const std::string& key, int rank, int world, std::chrono::milliseconds timeout,
                  const std::function<void()>& whileWaiting) {
  TESSERA_CHECK_AS(UsageError, world >= 1 && rank >= 0 && rank < world, "waitForRanks: rank ", rank,
                   " is out of range for world size ", world);
  std::vector<std::string> keys;
  keys.reserve(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) keys.push_back(arrivalKey(key, r));
  const auto timedOutKey = [&key](int r) { return strCat(key, "/timed_out/", r); };

  // A store call failing means the store host (rank 0) is gone.
  const auto storeLost = [&](const std::exception& e) {
    return Error(strCat("rendezvous: lost the store at ", store.address(), " while rank ", rank, " waited for all ",
                        world, " ranks (rank 0, the store host, exited, e.g. after its own rendezvous timeout): ",
                        std::string(e.what()).substr(0, std::string(e.what()).find('\n'))));
  };

  const auto start = Clock::now();
  const auto deadline = start + timeout;
  // A line now and then while ranks are missing (a node still starting, or gone).
  const auto every = waitProgressInterval(timeout);
  auto nextLine = start + every;
  const auto missingRanks = [&] {
    std::vector<int> missing;
    for (int r = 0; r < world; ++r) {
      if (!store.check({keys[static_cast<size_t>(r)]})) missing.push_back(r);
    }
    return missing;
  };
  auto pause = std::chrono::milliseconds(1);
  try {
    store.set(keys[static_cast<size_t>(rank)], "1");
    while (!store.check(keys)) {
      if (whileWaiting) whileWaiting();
      const auto now = Clock::now();
      if (now < deadline) {
        if (now >= nextLine) {
          const std::vector<int> missing = missingRanks();
          TLOG_WARN("rendezvous: rank " << rank << " has waited "
                    << formatDuration(std::chrono::duration_cast<std::chrono::milliseconds>(now - start)) << " for "
                    << (missing.size() == 1 ? "rank " : "ranks ")
                    << (missing.size() == 1 ? std::to_string(missing[0]) : rankList(missing)) << " of " << world
                    << " at " << store.address() << " (timeout " << formatDuration(timeout) << ")");
          nextLine += every;
        }
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::milliseconds(20));
        continue;
      }
      const std::vector<int> missing = missingRanks();
      if (missing.empty()) return;  // the last one arrived just now
      const std::string message =
          strCat("rendezvous: waited ", formatDuration(timeout), " for ", missing.size() == 1 ? "rank " : "ranks ",
                 missing.size() == 1 ? std::to_string(missing[0]) : rankList(missing), " of ", world, " at ",
                 store.address(), " (key ", key, "; this is rank ", rank, ")");
      store.set(timedOutKey(rank), "1");
      if (rank == 0) {
        // The store lives in this process: keep it up briefly, until the ranks that did
        // arrive have made their own diagnosis, so that they too report the missing ranks
        // instead of a lost connection.
        std::vector<std::string> present;
        for (int r = 1; r < world; ++r) {
          if (std::find(missing.begin(), missing.end(), r) == missing.end()) present.push_back(timedOutKey(r));
        }
        const auto graceEnd = Clock::now() + std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(2));
        while (!present.empty() && !store.check(present) && Clock::now() < graceEnd) {
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
      }
      throw TimeoutError(message);
    }
  } catch (const TimeoutError&) {
    throw;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw storeLost(e);
  }
}

std::shared_ptr<Store> rendezvous(const RankEnv& env, const RendezvousOptions& options) {
  const auto start = Clock::now();
  std::shared_ptr<Store> store;
  if (env.world_size == 1 && !env.use_agent_store) {
    store = Store::createInProcess();
  } else if (env.use_agent_store) {
    try {
      store = Store::createTcp(env.master_addr, env.master_port, /*isServer=*/false, options.timeout);
    } catch (const TimeoutError& e) {
      throw TimeoutError(strCat("rendezvous: rank ", env.rank, " of ", env.world_size,
                                " found no store at torchrun's agent: ", e.what()));
    }
    store = store->withPrefix(strCat("/worker/attempt_", env.restart_count));
  } else if (env.rank == 0) {
    store = Store::createTcp(env.master_addr, env.master_port, /*isServer=*/true, options.timeout);
  } else {
    try {
      store = Store::createTcp(env.master_addr, env.master_port, /*isServer=*/false, options.timeout);
    } catch (const TimeoutError& e) {
      throw TimeoutError(strCat("rendezvous: rank ", env.rank, " of ", env.world_size, " waited ",
                                formatDuration(options.timeout), " for rank 0 (the store host) at ", env.master_addr, ":",
                                env.master_port, ": ", e.what()));
    }
  }
  const auto remaining = std::max(std::chrono::milliseconds(0),
                                  options.timeout - std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start));
  waitForRanks(*store, strCat(options.key, "/", env.restart_count), env.rank, env.world_size, remaining);
  TLOG_DEBUG("rendezvous: " << env.world_size << " ranks at " << store->address() << " after "
                            << std::chrono::duration<double>(Clock::now() - start).count() << " s");
  return store;
}

}  // namespace tessera::distributed
