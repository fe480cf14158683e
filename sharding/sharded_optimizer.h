// Optimizers that step only on this rank's shards: AdamW, Adam and SGD (momentum,
// Nesterov), with torch.optim's update rules and defaults.
//
// Each registered parameter is a local buffer laid out by a ShardSpec (a zero3 shard,
// or this rank's slice of a replicated parameter for zero1/zero2); every state tensor
// (exp_avg, exp_avg_sq, momentum_buffer) has the same spec and shape, so optimizer
// memory per rank is 1/N of the model. The updates are elementwise, so stepping on
// shards gives the same values as stepping on full tensors. Padding rows hold zero
// parameters and zero gradients and stay zero.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "sharding/shard_spec.h"

namespace tessera::sharding {

struct OptimizerOptions {
  std::string name = "adamw";  // adamw | adam | sgd
  double lr = 1e-3;            // torch.optim's default for Adam/AdamW
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weightDecay = 0.01;   // AdamW's default is 0.01; adam/sgd callers usually pass 0
  double momentum = 0.0;       // sgd
  double dampening = 0.0;      // sgd
  bool nesterov = false;       // sgd (needs momentum > 0 and dampening 0)
};

// One parameter as the optimizer sees it.
struct OptimizerParam {
  std::string name;          // the user's module name, e.g. "layers.0.weight"
  ShardSpec spec;            // layout of `param` and of every state tensor
  at::Tensor param;          // local fp32 master buffer, updated in place
  double weightDecay = 0.0;  // per-parameter (from its group)
  double lrScale = 1.0;      // per-parameter lr multiplier (from its group)
};

class ShardedOptimizer {
 public:
  // Throws tessera::ConfigError for an unknown name or invalid hyperparameters.
  explicit ShardedOptimizer(OptimizerOptions options);

  // Registers a parameter; `decay` false puts it in the no-weight-decay group.
  // Returns its index.
  size_t addParam(std::string name, ShardSpec spec, at::Tensor param, bool decay = true, double lrScale = 1.0);

  // Applies one update with learning rate `lr` from the local gradient shards, one per
  // parameter in registration order (same shape as the parameter; an undefined tensor
  // means "no gradient this step": that parameter and its state are left alone).
  void step(const std::vector<at::Tensor>& grads, double lr);

  size_t size() const { return params_.size(); }
  const OptimizerParam& param(size_t i) const { return params_.at(i); }
  const OptimizerOptions& options() const { return options_; }

  // State tensors by name ("exp_avg", "exp_avg_sq", "momentum_buffer") for parameter i;
  // undefined until the first step that touched it. step count per parameter too.
  at::Tensor state(size_t i, const std::string& key) const;
  int64_t stepCount(size_t i) const { return stepCounts_.at(i); }
  // State names this optimizer keeps.
  std::vector<std::string> stateNames() const;
  // Restores state (e.g. from a checkpoint): shapes must match the parameter.
  void setState(size_t i, const std::string& key, const at::Tensor& value);
  void setStepCount(size_t i, int64_t count) { stepCounts_.at(i) = count; }

  // Bytes held in optimizer state tensors on this rank.
  int64_t stateBytes() const;

 private:
  OptimizerOptions options_;
  std::vector<OptimizerParam> params_;
  std::vector<std::map<std::string, at::Tensor>> states_;
  std::vector<int64_t> stepCounts_;
};

// Default weight-decay rule: no decay for biases, norm weights and every other
// parameter with fewer than 2 dimensions.
bool defaultDecays(const std::string& name, const std::vector<int64_t>& globalShape);

}  // namespace tessera::sharding
