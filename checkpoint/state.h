// The unit of sharded state the checkpointer saves and loads: sharding::StateEntry, a
// named local buffer and the ShardSpec that places it (docs/design.md, "One layout"), and
// the map of Stateful components a checkpoint is made of (dtensor/stateful.h): each
// component's entries are saved as "<key>/<name>", so exports select a prefix and strip
// it back to the module's own names.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "checkpoint/metadata.h"
#include "dtensor/sharded_param.h"
#include "dtensor/stateful.h"

namespace tessera::checkpoint {

using dtensor::StateEntry;
using dtensor::StateItem;
using dtensor::StateMap;
using dtensor::Stateful;

// Throws tessera::Error naming the entry when local does not fit spec (element count,
// dtype) or the name is empty; `where` prefixes the message.
void checkEntry(const StateEntry& entry, const char* where);

// Every component's entries, each name prefixed with its component's key ("model/...").
// tessera::UsageError for an empty key or a key with a '/' at either end.
std::vector<StateEntry> collectEntries(const StateMap& states);
// Each component as a checkpoint records it (metadata.h): its key, kind, parts, export
// names ("" = the key) and the key it serves (StateItem::of).
std::vector<ComponentRecord> collectComponents(const StateMap& states);
// Export names -> tensor-name prefixes of every component; tessera::Error when two
// components export one name differently.
std::map<std::string, std::string> collectExportNames(const StateMap& states);
// The strategies among the components, for a checkpoint's record: "zero3" for one,
// "encoder:zero3 decoder:zero2" for several, "" for none.
std::string describeStrategies(const StateMap& states);
// Runs every component's afterLoad(), in order.
void afterLoad(const StateMap& states);

// Named int64 counters saved with a checkpoint — a step, a data position, anything of the
// caller's — as replicated scalars ("<key>/<name>"). Declare each one before a load (its
// value before the load stays when the checkpoint lacks it only if optional).
class Counters final : public Stateful {
 public:
  int64_t& operator[](const std::string& name) { return values_[name]; }
  int64_t at(const std::string& name) const;  // UsageError for an unknown name
  std::vector<StateEntry> stateEntries() override;
  void afterLoad() override;
  std::string componentKind() const override { return "counters"; }

 private:
  std::map<std::string, int64_t> values_;
  std::map<std::string, at::Tensor> tensors_;  // the values as entries, between save/load and afterLoad
};

}  // namespace tessera::checkpoint
