// Small models, data and helpers shared by the sharding strategy tests: an MLP with
// uneven shapes (rows that do not divide by 2, 3 or 4, a one-row weight, a one-element
// bias, a 0-d scale), a wider MLP for byte counts, and reference (single-process
// torch::optim) training to compare sharded runs against.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "distributed/communicator.h"
#include "dtensor/shard_spec.h"
#include "optim/sharded_optimizer.h"
#include "sharding/unit.h"

namespace tessera::sharding::testing {

// Seeds the CPU generator only. torch::manual_seed also seeds (and so initialises) CUDA in
// CUDA builds, after which forked ranks cannot use CUDA or seed it themselves.
inline void seedCpu(uint64_t seed) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(seed);
}

// Tests run several ranks as threads on a 2-core machine: one intra-op thread each.
inline void useOneThread() { at::set_num_threads(1); }

// fc1 [7,5] (7 rows: 2 ranks 4+3, 3 ranks 3+3+1, 4 ranks 2+2+2+1), fc1.bias [7],
// fc2 [3,7] (4 ranks: one rank owns nothing), head [1,3] and head.bias [1] (fewer
// rows than ranks), scale [] (0-d).
struct TinyMlpImpl : torch::nn::Module {
  TinyMlpImpl() {
    scale = register_parameter("scale", torch::full({}, 1.25));
    fc1 = register_module("fc1", torch::nn::Linear(5, 7));
    fc2 = register_module("fc2", torch::nn::Linear(7, 3));
    head = register_module("head", torch::nn::Linear(3, 1));
  }
  at::Tensor forward(const at::Tensor& x) {
    return head(torch::tanh(fc2(torch::tanh(fc1(x))))) * scale;
  }
  at::Tensor scale;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, head{nullptr};
};
TORCH_MODULE(TinyMlp);

// TinyMlp with fc1 and fc2 as units (zero3/hybrid). Uneven MLP: units fc1 [7,5] and fc2 [3,7] (4 ranks: one owns no row of fc2); the root
// keeps head [1,3] + bias [1] (fewer rows than ranks) and a 0-d scale. Linear modules are
// units directly: any module can be one.
struct UnevenMlpImpl : torch::nn::Module {
  UnevenMlpImpl() {
    scale = register_parameter("scale", torch::full({}, 1.25));
    fc1 = register_module("fc1", torch::nn::Linear(5, 7));
    fc2 = register_module("fc2", torch::nn::Linear(7, 3));
    head = register_module("head", torch::nn::Linear(3, 1));
  }
  at::Tensor forward(const at::Tensor& x) {
    return unitForward(*this, x, [this](const at::Tensor& in) {
      at::Tensor h = torch::tanh(unitForward(*fc1, in, [this](const at::Tensor& v) { return fc1(v); }));
      h = torch::tanh(unitForward(*fc2, h, [this](const at::Tensor& v) { return fc2(v); }));
      return head(h) * scale;
    });
  }
  static std::vector<std::string> units() { return {"fc1", "fc2"}; }
  at::Tensor scale;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, head{nullptr};
};
TORCH_MODULE(UnevenMlp);

// 16 -> 128 -> 128 -> 7: Psi = 19591, padding over 2 or 4 ranks one row of head
// (129 elements, 0.7%), so byte counts sit close to the ZeRO formulas.
struct WideMlpImpl : torch::nn::Module {
  WideMlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 128));
    fc2 = register_module("fc2", torch::nn::Linear(128, 128));
    head = register_module("head", torch::nn::Linear(128, 7));
  }
  at::Tensor forward(const at::Tensor& x) { return head(torch::relu(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, head{nullptr};
};
TORCH_MODULE(WideMlp);

inline int64_t parameterCount(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

// Parameter values by name (clones).
inline std::map<std::string, at::Tensor> paramValues(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : m.named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

inline void loadParamValues(torch::nn::Module& m, const std::map<std::string, at::Tensor>& values) {
  torch::NoGradGuard noGrad;
  for (const auto& item : m.named_parameters()) item.value().copy_(values.at(item.key()));
}

// Global batches: steps x [batch, in] inputs and [batch, out] targets.
struct Batches {
  std::vector<at::Tensor> x, y;
};

inline Batches makeBatches(int steps, int64_t batch, int64_t in, int64_t out, uint64_t seed) {
  seedCpu(seed);
  Batches b;
  for (int t = 0; t < steps; ++t) {
    b.x.push_back(torch::randn({batch, in}));
    b.y.push_back(torch::randn({batch, out}));
  }
  return b;
}

// Rows of a global batch that rank `rank` of `world` trains on (equal slices).
inline at::Tensor rankSlice(const at::Tensor& global, int rank, int world) {
  const int64_t rows = global.size(0) / world;
  return global.narrow(0, rank * rows, rows);
}

// Gathers a state tensor laid out by `spec` into its full global tensor (collective).
inline at::Tensor gatherFull(const dtensor::ShardSpec& spec, const at::Tensor& local, distributed::Communicator& comm) {
  return spec.fullTensor(local, comm).clone();
}

// Largest elementwise difference relative to the largest magnitude of `want`.
inline double relativeError(const at::Tensor& got, const at::Tensor& want) {
  const double scale = want.abs().max().item<double>();
  const double diff = (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  return scale > 0 ? diff / scale : diff;
}

// torch::optim equivalent of `o` at learning rate `lr`, over two groups: `decay` with
// o.weightDecay, `noDecay` without.
inline std::unique_ptr<torch::optim::Optimizer> referenceOptimizer(const optim::OptimizerOptions& o, double lr,
                                                                   std::vector<at::Tensor> decay,
                                                                   std::vector<at::Tensor> noDecay) {
  using namespace torch::optim;
  if (o.kind == optim::OptimizerKind::kAdamW) {
    auto opts = AdamWOptions(lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weightDecay);
    auto zero = opts;
    zero.weight_decay(0);
    return std::make_unique<AdamW>(std::vector<OptimizerParamGroup>{
        OptimizerParamGroup(decay, std::make_unique<AdamWOptions>(opts)),
        OptimizerParamGroup(noDecay, std::make_unique<AdamWOptions>(zero))});
  }
  if (o.kind == optim::OptimizerKind::kAdam) {
    auto opts = AdamOptions(lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weightDecay);
    auto zero = opts;
    zero.weight_decay(0);
    return std::make_unique<Adam>(std::vector<OptimizerParamGroup>{
        OptimizerParamGroup(decay, std::make_unique<AdamOptions>(opts)),
        OptimizerParamGroup(noDecay, std::make_unique<AdamOptions>(zero))});
  }
  auto opts =
      SGDOptions(lr).momentum(o.momentum).dampening(o.dampening).nesterov(o.nesterov).weight_decay(o.weightDecay);
  auto zero = opts;
  zero.weight_decay(0);
  return std::make_unique<SGD>(std::vector<OptimizerParamGroup>{
                                   OptimizerParamGroup(decay, std::make_unique<SGDOptions>(opts)),
                                   OptimizerParamGroup(noDecay, std::make_unique<SGDOptions>(zero))},
                               opts);
}

// The same over a module's parameters, grouped by defaultDecays (no decay for 1-D ones).
inline std::unique_ptr<torch::optim::Optimizer> referenceOptimizer(const optim::OptimizerOptions& o, double lr,
                                                                   torch::nn::Module& m) {
  std::vector<at::Tensor> decay, noDecay;
  for (const auto& item : m.named_parameters()) {
    (optim::defaultDecays(item.value().sizes().vec()) ? decay : noDecay).push_back(item.value());
  }
  return referenceOptimizer(o, lr, std::move(decay), std::move(noDecay));
}

// The key torch::optim keeps a parameter's state under: the TensorImpl address printed
// as a string in LibTorch 1.x, the address itself in 2.x.
template <typename Key>
Key optimizerStateKey(const at::Tensor& param) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;
    key << param.unsafeGetTensorImpl();
    return key.str();
  } else {
    return static_cast<Key>(param.unsafeGetTensorImpl());
  }
}

// State `key` of `param` in a torch::optim optimizer (undefined if absent).
inline at::Tensor referenceState(torch::optim::Optimizer& opt, const at::Tensor& param, const std::string& key) {
  auto& states = opt.state();
  auto it = states.find(optimizerStateKey<typename std::decay_t<decltype(states)>::key_type>(param));
  if (it == states.end()) return {};
  if (key == "momentum_buffer") return static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer();
  if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
    return key == "exp_avg" ? s->exp_avg() : s->exp_avg_sq();
  }
  auto& s = static_cast<torch::optim::AdamParamState&>(*it->second);
  return key == "exp_avg" ? s.exp_avg() : s.exp_avg_sq();
}

}  // namespace tessera::sharding::testing
