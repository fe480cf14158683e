// Stateful: one component of a run as checkpoints see it (DCP's Stateful, torchtitan's
// CheckpointManager states): the tensors it saves and loads in place, named relative to
// the key it is saved under, and what it restores from them after a load. A strategy (the
// model), an optimizer, an EMA and a run's counters are Stateful; a checkpoint is a map of
// them:
//
//   checkpointer.save(step, {{"model", *strategy}, {"optim", strategy->optimizer()},
//                            {"ema", ema}, {"train", counters}});
//   checkpoint::load(dir, {{"model", *strategy}, ...}, comm);   // the same map
//
// A component's entry "blocks.0.fc.weight" under key "model" is the checkpoint's tensor
// "model/blocks.0.fc.weight". Keys may repeat (two EMAs under "ema") as long as the
// tensor names do not.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "dtensor/sharded_param.h"

namespace tessera::dtensor {

class Stateful {
 public:
  virtual ~Stateful() = default;
  // Its entries, named relative to its key. Called before every save (counters are copied
  // into their tensors then) and every load; the same names on every rank and in every run.
  virtual std::vector<StateEntry> stateEntries() = 0;
  // After a load wrote the entries in place: what derives from them (the module's
  // parameters from the masters, a count from its tensor). Collective for a strategy.
  virtual void afterLoad() {}
  // Names it can be exported under (tessera-export --what), each a prefix relative to its
  // key: {"generator_ema": "generator_ema/"}; the name "" stands for the key itself, with
  // every entry ("model" -> "model/").
  virtual std::map<std::string, std::string> exportNames() const { return {}; }
  // What it is, in one word, for tools that read a checkpoint without the code that wrote
  // it (tessera-ckpt info): "model", "optimizer", "ema", "counters".
  virtual std::string componentKind() const { return "state"; }
  // Named groups of its entries, each a prefix relative to its key ({"decoder_ema":
  // "decoder_ema/"} for an EMA's profiles); none: the component is one group.
  virtual std::map<std::string, std::string> componentParts() const { return {}; }
};

// One component of a checkpoint: its key, the component, and the key of the component it
// serves ("" for none): an optimizer's or an EMA's model, recorded so that tools can say
// whose optimizer state a checkpoint holds.
struct StateItem {
  StateItem(std::string key, Stateful& state, std::string of = "")
      : key(std::move(key)), state(&state), of(std::move(of)) {}
  std::string key;
  Stateful* state;
  std::string of;
};
using StateMap = std::vector<StateItem>;

// The keys Tessera's own runs save their components under, typed once (a checkpoint's
// tensor names start with "<key>/").
inline constexpr char kModelKey[] = "model";
inline constexpr char kOptimizerKey[] = "optim";
inline constexpr char kEmaKey[] = "ema";

// "<key>/": the tensor-name prefix of a component.
inline std::string statePrefix(const std::string& key) { return key + "/"; }

}  // namespace tessera::dtensor
