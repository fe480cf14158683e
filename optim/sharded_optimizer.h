// Optimizers that step only on this rank's shards: AdamW, Adam and SGD (momentum,
// Nesterov), with torch.optim's update rules and defaults; and Muon (muon.h), whose
// orthogonalisation of a whole matrix is computed by one owner rank of the shards' group.
//
// The optimizer updates registered ShardedParam records (dtensor/sharded_param.h):
// each step reads a record's `grad` and updates its `master` in place. Every state tensor
// (exp_avg, exp_avg_sq, momentum_buffer) has the record's spec and shape, so optimizer
// memory per rank is 1/N of the model under a sharded layout. The updates are elementwise,
// so stepping on shards gives the same values as stepping on full tensors. Padding rows
// hold zero parameters and zero gradients and stay zero.
//
// The optimizer saves and loads its own state as checkpoint entries (stateEntries): the
// moments in the record's layout and the per-parameter step count (an int64 scalar, as
// torch.optim keeps it), so a checkpoint restores everything an update depends on.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/enum_names.h"
#include "dtensor/sharded_param.h"
#include "dtensor/stateful.h"
#include "optim/muon.h"

namespace tessera::distributed {
class Communicator;
}  // namespace tessera::distributed

namespace tessera::optim {

enum class OptimizerKind { kAdamW, kAdam, kSgd, kMuon };
inline constexpr std::array<EnumName<OptimizerKind>, 4> kOptimizerKindNames = {{{"adamw", OptimizerKind::kAdamW},
                                                                                {"adam", OptimizerKind::kAdam},
                                                                                {"sgd", OptimizerKind::kSgd},
                                                                                {"muon", OptimizerKind::kMuon}}};

// The learning rate is not an option: it changes every step (an LR schedule), so step()
// takes it.
struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weightDecay = 0.01;   // AdamW's default is 0.01; adam/sgd callers usually pass 0
  double momentum = 0.0;       // sgd
  double dampening = 0.0;      // sgd
  bool nesterov = false;       // sgd (needs momentum > 0 and dampening 0)
  // Parameter groups, by name pattern (fnmatch: "*" matches any run of characters). No
  // weight decay for parameters matching `noDecay`, nor for any of fewer than 2 dimensions
  // (biases, norm weights: defaultDecays); `lrScale` multiplies the learning rate of the
  // parameters matching a pattern (the longest pattern that matches: the most specific).
  // A pattern that matches no trainable parameter is warned about at the first step.
  std::vector<std::string> noDecay;
  std::map<std::string, double> lrScale;
  // kMuon: Muon's own settings; its 2-D hidden weights (takesMuon) get Muon at the step's
  // learning rate with weightDecay, the others AdamW (beta1, beta2, eps, weightDecay) at
  // the learning rate times muon.adamwLrScale.
  MuonOptions muon;
};

class ShardedOptimizer : public dtensor::Stateful {
 public:
  // Throws tessera::ConfigError for an unknown name or invalid hyperparameters.
  explicit ShardedOptimizer(OptimizerOptions options);
  ShardedOptimizer(const ShardedOptimizer&) = delete;
  ShardedOptimizer& operator=(const ShardedOptimizer&) = delete;
  ShardedOptimizer(ShardedOptimizer&&) = default;

  // Registers a parameter (the record must outlive the optimizer); `decay` false puts it
  // in the no-weight-decay group, `lrScale` multiplies the learning rate for it.
  void addParam(dtensor::ShardedParam& param, bool decay = true, double lrScale = 1.0);
  // The group the parameters' specs are laid out over (a strategy's stateComm()): Muon
  // gathers a sharded matrix's rows to its owner there. Unset: every Muon parameter must be
  // whole on this rank (a replicated spec, or a world of one).
  void setGroup(std::shared_ptr<distributed::Communicator> group) { group_ = std::move(group); }
  // Whether `param` is stepped by Muon (kMuon and takesMuon), not AdamW.
  bool takesMuon(const dtensor::ShardedParam& param) const { return slotOf(param).muon; }

  // Applies one update with learning rate `lr` to every registered parameter whose `grad`
  // is defined (same element count as its master; any floating dtype).
  void step(double lr);

  size_t size() const { return slots_.size(); }

  // State names this optimizer keeps ("exp_avg", "exp_avg_sq"; "momentum_buffer"; none;
  // Muon: "momentum_buffer" for its parameters, "exp_avg" and "exp_avg_sq" for AdamW's).
  std::vector<std::string> stateNames() const;
  // State tensor `key` of `param`, in its master's layout; undefined until the first step
  // that touched it. tessera::Error when `param` is not registered.
  at::Tensor state(const dtensor::ShardedParam& param, const std::string& key) const;
  // Updates applied to `param` so far (the t of Adam's bias correction).
  int64_t stepCount(const dtensor::ShardedParam& param) const;

  // Everything an update depends on, as checkpoint entries that save and load in place:
  //   <prefix><state>/<param>   each state tensor its parameter keeps, the parameter's spec
  //                             (zeros are created for parameters not stepped yet, so every
  //                             rank lists the same)
  //   <prefix>step/<param>      the step count: an int64 scalar, replicated
  std::vector<dtensor::StateEntry> stateEntries(const std::string& prefix);
  // Stateful (dtensor/stateful.h): the entries relative to its key ("exp_avg/<param>").
  std::vector<dtensor::StateEntry> stateEntries() override { return stateEntries(""); }
  std::string componentKind() const override { return "optimizer"; }
  // Checks step counts loaded from `source` (a checkpoint): each in [0, maxStep], the most
  // optimizer steps the checkpoint's run step allows. A negative count would make Adam's bias correction divide by zero.
  // tessera::Error naming `source`, the entry and the value otherwise.
  void checkLoadedStepCounts(int64_t maxStep, const std::string& source,
                             const std::string& prefix = dtensor::statePrefix(dtensor::kOptimizerKey)) const;

  // Bytes held in optimizer state tensors on this rank.
  int64_t stateBytes() const;

 private:
  struct Slot {
    dtensor::ShardedParam* param = nullptr;
    double weightDecay = 0.0;  // from its group
    double lrScale = 1.0;
    bool muon = false;         // kMuon: Muon's (else AdamW's)
    std::map<std::string, at::Tensor> state;
    at::Tensor steps;  // int64 scalar on the CPU: a checkpoint entry loads it in place
  };
  const Slot& slotOf(const dtensor::ShardedParam& param) const;
  void warnUnmatchedPatterns();
  std::vector<std::string> stateNamesOf(const Slot& slot) const;
  // kMuon: one Muon update of `slots` (those with a gradient) at learning rate `lr`.
  void muonStep(const std::vector<Slot*>& slots, double lr);

  OptimizerOptions options_;
  // The rules of the elementwise update: options_, or under Muon its AdamW group's (kind
  // kAdamW, the rest as options_).
  OptimizerOptions elementwise_;
  std::shared_ptr<distributed::Communicator> group_;
  std::vector<int> muonOwners_;  // owner rank in group_ of each Muon slot, in slot order (set at the first step)
  std::vector<Slot> slots_;
  std::unordered_map<const dtensor::ShardedParam*, size_t> slotIndex_;
  bool patternsChecked_ = false;
};

// Default weight-decay rule: no decay for biases, norm weights and every other
// parameter with fewer than 2 dimensions.
bool defaultDecays(const std::vector<int64_t>& globalShape);
// Whether parameter `name` (global shape `shape`) decays under `options`, and its
// learning-rate multiplier (OptimizerOptions::noDecay, lrScale).
bool decays(const OptimizerOptions& options, const std::string& name, const std::vector<int64_t>& shape);
double lrScaleOf(const OptimizerOptions& options, const std::string& name);
// The noDecay and lrScale patterns that match none of `names`.
std::vector<std::string> unmatchedPatterns(const OptimizerOptions& options, const std::vector<std::string>& names);

}  // namespace tessera::optim
