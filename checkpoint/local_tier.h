// The node-local checkpoint tier: frequent saves to storage each node has on its own
// (/dev/shm by default), every rank's file also copied to ranks on the next nodes, so a
// lost node costs the steps since the last local save instead of those since the last
// persistent checkpoint (docs/checkpoint.md, "Node-local tier").
//
// A node is the set of ranks that write one directory on one host (host name and
// canonical path agree): on a real cluster the ranks of one machine, in tests each
// simulated node's own directory.
//
// On disk, in each node's directory:
//   step_00000035/  tier_owner.json (written first: the run that owns the step, the
//                   identity LocalTierOptions::owner gives), rank_R.bin of this node's ranks
//                   and of the ranks it holds replicas of, trainer_state.json, and
//                   metadata.json (the step's full metadata, the same on every node), written
//                   last by the node's leader once every rank's file and replica is written:
//                   a step directory without it is incomplete and never used
//
// The tier reads, promotes and deletes only the step directories it wrote for its owner:
// a step of another run that shares the directory, a checkpoint it did not write, a link
// or a file are left where they are (and said so). Its directory is never a link, nor in
// a run's checkpoints (checkLocalTierDirectory).
//
// A save (collective): every rank writes its rank_R.bin (rank_files.h); the chunk tables
// all-gathered (a rank that failed sends none: the gather is the agreement), so every
// node merges the same metadata; each rank's
// file read back and broadcast to its partner on each of the next `replicas` nodes (a
// two-rank group per pair, pieces of 64 MiB, pairs taken in one global order so that none waits on
// another); one agreement; the leaders write metadata.json and keep the newest
// keep_last complete steps. A failure anywhere is reported and the run goes on (the
// persistent tier is untouched): a local save never stops training.
//
// A resume (promoteLocalStep, collective): every rank reports what its node's directory
// holds of its owner's steps, each rank file's checksums verified; the newest step newer
// than the persistent tier's newest whose every rank file is held intact by some surviving
// node (with the same metadata) is copied into the persistent directory as an ordinary
// checkpoint (step_N.tmp, then the rename), which the usual resume then loads. The tier
// is emptied (clearLocalTier) only once the run that resumes has been accepted.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpointer.h"
#include "checkpoint/local_tier_files.h"
#include "checkpoint/rank_files.h"
#include "checkpoint/staging_buffers.h"

namespace tessera::distributed {
class Communicator;
}

namespace tessera::checkpoint {

struct LocalTierOptions {
  std::string dir;   // this node's directory (created; not a link, not in a run's checkpoints)
  int replicas = 1;  // copies of each rank's file on the next nodes (at most nodes - 1)
  int keepLast = 2;  // complete steps each node keeps (>= 1)
  // Who the steps belong to (a run: its canonical run.dir): recorded in every step the
  // tier writes; only such steps are read, promoted or deleted.
  std::string owner;
};

// ConfigError naming `key` (the config key or option the directory came from) when `dir`
// is a symbolic link, or lies in a checkpoints directory (one holding `latest`, or inside
// a checkpoint step directory): the tier must not delete what a persistent tier owns.
void checkLocalTierDirectory(const std::string& dir, const std::string& key);

// The nodes of a group: ranks that share a host and a directory. Nodes are ordered by
// their lowest rank; each node's ranks ascend.
struct NodeLayout {
  std::vector<std::vector<int>> nodes;
  std::vector<int> nodeOf;  // by rank
  // The node's lowest rank: the one that writes its metadata and removes its steps.
  bool leads(int rank) const { return nodes[static_cast<size_t>(nodeOf[static_cast<size_t>(rank)])].front() == rank; }
};
// Collective over `comm` (null: one rank): every rank's host name and canonical `dir`.
NodeLayout discoverNodes(distributed::Communicator* comm, const std::string& dir);

// Who sends each rank's file where: rank nodes[i][j] to nodes[i+h][j mod size] for h in
// 1..replicas (ring order). Sorted by pair, then sender: the order every rank walks them.
struct ReplicaCopy {
  int from = 0, to = 0;
};
std::vector<ReplicaCopy> replicaPlan(const NodeLayout& layout, int replicas);

struct LocalSaveStats {
  bool saved = false;
  std::string error;           // why not ("" when saved)
  int64_t bytes = 0;           // this rank's file
  int64_t replicaBytes = 0;    // replicas this rank received
  double seconds = 0;
};

class LocalCheckpointer {
 public:
  // Collective over `comm` (the group the state is sharded over): finds the nodes.
  LocalCheckpointer(LocalTierOptions options, std::shared_ptr<distributed::Communicator> comm);

  // Collective. Saves the request as step_<step> in this node's directory and replicates
  // it; never throws for a failed write or copy (stats.saved is the same on every rank,
  // stats.error says why).
  LocalSaveStats save(const SaveRequest& request);
  // Removes this node's steps (by its leader; the others return at once). The end of a
  // run, whose persistent checkpoint makes them redundant.
  void clear() const;

  const NodeLayout& layout() const { return layout_; }
  // The replicas each save makes (options.replicas capped at nodes - 1).
  int replicas() const { return replicas_; }

 private:
  // Sends this rank's file to, and receives the files of, its partners (replicaPlan);
  // returns the bytes received. A read or write error goes to `error` and the transfer
  // goes on (the partner is in the middle of the same broadcasts).
  int64_t replicate(const std::vector<RankIndex>& indexes, const std::string& dir, std::string& error);
  std::shared_ptr<distributed::Communicator> pairGroup(int a, int b);

  LocalTierOptions options_;
  std::shared_ptr<distributed::Communicator> comm_;
  int rank_ = 0, world_ = 1;
  NodeLayout layout_;
  int replicas_ = 0;
  std::vector<ReplicaCopy> plan_;
  std::map<std::pair<int, int>, std::shared_ptr<distributed::Communicator>> pairs_;
  StagingBuffers staging_;  // device tensors' rows
};

// The step promoteLocalStep made persistent.
struct PromotedStep {
  int64_t step = 0;
  std::string dir;        // checkpointsDir/step_N
  int nodesHolding = 0;   // nodes whose directory held some of its files
  int64_t bytes = 0;      // copied by all ranks
  double seconds = 0;
};

// Collective over `comm`. The newest step in the nodes' local directories (`localDir`,
// each rank its node's) that is newer than the newest checkpoint in checkpointsDir and
// complete across the surviving nodes, copied into checkpointsDir as a committed
// checkpoint. nullopt when there is none. Throws Error on every rank when copying failed
// (the local directories are left as they were; the persistent tier's newest resumes).
// Only `owner`'s steps are candidates; another owner's are left alone and named in the log.
std::optional<PromotedStep> promoteLocalStep(const std::string& localDir, const std::string& owner,
                                             const std::string& checkpointsDir, distributed::Communicator* comm);
// Collective: every node's leader removes `owner`'s step directories in its `localDir`
// (nothing else).
void clearLocalTier(const std::string& localDir, const std::string& owner, distributed::Communicator* comm);

}  // namespace tessera::checkpoint
