// Sharded AdamW / Adam / SGD (see sharded_optimizer.h). The update rules follow
// torch.optim (1.13 and 2.x single-tensor paths) operation by operation; Adam/AdamW on
// CPU run them in one pass over the elements (cpu_kernels.h), elsewhere as tensor ops.
#include "optim/sharded_optimizer.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <fnmatch.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "common/errors.h"
#include "common/logging.h"
#include "distributed/communicator.h"
#include "optim/cpu_kernels.h"
#include "optim/muon.h"

namespace tessera::optim {

bool defaultDecays(const std::vector<int64_t>& globalShape) { return globalShape.size() >= 2; }

namespace {

// TESSERA_ADAM_IMPL=foreach: Adam and AdamW step through torch's multi-tensor (foreach)
// ops on every device, PyTorch's foreach=True kernels, instead of Tessera's fused CPU
// loop and torch's fused CUDA kernel: a benchmark's "the same optimizer kernel on both
// sides" (bench/compare_*.py; docs/environment.md). Read once.
bool foreachAdamOnly() {
  static const bool only = [] {
    const char* impl = std::getenv("TESSERA_ADAM_IMPL");
    return impl != nullptr && std::strcmp(impl, "foreach") == 0;
  }();
  return only;
}

}  // namespace

namespace {

bool matches(const std::string& pattern, const std::string& name) { return ::fnmatch(pattern.c_str(), name.c_str(), 0) == 0; }

}  // namespace

bool decays(const OptimizerOptions& options, const std::string& name, const std::vector<int64_t>& shape) {
  if (!defaultDecays(shape)) return false;
  return std::none_of(options.noDecay.begin(), options.noDecay.end(), [&](const std::string& p) { return matches(p, name); });
}

double lrScaleOf(const OptimizerOptions& options, const std::string& name) {
  double scale = 1.0;
  size_t longest = 0;  // the most specific pattern wins: "blocks.0.*" over "blocks.*"
  for (const auto& [pattern, value] : options.lrScale) {
    if (pattern.size() > longest && matches(pattern, name)) {
      scale = value;
      longest = pattern.size();
    }
  }
  return scale;
}

std::vector<std::string> unmatchedPatterns(const OptimizerOptions& options, const std::vector<std::string>& names) {
  std::vector<std::string> patterns = options.noDecay;
  for (const auto& [pattern, scale] : options.lrScale) patterns.push_back(pattern);
  std::vector<std::string> out;
  for (const std::string& pattern : patterns) {
    if (std::none_of(names.begin(), names.end(), [&](const std::string& n) { return matches(pattern, n); })) {
      out.push_back(pattern);
    }
  }
  return out;
}

ShardedOptimizer::ShardedOptimizer(OptimizerOptions o) : options_(std::move(o)), elementwise_(options_) {
  if (options_.kind == OptimizerKind::kMuon) elementwise_.kind = OptimizerKind::kAdamW;
  for (const auto& [pattern, scale] : options_.lrScale) {
    TESSERA_CHECK_AS(ConfigError, scale > 0 && std::isfinite(scale), "ShardedOptimizer: learning-rate scale of '",
                     pattern, "' must be a positive number, got ", scale);
  }
  TESSERA_CHECK_AS(ConfigError, options_.beta1 >= 0 && options_.beta1 < 1 && options_.beta2 >= 0 && options_.beta2 < 1,
                   "ShardedOptimizer: betas must be in [0, 1), got (", options_.beta1, ", ", options_.beta2, ")");
  TESSERA_CHECK_AS(ConfigError, options_.eps > 0, "ShardedOptimizer: eps must be > 0");
  TESSERA_CHECK_AS(ConfigError, options_.weightDecay >= 0, "ShardedOptimizer: weight decay must be >= 0");
  TESSERA_CHECK_AS(ConfigError, !options_.nesterov || (options_.momentum > 0 && options_.dampening == 0),
                   "ShardedOptimizer: nesterov needs momentum > 0 and dampening 0");
  if (options_.kind == OptimizerKind::kMuon) {
    const MuonOptions& m = options_.muon;
    TESSERA_CHECK_AS(ConfigError, m.momentum >= 0 && m.momentum < 1, "ShardedOptimizer: Muon's momentum must be in "
                     "[0, 1), got ", m.momentum);
    TESSERA_CHECK_AS(ConfigError, m.nsSteps >= 1 && m.nsSteps <= 100, "ShardedOptimizer: Muon's Newton-Schulz steps "
                     "must be in [1, 100], got ", m.nsSteps);
    TESSERA_CHECK_AS(ConfigError, m.adamwLrScale > 0 && std::isfinite(m.adamwLrScale), "ShardedOptimizer: Muon's "
                     "AdamW learning rate must be a positive multiple of its own, got ", m.adamwLrScale, "x");
    TESSERA_CHECK_AS(ConfigError, m.nsDtype == at::kFloat || m.nsDtype == at::kBFloat16, "ShardedOptimizer: Muon's "
                     "iteration dtype must be fp32 or bf16, got ", m.nsDtype);
  }
}

void ShardedOptimizer::addParam(dtensor::ShardedParam& param, bool decay, double lrScale) {
  TESSERA_CHECK(param.master.defined() && param.master.scalar_type() == at::kFloat, "ShardedOptimizer::addParam: '",
                param.name, "' must have a defined fp32 master");
  TESSERA_CHECK(!slotIndex_.count(&param), "ShardedOptimizer::addParam: '", param.name, "' registered twice");
  Slot slot;
  slot.param = &param;
  slot.weightDecay = decay ? options_.weightDecay : 0.0;
  slot.lrScale = lrScale;
  slot.muon = options_.kind == OptimizerKind::kMuon && optim::takesMuon(options_.muon, param.name,
                                                                        param.spec.globalShape());
  slot.steps = at::zeros({}, at::kLong);
  slotIndex_.emplace(&param, slots_.size());
  slots_.push_back(std::move(slot));
}

const ShardedOptimizer::Slot& ShardedOptimizer::slotOf(const dtensor::ShardedParam& param) const {
  auto it = slotIndex_.find(&param);
  TESSERA_CHECK(it != slotIndex_.end(), "ShardedOptimizer: parameter '", param.name, "' is not registered");
  return slots_[it->second];
}

// A parameter-group pattern that names no parameter is a typo or a renamed module: said
// once, at the first step.
void ShardedOptimizer::warnUnmatchedPatterns() {
  patternsChecked_ = true;
  std::vector<std::string> names;
  for (const Slot& slot : slots_) names.push_back(slot.param->name);
  for (const std::string& pattern : unmatchedPatterns(options_, names)) {
    TLOG_WARN0("optimizer parameter groups: pattern '" << pattern << "' matches no trainable parameter");
  }
}

std::vector<std::string> ShardedOptimizer::stateNames() const {
  if (options_.kind == OptimizerKind::kSgd) {
    return options_.momentum > 0 ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
  }
  if (options_.kind == OptimizerKind::kMuon) return {"momentum_buffer", "exp_avg", "exp_avg_sq"};
  return {"exp_avg", "exp_avg_sq"};
}

std::vector<std::string> ShardedOptimizer::stateNamesOf(const Slot& slot) const {
  if (options_.kind != OptimizerKind::kMuon) return stateNames();
  return slot.muon ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{"exp_avg", "exp_avg_sq"};
}

namespace {

using StateMap = std::map<std::string, at::Tensor>;

// CPU fp32 buffers with the same element count, contiguous state: fusedAdamStep's input.
bool fusable(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& m, const at::Tensor& v) {
  for (const at::Tensor* t : {&param, &grad, &m, &v}) {
    if (!t->device().is_cpu() || t->scalar_type() != at::kFloat || t->numel() != param.numel()) return false;
  }
  return param.is_contiguous() && m.is_contiguous() && v.is_contiguous();
}

// SGD (with momentum, Nesterov and weight decay as torch.optim.SGD) on one parameter at
// step t (1 for its first).
void sgdStep(const OptimizerOptions& o, at::Tensor& param, at::Tensor grad, StateMap& st, int64_t t, double lr,
             double wd) {
  if (wd != 0) grad = grad.add(param, wd);
  if (o.momentum != 0) {
    // torch starts the buffer as the first gradient (no dampening). Keyed on the step
    // count, not on the buffer's existence: stateEntries() creates zero buffers for
    // parameters not stepped yet, and a checkpoint may carry them.
    at::Tensor& buf = st["momentum_buffer"];
    if (t == 1 || !buf.defined()) {
      buf = grad.clone();
    } else {
      buf.mul_(o.momentum).add_(grad, 1.0 - o.dampening);
    }
    grad = o.nesterov ? grad.add(buf, o.momentum) : buf;
  }
  param.add_(grad, -lr);
}

// fusedAdamStep's scalars for Adam / AdamW, rounded to fp32 as torch does; bc1 and bc2
// are the bias corrections 1 - beta^t.
AdamScalars adamScalars(const OptimizerOptions& o, double lr, double wd, double bc1, double bc2) {
  AdamScalars s;
  s.paramScale = static_cast<float>(o.kind == OptimizerKind::kAdamW ? 1.0 - lr * wd : 1.0);
  s.gradDecay = static_cast<float>(o.kind == OptimizerKind::kAdamW ? 0.0 : wd);
  s.beta1 = static_cast<float>(o.beta1);
  s.oneMinusBeta1 = static_cast<float>(1.0 - o.beta1);
  s.beta2 = static_cast<float>(o.beta2);
  s.oneMinusBeta2 = static_cast<float>(1.0 - o.beta2);
  s.sqrtBiasCorrection2 = static_cast<float>(std::sqrt(bc2));
  s.eps = static_cast<float>(o.eps);
  s.negStepSize = static_cast<float>(-lr / bc1);
  return s;
}

// Adam / AdamW on one parameter at step t: in one pass on the CPU (fusable buffers),
// otherwise torch's single-tensor path as tensor ops.
void adamStep(const OptimizerOptions& o, at::Tensor& param, at::Tensor grad, StateMap& st, int64_t t, double lr,
              double wd) {
  if (!st.count("exp_avg")) {
    st["exp_avg"] = at::zeros_like(param);
    st["exp_avg_sq"] = at::zeros_like(param);
  }
  at::Tensor& m = st["exp_avg"];
  at::Tensor& v = st["exp_avg_sq"];
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(t));
  if (fusable(param, grad, m, v)) {
    // One pass instead of the ten below, rounding as they do on a CPU with FMA (the
    // scalars rounded to fp32 as torch does).
    const AdamScalars s = adamScalars(o, lr, wd, bc1, bc2);
    const at::Tensor g = grad.contiguous();
    fusedAdamStep(param.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                  param.numel(), s);
    return;
  }
  if (o.kind == OptimizerKind::kAdamW) {
    param.mul_(1.0 - lr * wd);
  } else if (wd != 0) {
    grad = grad.add(param, wd);
  }
  m.mul_(o.beta1).add_(grad, 1.0 - o.beta1);
  v.mul_(o.beta2).addcmul_(grad, grad, 1.0 - o.beta2);
  const double stepSize = lr / bc1;
  at::Tensor denom = (v.sqrt() / std::sqrt(bc2)).add_(o.eps);
  param.addcdiv_(m, denom, -stepSize);
}

// Adam / AdamW over many parameters at once that share a step count, learning rate and
// weight decay: torch's multi-tensor ("foreach") form, a handful of launches for all of
// them instead of ten per parameter — what a GPU step needs (torch.optim.AdamW's default
// there). Same arithmetic as adamStep's tensor ops.
struct AdamGroup {
  int64_t t = 0;
  double lr = 0, wd = 0;
  std::vector<at::Tensor> params, grads, ms, vs;

  void step(const OptimizerOptions& o) const {
    if (stepFused(o)) return;
    const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(t));
    const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(t));
    std::vector<at::Tensor> g = grads;
    if (o.kind == OptimizerKind::kAdamW) {
      if (wd != 0) at::_foreach_mul_(params, 1.0 - lr * wd);
    } else if (wd != 0) {
      g = at::_foreach_add(grads, params, wd);
    }
    at::_foreach_mul_(ms, o.beta1);
    at::_foreach_add_(ms, g, 1.0 - o.beta1);
    at::_foreach_mul_(vs, o.beta2);
    at::_foreach_addcmul_(vs, g, g, 1.0 - o.beta2);
    std::vector<at::Tensor> denom = at::_foreach_sqrt(vs);
    at::_foreach_div_(denom, std::sqrt(bc2));
    at::_foreach_add_(denom, o.eps);
    at::_foreach_addcdiv_(params, ms, denom, -lr / bc1);
  }

  // On CUDA with LibTorch 2.x: torch's fused kernel (torch.optim.AdamW(fused=True)), one
  // pass over parameters, gradients and both moments instead of the nine above, and no
  // temporary the size of the parameters. TESSERA_ADAM_IMPL=foreach keeps the nine (to
  // measure one against the other). False where it does not apply.
  bool stepFused(const OptimizerOptions& o) const {
#if TORCH_VERSION_MAJOR >= 2
    if (foreachAdamOnly() || !params.front().is_cuda()) return false;
    for (const at::Tensor& g : grads) {
      if (g.scalar_type() != at::kFloat) return false;
    }
    // The kernel reads the step count (already incremented) from a device tensor per
    // parameter; one shared tensor serves them all.
    const at::Tensor stepCount = at::full({}, static_cast<double>(t), params.front().options().dtype(at::kFloat));
    const std::vector<at::Tensor> steps(params.size(), stepCount);
    if (o.kind == OptimizerKind::kAdamW) {
      at::_fused_adamw_(params, grads, ms, vs, {}, steps, lr, o.beta1, o.beta2, wd, o.eps, /*amsgrad=*/false,
                        /*maximize=*/false);
    } else {
      at::_fused_adam_(params, grads, ms, vs, {}, steps, lr, o.beta1, o.beta2, wd, o.eps, /*amsgrad=*/false,
                       /*maximize=*/false);
    }
    return true;
#else
    (void)o;
    return false;
#endif
  }
};

}  // namespace

void ShardedOptimizer::step(double baseLr) {
  if (!patternsChecked_) warnUnmatchedPatterns();
  c10::NoGradGuard noGrad;
  // Muon's AdamW group: AdamW's rules at Muon's learning rate times its scale.
  const bool muon = options_.kind == OptimizerKind::kMuon;
  const OptimizerOptions& o = elementwise_;
  std::vector<Slot*> muonSlots;
  std::vector<AdamGroup> groups;  // accelerator parameters, by (step, lr, weight decay)
  for (Slot& slot : slots_) {
    dtensor::ShardedParam& p = *slot.param;
    if (slot.muon) {
      muonSlots.push_back(&slot);  // every one, gradient or not: the owners' collectives are matched
      continue;
    }
    if (!p.grad.defined()) continue;
    at::Tensor& param = p.master;
    TESSERA_CHECK(p.grad.numel() == param.numel(), "ShardedOptimizer::step: gradient of '", p.name, "' has ",
                  p.grad.numel(), " elements, parameter shard has ", param.numel());
    at::Tensor grad = p.grad.view(param.sizes()).to(at::kFloat);
    const double lr = baseLr * slot.lrScale * (muon ? options_.muon.adamwLrScale : 1.0);
    const double wd = slot.weightDecay;
    int64_t& steps = *slot.steps.data_ptr<int64_t>();
    const int64_t t = ++steps;
    if (o.kind == OptimizerKind::kSgd) {
      sgdStep(o, param, std::move(grad), slot.state, t, lr, wd);
    } else if (param.device().is_cpu() && !foreachAdamOnly()) {
      adamStep(o, param, std::move(grad), slot.state, t, lr, wd);
    } else {
      if (!slot.state.count("exp_avg")) {
        slot.state["exp_avg"] = at::zeros_like(param);
        slot.state["exp_avg_sq"] = at::zeros_like(param);
      }
      auto group = std::find_if(groups.begin(), groups.end(), [&](const AdamGroup& g) {
        return g.t == t && g.lr == lr && g.wd == wd && g.params.front().device() == param.device();
      });
      if (group == groups.end()) group = groups.insert(groups.end(), AdamGroup{t, lr, wd, {}, {}, {}, {}});
      group->params.push_back(param);
      group->grads.push_back(std::move(grad));
      group->ms.push_back(slot.state["exp_avg"]);
      group->vs.push_back(slot.state["exp_avg_sq"]);
    }
  }
  for (const AdamGroup& group : groups) group.step(o);
  if (!muonSlots.empty()) muonStep(muonSlots, baseLr);
}

void ShardedOptimizer::muonStep(const std::vector<Slot*>& slots, double baseLr) {
  const MuonOptions& mo = options_.muon;
  distributed::Communicator* group = group_.get();
  const auto whole = [&](const dtensor::ShardSpec& spec) {
    return spec.placement() == dtensor::Placement::kReplicate || spec.worldSize() == 1;
  };
  if (muonOwners_.empty()) {
    // Owners spread over the group by the iteration's cost, fixed for the run.
    std::vector<double> costs;
    for (const Slot* slot : slots) {
      const auto& shape = slot->param->spec.globalShape();
      costs.push_back(whole(slot->param->spec) ? 0.0 : orthogonalizeFlops(shape[0], shape[1], mo.nsSteps));
    }
    muonOwners_ = ownersBySize(costs, group ? group->worldSize() : 1);
  }
  // 1. Momentum and u, elementwise on this rank's rows. A parameter without a gradient on
  //    this step (every rank agrees: gradients are reduced together) is left alone.
  std::vector<at::Tensor> us(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    dtensor::ShardedParam& p = *slots[i]->param;
    if (!p.grad.defined()) continue;
    TESSERA_CHECK(p.grad.numel() == p.master.numel(), "ShardedOptimizer::step: gradient of '", p.name, "' has ",
                  p.grad.numel(), " elements, parameter shard has ", p.master.numel());
    TESSERA_CHECK(whole(p.spec) || (group && group->worldSize() == p.spec.worldSize() &&
                                    group->rank() == p.spec.rank()),
                  "ShardedOptimizer: Muon needs the group '", p.name, "' is sharded over (", p.spec.str(),
                  "): setGroup()");
    const at::Tensor grad = p.grad.view(p.master.sizes()).to(at::kFloat);
    at::Tensor& m = slots[i]->state["momentum_buffer"];
    if (!m.defined()) m = at::zeros_like(p.master);
    m.mul_(mo.momentum).add_(grad);
    us[i] = mo.nesterov ? grad.add(m, mo.momentum) : m.clone();
  }
  // 2. The whole u of each sharded matrix gathered to its owner; each rank orthogonalises
  //    the matrices it owns (and its whole ones), those of one shape as one stack.
  std::map<std::pair<int64_t, int64_t>, std::vector<size_t>> mine;  // shape -> slots this rank computes
  std::vector<at::Tensor> wholeUs(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    const dtensor::ShardSpec& spec = slots[i]->param->spec;
    if (!us[i].defined()) continue;
    const auto& shape = spec.globalShape();
    if (whole(spec)) {
      wholeUs[i] = us[i].reshape({shape[0], shape[1]});
    } else {
      const int owner = muonOwners_[i];
      const int64_t padded = spec.paddedNumel();
      at::Tensor all = group->rank() == owner ? at::empty({padded * group->worldSize()}, us[i].options()) : at::Tensor();
      group->gatherToRoot(all, us[i].reshape({-1}), owner);
      if (group->rank() != owner) continue;
      // Shard(0) chunks hold consecutive rows, padding after the last real one.
      wholeUs[i] = all.narrow(0, 0, spec.globalNumel()).view({shape[0], shape[1]});
    }
    mine[{shape[0], shape[1]}].push_back(i);
  }
  std::vector<at::Tensor> xs(slots.size());
  for (const auto& [shape, indices] : mine) {
    std::vector<at::Tensor> stack;
    for (size_t i : indices) stack.push_back(wholeUs[i]);
    const at::Tensor x = orthogonalize(at::stack(stack), mo.nsSteps, mo.nsDtype);
    for (size_t j = 0; j < indices.size(); ++j) xs[indices[j]] = x[static_cast<int64_t>(j)];
  }
  // 3. Each rank's rows of X back from the owners, and the update.
  for (size_t i = 0; i < slots.size(); ++i) {
    Slot& slot = *slots[i];
    dtensor::ShardedParam& p = *slot.param;
    if (!us[i].defined()) continue;
    const dtensor::ShardSpec& spec = p.spec;
    const auto& shape = spec.globalShape();
    at::Tensor rows;  // this rank's rows of X, in the master's layout
    if (whole(spec)) {
      rows = xs[i].view(p.master.sizes());
    } else {
      const int owner = muonOwners_[i];
      at::Tensor full = group->rank() == owner ? xs[i].reshape({-1}) : at::empty({spec.globalNumel()}, us[i].options());
      group->broadcast(full, owner);
      rows = at::zeros({spec.paddedNumel()}, us[i].options());
      const auto [begin, end] = spec.localRowRange();
      const int64_t rowNumel = spec.rowNumel();
      rows.narrow(0, 0, (end - begin) * rowNumel).copy_(full.narrow(0, begin * rowNumel, (end - begin) * rowNumel));
      rows = rows.view(p.master.sizes());
    }
    int64_t& steps = *slot.steps.data_ptr<int64_t>();
    ++steps;
    const double lr = baseLr * slot.lrScale;
    if (slot.weightDecay != 0) p.master.mul_(1.0 - lr * slot.weightDecay);
    p.master.add_(rows, -lr * muonUpdateScale(shape[0], shape[1]));
  }
}

at::Tensor ShardedOptimizer::state(const dtensor::ShardedParam& param, const std::string& key) const {
  const auto& st = slotOf(param).state;
  auto it = st.find(key);
  return it == st.end() ? at::Tensor() : it->second;
}

int64_t ShardedOptimizer::stepCount(const dtensor::ShardedParam& param) const {
  return slotOf(param).steps.item<int64_t>();
}

void ShardedOptimizer::checkLoadedStepCounts(int64_t maxStep, const std::string& source,
                                             const std::string& prefix) const {
  for (const Slot& slot : slots_) {
    const int64_t t = slot.steps.item<int64_t>();
    TESSERA_CHECK(0 <= t && t <= maxStep, source, ": ", prefix, "step/", slot.param->name, " is ", t,
                  ", outside [0, ", maxStep, "] (the optimizer steps the checkpoint's step allows)");
  }
}

std::vector<dtensor::StateEntry> ShardedOptimizer::stateEntries(const std::string& prefix) {
  std::vector<dtensor::StateEntry> entries;
  for (const std::string& key : stateNames()) {
    for (Slot& slot : slots_) {
      const std::vector<std::string> kept = stateNamesOf(slot);
      if (std::find(kept.begin(), kept.end(), key) == kept.end()) continue;
      const dtensor::ShardedParam& p = *slot.param;
      at::Tensor& state = slot.state[key];
      if (!state.defined()) state = at::zeros_like(p.master);
      entries.push_back({prefix + key + "/" + p.name, p.spec, state});
    }
  }
  for (Slot& slot : slots_) {
    const dtensor::ShardSpec& spec = slot.param->spec;
    entries.push_back({prefix + "step/" + slot.param->name,
                       dtensor::ShardSpec({}, at::kLong, spec.worldSize(), spec.rank(), dtensor::Placement::kReplicate), slot.steps});
  }
  return entries;
}

int64_t ShardedOptimizer::stateBytes() const {
  int64_t bytes = 0;
  for (const Slot& slot : slots_) {
    for (const auto& [key, value] : slot.state) bytes += value.numel() * static_cast<int64_t>(value.element_size());
  }
  return bytes;
}

}  // namespace tessera::optim
