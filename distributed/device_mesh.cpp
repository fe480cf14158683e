// DeviceMesh: row-major rank grid and its per-dimension communicators (see device_mesh.h).
#include "distributed/device_mesh.h"

#include "common/errors.h"

namespace tessera::distributed {

DeviceMesh DeviceMesh::oneD(std::shared_ptr<Communicator> world) {
  TESSERA_CHECK_AS(UsageError, world != nullptr, "DeviceMesh::oneD: no world communicator");
  DeviceMesh mesh;
  mesh.ndim_ = 1;
  mesh.replicate_ = 1;
  mesh.shard_ = world->worldSize();
  mesh.world_ = world;
  mesh.shardGroup_ = world;
  mesh.replicateGroup_ = world->split({world->rank()});  // a group of one: no communication
  return mesh;
}

DeviceMesh DeviceMesh::twoD(std::shared_ptr<Communicator> world, int replicate, int shard) {
  TESSERA_CHECK_AS(UsageError, world != nullptr, "DeviceMesh::twoD: no world communicator");
  TESSERA_CHECK_AS(UsageError, replicate >= 1 && shard >= 1 && replicate * shard == world->worldSize(),
                   "DeviceMesh::twoD: replicate ", replicate, " x shard ", shard, " = ", replicate * shard,
                   " does not match world size ", world->worldSize());
  DeviceMesh mesh;
  mesh.ndim_ = 2;
  mesh.replicate_ = replicate;
  mesh.shard_ = shard;
  mesh.world_ = world;
  // Every rank creates its shard group first, then its replicate group: shard groups are
  // disjoint, so all members of each meet in the same order and nobody waits on a rank
  // that is busy creating another group.
  mesh.shardGroup_ = shard == world->worldSize() ? world : world->split(mesh.shardGroupRanks());
  mesh.replicateGroup_ = replicate == world->worldSize() ? world : world->split(mesh.replicateGroupRanks());
  return mesh;
}

std::vector<int> DeviceMesh::shape() const {
  if (ndim_ == 1) return {shard_};
  return {replicate_, shard_};
}

std::vector<int> DeviceMesh::shardGroupRanks() const {
  std::vector<int> ranks;
  for (int s = 0; s < shard_; ++s) ranks.push_back(replicaIndex() * shard_ + s);
  return ranks;
}

std::vector<int> DeviceMesh::replicateGroupRanks() const {
  std::vector<int> ranks;
  for (int r = 0; r < replicate_; ++r) ranks.push_back(r * shard_ + shardIndex());
  return ranks;
}

std::string DeviceMesh::describe() const {
  if (ndim_ == 1) return strCat("mesh ", shard_, " (data parallel), rank ", world_->rank());
  return strCat("mesh ", replicate_, "x", shard_, " (replicate x shard), rank ", world_->rank(), " = (", replicaIndex(),
                ", ", shardIndex(), ")");
}

}  // namespace tessera::distributed
