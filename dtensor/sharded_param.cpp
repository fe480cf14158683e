// The rows of a parameter this rank owns (see sharded_param.h).
#include "dtensor/sharded_param.h"

namespace tessera::dtensor {

ShardSpec ShardedParam::ownedSpec() const {
  if (spec.placement() == Placement::kShard0) return spec;
  return ShardSpec(spec.globalShape(), spec.dtype(), spec.worldSize(), spec.rank(), Placement::kShard0);
}

at::Tensor ShardedParam::ownedMaster() const {
  if (spec.placement() == Placement::kShard0) return master;
  const ShardSpec owned = ownedSpec();
  const auto [begin, end] = owned.localRowRange();
  return master.reshape({owned.globalRows(), owned.rowNumel()}).narrow(0, begin, end - begin);
}

}  // namespace tessera::dtensor
