// The node-local checkpoint tier: saves, replicas, promotion (see local_tier.h).
#include "checkpoint/local_tier.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <climits>
#include <filesystem>
#include <set>

#include "checkpoint/file_io.h"
#include "checkpoint/local_tier_files.h"
#include "checkpoint/format.h"
#include "checkpoint/metadata.h"
#include "checkpoint/rank_files.h"
#include "checkpoint/reader.h"
#include "common/clock.h"
#include "common/errors.h"
#include "common/filesystem.h"
#include "common/logging.h"
#include "common/trace.h"
#include "distributed/communicator.h"
#include "distributed/string_collectives.h"

namespace tessera::checkpoint {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// A replica travels in broadcasts of at most this many bytes (one buffer on the receiver).
constexpr int64_t kReplicaPieceBytes = int64_t{64} << 20;
// Copies on promotion go through a buffer of this size.
constexpr int64_t kCopyBytes = int64_t{8} << 20;

std::string hostName() {
  char name[HOST_NAME_MAX + 1] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "?";
  return name;
}

// Copies `from` (a regular file, no link) to `to`, fsynced; returns the bytes.
int64_t copyFile(const std::string& from, const std::string& to) {
  const File in = File::openRead(from);
  const int64_t size = in.size();
  File out = File::openWrite(to);
  std::vector<uint8_t> buffer(static_cast<size_t>(std::min(kCopyBytes, std::max<int64_t>(1, size))));
  for (int64_t pos = 0; pos < size; pos += kCopyBytes) {
    const size_t n = static_cast<size_t>(std::min(kCopyBytes, size - pos));
    in.readAt(buffer.data(), n, pos, from);
    out.writeAll(buffer.data(), n);
  }
  out.sync();
  out.close();
  return size;
}

// Whether `dir` or a directory above it is a checkpoint step directory or a checkpoints
// directory (holding `latest`): "" when neither, else which.
std::string checkpointsAbove(const fs::path& dir) {
  std::error_code ec;
  for (fs::path d = dir; !d.empty(); d = d.parent_path()) {
    if (fs::is_regular_file(d / "latest", ec)) return strCat("the checkpoints directory ", d.string());
    const std::string name = d.filename().string();
    if (d != dir && (parseStepDirName(name) || fs::is_regular_file(d / kMetadataFile, ec))) {
      return strCat("the checkpoint ", d.string());
    }
    if (d == d.parent_path()) break;
  }
  return "";
}

}  // namespace

void checkLocalTierDirectory(const std::string& dir, const std::string& key) {
  std::error_code ec;
  if (fs::is_symlink(fs::symlink_status(dir, ec))) {
    throw ConfigError(strCat(key, " ", quote(dir), " is a symbolic link: the local tier deletes what it wrote in its "
                             "directory and never follows a link there; give the directory itself"));
  }
  const fs::path resolved = fs::weakly_canonical(fs::absolute(dir), ec);
  const std::string inside = checkpointsAbove(ec ? fs::absolute(dir) : resolved);
  if (!inside.empty()) {
    throw ConfigError(strCat(key, " ", quote(dir), " is in ", inside, ": the local tier keeps and deletes steps of "
                             "its own there; give it a directory of its own"));
  }
}

namespace {

// What names a node: this host and the directory as it resolves.
std::string nodeKey(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  const fs::path canonical = fs::weakly_canonical(fs::absolute(dir), ec);
  return hostName() + ":" + (ec ? dir : canonical.string());
}

}  // namespace

NodeLayout discoverNodes(distributed::Communicator* comm, const std::string& dir) {
  const std::string key = nodeKey(dir);
  const std::vector<std::string> keys = distributed::allGatherStrings(comm, key);
  NodeLayout layout;
  layout.nodeOf.assign(keys.size(), -1);
  for (size_t r = 0; r < keys.size(); ++r) {
    if (layout.nodeOf[r] >= 0) continue;
    const int node = static_cast<int>(layout.nodes.size());
    layout.nodes.emplace_back();
    for (size_t q = r; q < keys.size(); ++q) {
      if (keys[q] != keys[r]) continue;
      layout.nodeOf[q] = node;
      layout.nodes.back().push_back(static_cast<int>(q));
    }
  }
  return layout;
}

std::vector<ReplicaCopy> replicaPlan(const NodeLayout& layout, int replicas) {
  const int nodes = static_cast<int>(layout.nodes.size());
  std::vector<ReplicaCopy> plan;
  for (int h = 1; h <= std::min(replicas, nodes - 1); ++h) {
    for (int i = 0; i < nodes; ++i) {
      const auto& from = layout.nodes[static_cast<size_t>(i)];
      const auto& to = layout.nodes[static_cast<size_t>((i + h) % nodes)];
      for (size_t j = 0; j < from.size(); ++j) plan.push_back({from[j], to[j % to.size()]});
    }
  }
  // One global order: by pair, then sender. Every rank walks its own copies in it, so the
  // lowest pair not yet done always has both ranks at it (none waits in a cycle).
  std::sort(plan.begin(), plan.end(), [](const ReplicaCopy& a, const ReplicaCopy& b) {
    const auto key = [](const ReplicaCopy& c) {
      return std::make_tuple(std::min(c.from, c.to), std::max(c.from, c.to), c.from);
    };
    return key(a) < key(b);
  });
  return plan;
}

LocalCheckpointer::LocalCheckpointer(LocalTierOptions options, std::shared_ptr<distributed::Communicator> comm)
    : options_(std::move(options)), comm_(std::move(comm)) {
  TESSERA_CHECK_AS(ConfigError, !options_.dir.empty(), "checkpoint.local: no directory");
  TESSERA_CHECK_AS(ConfigError, options_.replicas >= 0, "checkpoint.local.replicas ", options_.replicas, " < 0");
  TESSERA_CHECK_AS(ConfigError, options_.keepLast >= 1, "checkpoint.local.keep_last ", options_.keepLast, " < 1");
  distributed::runOnEveryRank(comm_.get(), "checkpoint.local.dir",
                              [&] { checkLocalTierDirectory(options_.dir, "checkpoint.local.dir"); });
  if (comm_) {
    rank_ = comm_->rank();
    world_ = comm_->worldSize();
  }
  // A directory that cannot be made (a path through a file, no permission) is every
  // rank's configuration error, before the first save.
  distributed::runOnEveryRank(comm_.get(), "checkpoint.local.dir", [&] {
    std::error_code ec;
    fs::create_directories(options_.dir, ec);
    if (ec || !fs::is_directory(options_.dir, ec)) {
      throw ConfigError(strCat("checkpoint.local.dir '", options_.dir, "': cannot create it: ",
                               ec ? ec.message() : std::string("not a directory")));
    }
  });
  layout_ = discoverNodes(comm_.get(), options_.dir);
  // A directory on a filesystem several hosts share is one directory to all of them: the
  // nodes would overwrite each other's files. Each node's leader leaves a mark there;
  // another host's mark refuses the directory on every rank.
  const std::string key = nodeKey(options_.dir);
  const fs::path mark = fs::path(options_.dir) / (".node-" + checksumHex(checksum(key.data(), key.size())));
  if (layout_.leads(rank_)) writeFileAtomic(mark.string(), key, /*syncParent=*/false);
  distributed::runOnEveryRank(comm_.get(), "checkpoint.local.dir", [&] {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(options_.dir, ec)) {
      const std::string name = entry.path().filename().string();
      const bool writing = name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0;  // writeFileAtomic's
      if (name.rfind(".node-", 0) != 0 || writing || entry.path() == mark) continue;
      std::string other = "?";
      try {
        other = readFileBounded(entry.path().string(), 4096);
      } catch (const std::exception&) {
      }
      throw ConfigError(strCat("checkpoint.local.dir '", options_.dir, "' is also the directory of node '", other,
                               "' (storage the nodes share?): the local tier needs storage of each node's own; set "
                               "checkpoint.local.dir to a node-local path (a mark a crash left, ",
                               entry.path().string(), ", may be deleted)"));
    }
  });
  if (layout_.leads(rank_)) {
    std::error_code ec;
    fs::remove(mark, ec);
  }
  const int nodes = static_cast<int>(layout_.nodes.size());
  replicas_ = std::min(options_.replicas, nodes - 1);
  plan_ = replicaPlan(layout_, replicas_);
  if (options_.replicas > 0 && nodes == 1) {
    TLOG_INFO0("checkpoint.local: every rank is on one node (a node is the ranks sharing a host and "
               << options_.dir << "): no replicas; the local tier covers the ranks' crash, not the machine's loss");
  } else if (options_.replicas > replicas_) {
    TLOG_WARN0("checkpoint.local.replicas " << options_.replicas << ": the ranks are on " << nodes
                                            << " nodes, so each rank's file gets " << replicas_
                                            << " cop" << (replicas_ == 1 ? "y" : "ies") << " on other nodes");
  }
}

std::shared_ptr<distributed::Communicator> LocalCheckpointer::pairGroup(int a, int b) {
  const std::pair<int, int> key(std::min(a, b), std::max(a, b));
  auto it = pairs_.find(key);
  if (it != pairs_.end()) return it->second;
  return pairs_[key] = comm_->split({key.first, key.second});
}

int64_t LocalCheckpointer::replicate(const std::vector<RankIndex>& indexes, const std::string& dir,
                                     std::string& error) {
  int64_t received = 0;
  at::Tensor buffer;
  for (const ReplicaCopy& copy : plan_) {
    if (copy.from != rank_ && copy.to != rank_) continue;
    const std::shared_ptr<distributed::Communicator> pair = pairGroup(copy.from, copy.to);
    const int root = copy.from < copy.to ? 0 : 1;
    const bool sending = copy.from == rank_;
    // The sender's file as it wrote it (in the page cache, or memory in /dev/shm), read
    // back in pieces: one broadcast per piece, however many tensors it holds.
    const std::string path = (fs::path(dir) / rankDataFile(copy.from)).string();
    const int64_t bytes = indexes[static_cast<size_t>(copy.from)].file.bytes;
    const bool failedBefore = !error.empty();
    std::optional<File> file;
    if (error.empty()) {
      try {
        file.emplace(sending ? File::openRead(path) : File::openWrite(path));
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    for (int64_t pos = 0; pos < bytes; pos += kReplicaPieceBytes) {
      const int64_t n = std::min(kReplicaPieceBytes, bytes - pos);
      if (!buffer.defined() || buffer.numel() < n) buffer = at::empty({std::min(kReplicaPieceBytes, bytes)}, at::kByte);
      at::Tensor piece = buffer.narrow(0, 0, n);
      if (sending && file && error.empty()) {
        try {
          file->readAt(piece.data_ptr(), static_cast<size_t>(n), pos, path);
        } catch (const std::exception& e) {
          error = e.what();  // the partner still gets its pieces (of garbage): the agreement fails the save
        }
      }
      pair->broadcast(piece, root);
      if (!sending && file && error.empty()) {
        try {
          file->writeAll(piece.data_ptr(), static_cast<size_t>(n));
        } catch (const std::exception& e) {
          error = e.what();
        }
      }
      if (!sending) received += n;
    }
    if (!sending && file && error.empty()) {
      try {
        file->close();  // not fsynced, as this rank's own file (rank_files.h)
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    if (!failedBefore && !error.empty()) error = strCat("replica of rank ", copy.from, " at ", path, ": ", error);
  }
  return received;
}

LocalSaveStats LocalCheckpointer::save(const SaveRequest& request) {
  const auto start = Clock::now();
  const trace::Span span("checkpoint", strCat("local checkpoint step ", request.step));
  LocalSaveStats stats;
  const fs::path dir = fs::path(options_.dir) / stepDirName(request.step);
  // 1. This rank's file.
  std::string error;
  std::vector<RankRows> rows;
  RankIndex index;
  int64_t blockBytes = 0;
  try {
    const StateSize size = stateSizeOf(request.entries);
    const CheckpointOptions defaults;
    blockBytes = checksumBlockBytes(defaults.blockBytes, defaults.maxMetadataBytes, size.bytes, size.chunks);
    rows = rankRowsOf(request.entries, rank_, /*copy=*/false, staging_, stats.bytes);
    // Each step is saved once per run, and a start empties the tier of the run's steps. A
    // step directory there already is another run's (or not the tier's): never written into.
    claimStepDir(dir, options_.owner, request.step, rank_);
    index = writeRankData(dir.string(), rank_, world_, request.step, blockBytes, request.rankState, rows,
                          /*durable=*/false);  // why not: rank_files.h
  } catch (const std::exception& e) {
    error = e.what();
  }
  const auto failed = [&](const std::string& what) {
    const int lowest = distributed::lowestFailingRank(comm_.get(), !error.empty());
    if (lowest < 0) return false;
    stats.error = error.empty() ? strCat(what, " failed on rank ", lowest, " (its log says why)") : error;
    return true;
  };
  // 2. Every rank's chunk table, which is also the agreement (a rank that failed sends
  // nothing), and rank 0's trainer state after a NUL (JSON text never holds one).
  std::string mine = error.empty() ? toJson(index) : std::string();
  if (rank_ == 0 && error.empty()) mine += std::string(1, '\0') + request.trainerState;
  const std::vector<std::string> gathered = distributed::allGatherStrings(comm_.get(), mine);
  int lowestFailed = -1;
  for (size_t r = 0; r < gathered.size() && lowestFailed < 0; ++r) {
    if (gathered[r].empty()) lowestFailed = static_cast<int>(r);
  }
  if (lowestFailed >= 0) {
    stats.error = error.empty() ? strCat("writing a rank's file failed on rank ", lowestFailed, " (its log says why)")
                                : error;
  } else {
    std::vector<RankIndex> indexes;
    std::string trainerState;
    for (size_t r = 0; r < gathered.size(); ++r) {
      const size_t nul = gathered[r].find('\0');
      if (r == 0 && nul != std::string::npos) trainerState = gathered[r].substr(nul + 1);
      indexes.push_back(parseRankIndex(gathered[r].substr(0, nul), "a rank's chunk table"));
    }
    // 3. Replicas, then 4. the leaders' metadata and retention.
    stats.replicaBytes = replicate(indexes, dir.string(), error);
    if (!failed("a replica")) {
      if (layout_.leads(rank_)) {
        try {
          CheckpointMetadata md =
              mergeRankIndexes(indexes, {request.step, world_, blockBytes, request.strategy, request.components});
          writeTrainerState(dir.string(), parseTrainerState(trainerState, "SaveRequest.trainerState"), md,
                            /*durable=*/false);
          writeMetadataFile(dir.string(), metadataText(md), /*durable=*/false);
          // Retention: the newest keep_last complete steps; anything older that never
          // completed (a crash's remains) goes too.
          int kept = 0;
          const auto steps = ownedStepDirs(options_.dir, options_.owner);
          for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
            if (it->first > request.step) continue;
            const bool complete = isComplete(it->second);
            if (complete && kept < options_.keepLast) {
              ++kept;
              continue;
            }
            removeTree(it->second.string());
          }
        } catch (const std::exception& e) {
          error = strCat("writing the metadata of ", dir.string(), ": ", e.what());
        }
      }
      // Agreed, so that every rank reports the save alike (a node without metadata.json
      // does not hold the step).
      stats.saved = !failed("a node's metadata");
    }
  }
  stats.seconds = secondsSince(start);
  if (!stats.saved) {
    TLOG_WARN("checkpoint.local: step " << request.step << " was not saved in " << options_.dir << ": " << stats.error
                                        << " (training goes on; the persistent checkpoints are as they were)");
    if (layout_.leads(rank_) && !isComplete(dir)) {
      std::error_code ec;
      removeTree(dir.string(), ec);
    }
  }
  return stats;
}

void LocalCheckpointer::clear() const {
  if (layout_.leads(rank_)) removeSteps(options_.dir, options_.owner);
}

void clearLocalTier(const std::string& localDir, const std::string& owner, distributed::Communicator* comm) {
  const NodeLayout layout = discoverNodes(comm, localDir);
  if (layout.leads(comm ? comm->rank() : 0)) removeSteps(localDir, owner);
}

std::optional<PromotedStep> promoteLocalStep(const std::string& localDir, const std::string& owner,
                                             const std::string& checkpointsDir, distributed::Communicator* comm) {
  const auto start = Clock::now();
  const int rank = comm ? comm->rank() : 0;
  // What every node holds, and the persistent tier's newest (rank 0's listing).
  // ("?" when rank 0 could not list it: then nothing is promoted, on every rank.)
  std::string newest = "-1";
  if (rank == 0) {
    try {
      const std::vector<CheckpointRef> persistent = listCheckpoints(checkpointsDir);
      if (!persistent.empty()) newest = std::to_string(persistent.back().step);
    } catch (const std::exception& e) {
      TLOG_WARN("checkpoint.local: cannot list " << checkpointsDir << ": " << e.what() << "; nothing promoted");
      newest = "?";
    }
  }
  newest = distributed::broadcastString(comm, newest, 0);
  if (newest == "?") return std::nullopt;
  const int64_t newestPersistent = std::stoll(newest);
  const std::vector<std::string> texts =
      distributed::allGatherStrings(comm, inventoryJson(inventory(localDir, owner, newestPersistent)));
  std::vector<std::vector<HeldStep>> held;
  for (const std::string& text : texts) held.push_back(parseInventory(text));
  bool incomplete = false;
  const std::optional<PromotionChoice> chosen = choosePromotion(held, newestPersistent, &incomplete);
  if (!chosen) {
    if (incomplete) {
      TLOG_WARN0("checkpoint.local: no step newer than the persistent tier's is complete on the surviving nodes "
                 "(their files were on the lost ones); resuming from the persistent tier");
    }
    return std::nullopt;
  }
  PromotedStep promoted;
  promoted.step = chosen->step;
  promoted.dir = (fs::path(checkpointsDir) / stepDirName(chosen->step)).string();
  const std::string tmp = promoted.dir + ".tmp";
  const fs::path source = fs::path(localDir) / stepDirName(chosen->step);
  const int metadataCopier = chosen->holders.front();
  std::set<int> nodes;
  const NodeLayout layout = discoverNodes(comm, localDir);
  for (int h : chosen->holders) nodes.insert(layout.nodeOf[static_cast<size_t>(h)]);
  promoted.nodesHolding = static_cast<int>(nodes.size());
  int64_t copied = 0;
  try {
    distributed::runOnEveryRank(comm, "preparing the promotion of a local checkpoint", [&] {
      if (rank != 0) return;
      std::error_code ec;
      fs::create_directories(checkpointsDir, ec);
      if (ec) throw Error(strCat("cannot create ", checkpointsDir, ": ", ec.message()));
      removeTree(tmp);
      fs::create_directory(tmp, ec);
      if (ec) throw Error(strCat("cannot create ", tmp, ": ", ec.message()));
    });
    distributed::runOnEveryRank(comm, "copying a local checkpoint's rank files", [&] {
      for (size_t saved = 0; saved < chosen->copier.size(); ++saved) {
        if (chosen->copier[saved] != rank) continue;
        const std::string name = rankDataFile(static_cast<int>(saved));
        copied += copyFile((source / name).string(), (fs::path(tmp) / name).string());
      }
    });
    distributed::runOnEveryRank(comm, "committing a local checkpoint", [&] {
      if (rank != metadataCopier) return;
      copied += copyFile((source / kTrainerStateFile).string(), (fs::path(tmp) / kTrainerStateFile).string());
      copied += copyFile((source / kMetadataFile).string(), (fs::path(tmp) / kMetadataFile).string());
      syncDirectory(tmp);
      if (fs::exists(fs::symlink_status(promoted.dir))) removeTree(promoted.dir);  // an incomplete one
      renamePath(tmp, promoted.dir);
      syncDirectory(checkpointsDir);
      writeFileAtomic((fs::path(checkpointsDir) / "latest").string(), stepDirName(chosen->step) + "\n");
    });
  } catch (const std::exception& e) {
    if (rank == 0) {
      std::error_code ec;
      removeTree(tmp, ec);
    }
    throw Error(strCat("checkpoint.local: step ", chosen->step, " could not be made persistent in ", checkpointsDir,
                       ": ", e.what()));
  }
  at::Tensor total = at::tensor({copied}, at::kLong);
  if (comm && comm->worldSize() > 1) comm->allReduce(total);
  promoted.bytes = total.item<int64_t>();
  promoted.seconds = secondsSince(start);
  return promoted;
}

}  // namespace tessera::checkpoint
