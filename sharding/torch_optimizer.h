// Bringing a torch::optim optimizer: it steps a strategy's local shards (as FSDP2's
// optimizers step DTensor shards), and TorchOptimizerState is its checkpoint view.
//
//   std::vector<torch::optim::OptimizerParamGroup> groups = ...;   // over strategy->shardedParameters()
//   torch::optim::AdamW adamw(groups, torch::optim::AdamWOptions(1e-3));
//   strategy->step(adamw);                                         // reduce, clip, adamw.step(), publish
//   sharding::TorchOptimizerState optimState(adamw, *strategy);    // {"optim", optimState} in a checkpoint
//
// Its tensors have the names of Tessera's fused optimizer ("exp_avg/<param>",
// "exp_avg_sq/<param>", "step/<param>", "momentum_buffer/<param>"), each in its
// parameter's shard layout, so a checkpoint loads into either optimizer and on any world
// size. Adam, AdamW (amsgrad too) and SGD (dampening 0) are supported.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "dtensor/stateful.h"

namespace torch::optim {
class Optimizer;
}

namespace tessera::sharding {

class ShardingStrategy;

// Parameter groups over `strategy`'s shards by the rule of ShardedOptimizer's default
// (optim::defaultDecays): `decay` holds the tensors of 2 or more dimensions, `noDecay`
// biases, norms and other vectors; the caller gives each group its weight decay (the
// usual AdamW recipe).
struct ShardGroups {
  std::vector<at::Tensor> decay, noDecay;
};
ShardGroups splitByDecay(ShardingStrategy& strategy);

class TorchOptimizerState final : public dtensor::Stateful {
 public:
  // tessera::UsageError for an optimizer of another type, a parameter that is not one of
  // the strategy's shards, or SGD with dampening.
  TorchOptimizerState(torch::optim::Optimizer& optimizer, ShardingStrategy& strategy);

  // State tensors are created (zeros, step 0: what the optimizer's first step would start
  // from) for parameters not stepped yet, so every rank lists the same names.
  std::vector<dtensor::StateEntry> stateEntries() override;
  // Step counts back from their tensors.
  void afterLoad() override;
  std::string componentKind() const override { return "optimizer"; }

 private:
  torch::optim::Optimizer& optimizer_;
  ShardingStrategy& strategy_;
  std::vector<at::Tensor> steps_;  // int64 scalars: the Adam(W) step counts as entries, in group order
};

}  // namespace tessera::sharding
