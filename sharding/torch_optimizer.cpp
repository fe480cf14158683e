// A torch::optim optimizer's state as checkpoint entries (see torch_optimizer.h).
#include "sharding/torch_optimizer.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <type_traits>
#include <unordered_map>
#include <sstream>

#include "common/errors.h"
#include "sharding/strategy.h"

namespace tessera::sharding {
namespace {

// The key torch::optim keeps a parameter's state under: the TensorImpl's address, as a
// string in LibTorch 1.x and as a pointer in 2.x.
template <typename Map>
typename Map::key_type stateKey(const Map&, const at::Tensor& p) {
  using Key = typename Map::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;  // as c10::guts::to_string wrote it (gone from 2.x)
    key << p.unsafeGetTensorImpl();
    return key.str();
  } else {
    return reinterpret_cast<Key>(p.unsafeGetTensorImpl());
  }
}

// The state of `p` of type State, created as the optimizer's first step would start it.
template <typename State>
State& stateOf(torch::optim::Optimizer& optimizer, const at::Tensor& p, bool amsgrad) {
  auto& states = optimizer.state();
  const auto key = stateKey(states, p);
  auto it = states.find(key);
  if (it == states.end()) {
    auto fresh = std::make_unique<State>();
    if constexpr (std::is_same_v<State, torch::optim::SGDParamState>) {
      fresh->momentum_buffer(at::zeros_like(p));
    } else {
      fresh->exp_avg(at::zeros_like(p));
      fresh->exp_avg_sq(at::zeros_like(p));
      if (amsgrad) fresh->max_exp_avg_sq(at::zeros_like(p));
    }
    it = states.emplace(key, std::move(fresh)).first;
  }
  return static_cast<State&>(*it->second);
}

const dtensor::ShardedParam& recordOf(ShardingStrategy& strategy, const at::Tensor& p) {
  for (const auto& shard : strategy.shardedParameters()) {
    if (shard.tensor.unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) return strategy.param(shard.name);
  }
  throw UsageError("TorchOptimizerState: the optimizer holds a tensor that is not one of the strategy's shards; build "
                   "its parameter groups from strategy.shardedParameters()");
}

}  // namespace

ShardGroups splitByDecay(ShardingStrategy& strategy) {
  ShardGroups groups;
  for (const auto& shard : strategy.shardedParameters()) {
    (optim::defaultDecays(strategy.param(shard.name).spec.globalShape()) ? groups.decay : groups.noDecay).push_back(shard.tensor);
  }
  return groups;
}

TorchOptimizerState::TorchOptimizerState(torch::optim::Optimizer& optimizer, ShardingStrategy& strategy)
    : optimizer_(optimizer), strategy_(strategy) {
  const bool known = dynamic_cast<torch::optim::Adam*>(&optimizer) != nullptr ||
                     dynamic_cast<torch::optim::AdamW*>(&optimizer) != nullptr ||
                     dynamic_cast<torch::optim::SGD*>(&optimizer) != nullptr;
  TESSERA_CHECK_AS(UsageError, known, "TorchOptimizerState: only torch::optim Adam, AdamW and SGD states are saved");
  for (auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) recordOf(strategy, p);
    if (auto* sgd = dynamic_cast<torch::optim::SGDOptions*>(&group.options())) {
      TESSERA_CHECK_AS(UsageError, sgd->dampening() == 0, "TorchOptimizerState: SGD with dampening ",
                       sgd->dampening(), " is not supported (a momentum buffer saved before its first step would "
                       "not equal a fresh one)");
    }
  }
}

std::vector<dtensor::StateEntry> TorchOptimizerState::stateEntries() {
  std::vector<dtensor::StateEntry> entries;
  steps_.clear();
  auto add = [&](const std::string& key, const dtensor::ShardedParam& record, const at::Tensor& t) {
    entries.push_back({key + "/" + record.name, record.spec, t});
  };
  for (auto& group : optimizer_.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      const dtensor::ShardedParam& record = recordOf(strategy_, p);
      int64_t step = -1;
      if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&group.options())) {
        auto& s = stateOf<torch::optim::AdamWParamState>(optimizer_, p, o->amsgrad());
        add("exp_avg", record, s.exp_avg());
        add("exp_avg_sq", record, s.exp_avg_sq());
        if (o->amsgrad()) add("max_exp_avg_sq", record, s.max_exp_avg_sq());
        step = s.step();
      } else if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&group.options())) {
        auto& s = stateOf<torch::optim::AdamParamState>(optimizer_, p, o->amsgrad());
        add("exp_avg", record, s.exp_avg());
        add("exp_avg_sq", record, s.exp_avg_sq());
        if (o->amsgrad()) add("max_exp_avg_sq", record, s.max_exp_avg_sq());
        step = s.step();
      } else if (auto* o = dynamic_cast<torch::optim::SGDOptions*>(&group.options()); o && o->momentum() != 0) {
        add("momentum_buffer", record, stateOf<torch::optim::SGDParamState>(optimizer_, p, false).momentum_buffer());
      }
      if (step < 0) continue;  // SGD counts no steps
      steps_.push_back(at::full({}, step, at::kLong));
      const dtensor::ShardSpec& spec = record.spec;
      entries.push_back({"step/" + record.name,
                         dtensor::ShardSpec({}, at::kLong, spec.worldSize(), spec.rank(), dtensor::Placement::kReplicate), steps_.back()});
    }
  }
  return entries;
}

void TorchOptimizerState::afterLoad() {
  size_t i = 0;
  for (auto& group : optimizer_.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      if (dynamic_cast<torch::optim::SGDOptions*>(&group.options()) != nullptr) continue;
      TESSERA_CHECK(i < steps_.size(), "TorchOptimizerState::afterLoad: the optimizer changed since stateEntries()");
      const int64_t step = steps_[i++].item<int64_t>();
      TESSERA_CHECK(step >= 0, "TorchOptimizerState: loaded step count ", step, " of '", recordOf(strategy_, p).name,
                    "' is negative");
      const bool amsgrad = false;  // the state exists already (stateEntries created it)
      if (dynamic_cast<torch::optim::AdamWOptions*>(&group.options()) != nullptr) {
        stateOf<torch::optim::AdamWParamState>(optimizer_, p, amsgrad).step(step);
      } else {
        stateOf<torch::optim::AdamParamState>(optimizer_, p, amsgrad).step(step);
      }
    }
  }
}

}  // namespace tessera::sharding
