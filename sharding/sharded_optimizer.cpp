// Sharded AdamW / Adam / SGD (see sharded_optimizer.h). The update rules follow
// torch.optim (1.13 and 2.x single-tensor paths) operation by operation.
#include "sharding/sharded_optimizer.h"

#include <c10/core/GradMode.h>
#include <cmath>

#include "common/errors.h"

namespace tessera::sharding {

bool defaultDecays(const std::string& name, const std::vector<int64_t>& globalShape) {
  (void)name;
  return globalShape.size() >= 2;
}

ShardedOptimizer::ShardedOptimizer(OptimizerOptions o) : options_(std::move(o)) {
  const auto& n = options_.name;
  TESSERA_CHECK_AS(ConfigError, n == "adamw" || n == "adam" || n == "sgd", "ShardedOptimizer: unknown optimizer '", n,
                   "' (adamw, adam, sgd)");
  TESSERA_CHECK_AS(ConfigError, options_.lr >= 0, "ShardedOptimizer: lr must be >= 0, got ", options_.lr);
  TESSERA_CHECK_AS(ConfigError, options_.beta1 >= 0 && options_.beta1 < 1 && options_.beta2 >= 0 && options_.beta2 < 1,
                   "ShardedOptimizer: betas must be in [0, 1), got (", options_.beta1, ", ", options_.beta2, ")");
  TESSERA_CHECK_AS(ConfigError, options_.eps > 0, "ShardedOptimizer: eps must be > 0");
  TESSERA_CHECK_AS(ConfigError, options_.weightDecay >= 0, "ShardedOptimizer: weight decay must be >= 0");
  TESSERA_CHECK_AS(ConfigError, !options_.nesterov || (options_.momentum > 0 && options_.dampening == 0),
                   "ShardedOptimizer: nesterov needs momentum > 0 and dampening 0");
}

size_t ShardedOptimizer::addParam(std::string name, ShardSpec spec, at::Tensor param, bool decay, double lrScale) {
  TESSERA_CHECK(param.defined() && param.scalar_type() == at::kFloat, "ShardedOptimizer::addParam: '", name,
                "' must be a defined fp32 master buffer");
  OptimizerParam p;
  p.name = std::move(name);
  p.spec = std::move(spec);
  p.param = std::move(param);
  p.weightDecay = decay ? options_.weightDecay : 0.0;
  p.lrScale = lrScale;
  params_.push_back(std::move(p));
  states_.emplace_back();
  stepCounts_.push_back(0);
  return params_.size() - 1;
}

std::vector<std::string> ShardedOptimizer::stateNames() const {
  if (options_.name == "sgd") {
    return options_.momentum > 0 ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
  }
  return {"exp_avg", "exp_avg_sq"};
}

void ShardedOptimizer::step(const std::vector<at::Tensor>& grads, double baseLr) {
  TESSERA_CHECK(grads.size() == params_.size(), "ShardedOptimizer::step: ", grads.size(), " gradients for ",
                params_.size(), " parameters");
  c10::NoGradGuard noGrad;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& grad0 = grads[i];
    if (!grad0.defined()) continue;
    OptimizerParam& p = params_[i];
    TESSERA_CHECK(grad0.numel() == p.param.numel(), "ShardedOptimizer::step: gradient of '", p.name, "' has ",
                  grad0.numel(), " elements, parameter shard has ", p.param.numel());
    at::Tensor grad = grad0.view(p.param.sizes()).to(at::kFloat);
    at::Tensor& param = p.param;
    const double lr = baseLr * p.lrScale;
    const double wd = p.weightDecay;
    auto& st = states_[i];
    const int64_t t = ++stepCounts_[i];

    if (options_.name == "sgd") {
      if (wd != 0) grad = grad.add(param, wd);
      if (options_.momentum != 0) {
        auto it = st.find("momentum_buffer");
        if (it == st.end()) {
          st["momentum_buffer"] = grad.clone();
        } else {
          it->second.mul_(options_.momentum).add_(grad, 1.0 - options_.dampening);
        }
        const at::Tensor& buf = st["momentum_buffer"];
        grad = options_.nesterov ? grad.add(buf, options_.momentum) : buf;
      }
      param.add_(grad, -lr);
      continue;
    }

    // Adam / AdamW.
    if (!st.count("exp_avg")) {
      st["exp_avg"] = at::zeros_like(param);
      st["exp_avg_sq"] = at::zeros_like(param);
    }
    if (options_.name == "adamw") {
      param.mul_(1.0 - lr * wd);
    } else if (wd != 0) {
      grad = grad.add(param, wd);
    }
    at::Tensor& m = st["exp_avg"];
    at::Tensor& v = st["exp_avg_sq"];
    m.mul_(options_.beta1).add_(grad, 1.0 - options_.beta1);
    v.mul_(options_.beta2).addcmul_(grad, grad, 1.0 - options_.beta2);
    const double bc1 = 1.0 - std::pow(options_.beta1, static_cast<double>(t));
    const double bc2 = 1.0 - std::pow(options_.beta2, static_cast<double>(t));
    const double stepSize = lr / bc1;
    at::Tensor denom = (v.sqrt() / std::sqrt(bc2)).add_(options_.eps);
    param.addcdiv_(m, denom, -stepSize);
  }
}

at::Tensor ShardedOptimizer::state(size_t i, const std::string& key) const {
  const auto& st = states_.at(i);
  auto it = st.find(key);
  return it == st.end() ? at::Tensor() : it->second;
}

void ShardedOptimizer::setState(size_t i, const std::string& key, const at::Tensor& value) {
  const auto& p = params_.at(i);
  TESSERA_CHECK(value.numel() == p.param.numel(), "ShardedOptimizer::setState: '", key, "' of '", p.name, "' has ",
                value.numel(), " elements, expected ", p.param.numel());
  states_.at(i)[key] = value.view(p.param.sizes()).to(at::kFloat).clone();
}

int64_t ShardedOptimizer::stateBytes() const {
  int64_t bytes = 0;
  for (const auto& st : states_) {
    for (const auto& [k, v] : st) bytes += v.numel() * static_cast<int64_t>(v.element_size());
  }
  return bytes;
}

}  // namespace tessera::sharding
