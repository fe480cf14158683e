// Stateful components as checkpoint entries (see state.h).
#include "checkpoint/state.h"

#include "common/errors.h"
#include "sharding/strategy.h"

namespace tessera::checkpoint {

std::vector<StateEntry> collectEntries(const StateMap& states) {
  std::vector<StateEntry> entries;
  std::map<std::string, std::string> ownerOf;  // final entry name -> the key that gave it
  for (const StateItem& item : states) {
    TESSERA_CHECK_AS(UsageError, !item.key.empty() && item.key.front() != '/' && item.key.back() != '/',
                     "checkpoint state key '", item.key, "' must be a name without a leading or trailing '/'");
    for (StateEntry& e : item.state->stateEntries()) {
      e.name = dtensor::statePrefix(item.key) + e.name;
      if (!e.formerName.empty()) e.formerName = dtensor::statePrefix(item.key) + e.formerName;
      const auto [it, fresh] = ownerOf.emplace(e.name, item.key);
      TESSERA_CHECK_AS(UsageError, fresh, "checkpoint entry '", e.name, "' is given by state key '", it->second,
                       "' and again by '", item.key, "'; give the two components different keys or names");
      entries.push_back(std::move(e));
    }
  }
  return entries;
}

std::vector<ComponentRecord> collectComponents(const StateMap& states) {
  std::vector<ComponentRecord> records;
  for (const StateItem& item : states) {
    ComponentRecord c;
    c.key = item.key;
    c.kind = item.state->componentKind();
    c.of = item.of;
    for (const auto& [name, prefix] : item.state->componentParts()) c.parts[name] = c.prefix() + prefix;
    for (const auto& [name, prefix] : item.state->exportNames()) c.exports[name.empty() ? c.key : name] = c.prefix() + prefix;
    records.push_back(std::move(c));
  }
  return records;
}

std::map<std::string, std::string> collectExportNames(const StateMap& states) {
  return exportNamesOf(collectComponents(states));
}

std::string describeStrategies(const StateMap& states) {
  std::vector<std::pair<std::string, std::string>> found;
  for (const StateItem& item : states) {
    if (const auto* s = dynamic_cast<const sharding::ShardingStrategy*>(item.state)) {
      found.emplace_back(item.key, sharding::strategyKindName(s->kind()));
    }
  }
  if (found.size() == 1) return found[0].second;
  std::string out;
  for (const auto& [key, kind] : found) out += strCat(out.empty() ? "" : " ", key, ":", kind);
  return out;
}

void afterLoad(const StateMap& states) {
  for (const StateItem& item : states) item.state->afterLoad();
}

int64_t Counters::at(const std::string& name) const {
  auto it = values_.find(name);
  TESSERA_CHECK_AS(UsageError, it != values_.end(), "Counters: no counter named '", name, "'");
  return it->second;
}

std::vector<StateEntry> Counters::stateEntries() {
  std::vector<StateEntry> entries;
  tensors_.clear();
  for (const auto& [name, value] : values_) {
    at::Tensor& t = tensors_[name] = at::full({}, value, at::kLong);
    // Replicated: rank 0 writes it, every rank reads it; the group size does not matter
    // for a whole tensor, so a one-rank spec serves any run.
    entries.push_back({name, dtensor::ShardSpec({}, at::kLong, 1, 0, dtensor::Placement::kReplicate), t});
  }
  return entries;
}

void Counters::afterLoad() {
  for (const auto& [name, t] : tensors_) values_[name] = t.item<int64_t>();
}

}  // namespace tessera::checkpoint
