// DeviceMesh: the ranks of the world arranged as a 1-D (data parallel) or 2-D
// (replicate x shard, for hybrid sharding) grid, with a communicator per dimension.
//
// Ranks are laid out row-major: rank = replica_index * shard_size + shard_index, so a
// shard group (the ranks one parameter is sharded over: same replica index) is a run of
// consecutive ranks, which on a multi-GPU node keeps sharding traffic inside the node;
// a replicate group (same shard index) holds one rank of each shard group.
//
//   2 x 2 mesh over 4 ranks     shard groups     {0,1} {2,3}   (all-gather/reduce-scatter)
//      shard ->                 replicate groups {0,2} {1,3}   (all-reduce of the shards)
//   rep [ 0 1 ]
//       [ 2 3 ]
//
// A 1-D mesh over N ranks is the 1 x N case: the shard group is the world, the replicate
// group is this rank alone.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "distributed/communicator.h"

namespace tessera::distributed {

class DeviceMesh {
 public:
  // 1 x N: every rank in one data-parallel / shard dimension.
  static DeviceMesh oneD(std::shared_ptr<Communicator> world);
  // replicate x shard == world size (UsageError otherwise). Every rank of `world` calls it;
  // it creates this rank's shard group, then its replicate group (collective within each).
  static DeviceMesh twoD(std::shared_ptr<Communicator> world, int replicate, int shard);

  int ndim() const { return ndim_; }
  // {N} for 1-D, {replicate, shard} for 2-D.
  std::vector<int> shape() const;
  int replicateSize() const { return replicate_; }
  int replicaIndex() const { return world_->rank() / shard_; }
  int shardIndex() const { return world_->rank() % shard_; }

  const std::shared_ptr<Communicator>& world() const { return world_; }
  // Ranks sharing this rank's replica index (1-D: the world). Its rank == shardIndex().
  const std::shared_ptr<Communicator>& shardGroup() const { return shardGroup_; }
  // Ranks sharing this rank's shard index (1-D: this rank alone). Its rank == replicaIndex().
  const std::shared_ptr<Communicator>& replicateGroup() const { return replicateGroup_; }

  // World ranks of this rank's shard / replicate group, in group-rank order.
  std::vector<int> shardGroupRanks() const;
  std::vector<int> replicateGroupRanks() const;

  // "mesh 2x2 (replicate x shard), rank 3 = (1, 1)".
  std::string describe() const;

 private:
  DeviceMesh() = default;
  int ndim_ = 1;
  int replicate_ = 1;
  int shard_ = 1;
  std::shared_ptr<Communicator> world_;
  std::shared_ptr<Communicator> shardGroup_;
  std::shared_ptr<Communicator> replicateGroup_;
};

}  // namespace tessera::distributed
