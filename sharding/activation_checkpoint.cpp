// Activation checkpointing of a unit: a custom autograd function (see activation_checkpoint.h).
#include "sharding/activation_checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <mutex>

#include "common/errors.h"
#include "sharding/fsdp_state.h"
#include "sharding/fsdp_unit.h"

namespace tessera::sharding {
namespace {

struct RecomputeState : torch::CustomClassHolder {
  FullyShardState* state = nullptr;
  FsdpUnit* unit = nullptr;
  UnitFunction fn;
  at::Tensor rngState;  // CPU generator state the forward saw
};

// fn(inputs) with the CPU generator at `rngState`, restored afterwards.
std::vector<at::Tensor> recompute(RecomputeState& state, const std::vector<at::Tensor>& inputs) {
  at::AutoGradMode gradOn(true);
  CounterGuard inside(state.state->checkpointedForwardDepth);
  auto gen = at::detail::getDefaultCPUGenerator();
  at::Tensor current;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    current = gen.get_state();
    gen.set_state(state.rngState);
  }
  std::vector<at::Tensor> outputs = state.fn(inputs);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(current);
  return outputs;
}

// Forward without keeping activations (autograd runs Function::forward with grad off);
// backward gathers the unit if needed, recomputes, and backpropagates through the
// recompute.
struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // `params` are inputs only so that the outputs require grad when the unit's parameters
  // do, even when `inputs` do not (the first unit after frozen or data inputs): otherwise
  // autograd would never reach the recompute. Their gradients come from the nested backward
  // (AccumulateGrad hooks); this node returns none for them.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                at::TensorList params, c10::intrusive_ptr<RecomputeState> state) {
    ctx->save_for_backward(inputs.vec());
    CounterGuard inside(state->state->checkpointedForwardDepth);
    std::vector<at::Tensor> outputs = state->fn(inputs.vec());
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list gradOutputs) {
    auto state = c10::static_intrusive_pointer_cast<RecomputeState>(ctx->saved_data["state"].toCapsule());
    state->unit->waitForUnshard();
    std::vector<at::Tensor> inputs;
    for (const at::Tensor& x : ctx->get_saved_variables()) {
      inputs.push_back(x.defined() ? x.detach().requires_grad_(x.requires_grad()) : x);
    }
    const std::vector<at::Tensor> outputs = recompute(*state, inputs);
    TESSERA_CHECK(outputs.size() == gradOutputs.size(), "FullyShardStrategy: checkpointed unit '", state->unit->name(),
                  "' returned ", outputs.size(), " outputs in the recompute, ", gradOutputs.size(), " in forward");
    std::vector<at::Tensor> roots, grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && gradOutputs[i].defined()) {
        roots.push_back(outputs[i]);
        grads.push_back(gradOutputs[i]);
      }
    }
    if (!roots.empty()) {
      CounterGuard nested(state->state->recomputeDepth);
      torch::autograd::backward(roots, grads);
    }
    torch::autograd::variable_list result;
    for (const at::Tensor& x : inputs) result.push_back(x.defined() && x.requires_grad() ? x.grad() : at::Tensor());
    result.resize(result.size() + state->unit->trainableCount() + 1);  // params, state: none
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> runCheckpointed(FullyShardState& state, FsdpUnit& u, const std::vector<at::Tensor>& inputs,
                                        const UnitFunction& fn) {
  auto recomputeState = c10::make_intrusive<RecomputeState>();
  recomputeState->state = &state;
  recomputeState->unit = &u;
  recomputeState->fn = fn;
  auto gen = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    recomputeState->rngState = gen.get_state();
  }
  std::vector<at::Tensor> params;
  for (size_t j = 0; j < u.trainableCount(); ++j) params.push_back(u.trainableParam(j));
  return CheckpointFunction::apply(at::TensorList(inputs), at::TensorList(params), recomputeState);
}

}  // namespace tessera::sharding
