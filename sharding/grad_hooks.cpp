// Gradient-ready hooks and end-of-backward callbacks (see grad_hooks.h).
#include "sharding/grad_hooks.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "common/errors.h"

namespace tessera::sharding {
namespace {

class ReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  explicit ReadyHook(std::function<void()> ready) : ready_(std::move(ready)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    ready_();
    return outputs;
  }

 private:
  std::function<void()> ready_;
};

}  // namespace

GradReadyHooks::~GradReadyHooks() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(keys_[i]);
}

void GradReadyHooks::add(const at::Tensor& param, std::function<void()> ready) {
  auto accumulator = torch::autograd::impl::grad_accumulator(param);
  TESSERA_CHECK(accumulator != nullptr, "GradReadyHooks: the parameter has no gradient accumulator (requires_grad off?)");
  keys_.push_back(accumulator->add_post_hook(std::make_unique<ReadyHook>(std::move(ready))));
  accumulators_.push_back(std::move(accumulator));
}

void queueAtEndOfBackward(std::function<void()> fn) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(fn));
}

}  // namespace tessera::sharding
