// The unit of sharded state the checkpointer saves and loads: sharding::StateEntry, a
// named local buffer and the ShardSpec that places it (docs/design.md, "One layout").
// Names are the caller's; the trainer uses "model/<param>", "optim/<state>/<param>",
// "ema/<ema name>/<param>" so exports can select a prefix and strip it back to the
// user's module names.
#pragma once

#include "sharding/sharded_param.h"

namespace tessera::checkpoint {

using sharding::StateEntry;

// Throws tessera::Error naming the entry when local does not fit spec (element count,
// dtype) or the name is empty; `where` prefixes the message.
void checkEntry(const StateEntry& entry, const char* where);

}  // namespace tessera::checkpoint
