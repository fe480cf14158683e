// Units: the modules a zero3/hybrid strategy gathers before their forward and frees after
// it, one at a time (what FSDP2's fully_shard(block) makes of a block). LibTorch modules
// have no forward hooks and a non-virtual forward(), so the model says where its units are
// in its declarations: a submodule held as sharding::Unit<Block> (several:
// sharding::UnitList<Block>) is an instance of Block whose forward() runs the unit's
// lifecycle when a FullyShardStrategy holds it, and is a plain call otherwise. The forward
// body stays as it was:
//
//   struct NetImpl : torch::nn::Module {
//     NetImpl() { blocks = register_module("blocks", sharding::UnitList<Block>());
//                 for (int i = 0; i < 4; ++i) blocks->emplace_back(64); }   // Block(64)
//     at::Tensor forward(at::Tensor h) { for (auto& b : *blocks) h = b->forward(h); return h; }
//     sharding::UnitList<Block> blocks{nullptr};
//   };
//   sharding::Unit<Net> net;                       // the root is a unit too: net->forward(x)
//   auto fsdp = sharding::fullyShard(*net, comm);  // sharding/fully_shard.h
//
// Parameter names are the plain modules' ("blocks.0.fc.weight"). A unit's forward takes
// tensors and other arguments (copied for an activation-checkpointing recompute) and
// returns a tensor, a std::vector or a std::tuple of tensors.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace tessera::sharding {

// The lower-level form: runs `fn(inputs)` as `module`'s forward — pre-forward unshard, fn,
// post-forward reshard and backward hooks — when `module` is a unit of a live
// FullyShardStrategy; just fn(inputs) otherwise. The trainer enters its models' roots so.
using UnitFunction = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
std::vector<at::Tensor> unitForward(torch::nn::Module& module, const std::vector<at::Tensor>& inputs,
                                    const UnitFunction& fn);

// One tensor in, one out. `fn` is kept by value (a checkpointed unit calls it again in
// backward).
at::Tensor unitForward(torch::nn::Module& module, const at::Tensor& input,
                       const std::function<at::Tensor(const at::Tensor&)>& fn);

// Whether `module` is a unit of a live FullyShardStrategy (its forward runs the lifecycle).
bool isLiveUnit(const torch::nn::Module& module);
// Whether a live FullyShardStrategy holds `param`.
bool heldByFullyShard(const at::Tensor& param);

// What makes a module a unit candidate: a FullyShardStrategy over a model makes every
// module of this kind a unit (unless StrategyOptions::wrap names others).
class UnitMarker {
 public:
  virtual ~UnitMarker() = default;
};
inline bool isUnitModule(const torch::nn::Module& module) { return dynamic_cast<const UnitMarker*>(&module) != nullptr; }

namespace detail {

template <typename T>
constexpr bool kIsTensor = std::is_same_v<std::decay_t<T>, at::Tensor>;

// Argument types that carry tensors without being one: a unit would keep them as constants
// (no gradient to its inputs, wrong under a recompute). Pass their tensors as tensors.
template <typename T>
constexpr bool kHidesTensors = std::is_same_v<std::decay_t<T>, std::optional<at::Tensor>> ||
                               std::is_same_v<std::decay_t<T>, c10::optional<at::Tensor>> ||
                               std::is_same_v<std::decay_t<T>, std::vector<at::Tensor>> ||
                               std::is_same_v<std::decay_t<T>, at::TensorList>;

// Which elements of a tuple type are tensors (one extra false: never an empty array).
template <typename Tuple, size_t... J>
constexpr std::array<bool, sizeof...(J) + 1> tensorFlags(std::index_sequence<J...>) {
  return {kIsTensor<std::tuple_element_t<J, Tuple>>..., false};
}

// Tensor elements of Tuple before position I.
template <size_t I, typename Tuple>
constexpr size_t tensorsBefore() {
  constexpr auto flags = tensorFlags<Tuple>(std::make_index_sequence<std::tuple_size_v<Tuple>>());
  size_t n = 0;
  for (size_t j = 0; j < I; ++j) n += flags[j] ? 1 : 0;
  return n;
}

// Argument I of a call: the captured value, or for a tensor the one in `tensors`.
template <size_t I, typename Tuple>
decltype(auto) argumentAt(const Tuple& captured, const std::vector<at::Tensor>& tensors) {
  if constexpr (kIsTensor<std::tuple_element_t<I, Tuple>>) {
    return static_cast<const at::Tensor&>(tensors[tensorsBefore<I, Tuple>()]);
  } else {
    return static_cast<const std::tuple_element_t<I, Tuple>&>(std::get<I>(captured));
  }
}

template <typename R>
std::vector<at::Tensor> toTensors(R&& result) {
  using T = std::decay_t<R>;
  if constexpr (std::is_same_v<T, at::Tensor>) {
    return {std::forward<R>(result)};
  } else if constexpr (std::is_same_v<T, std::vector<at::Tensor>>) {
    return std::forward<R>(result);
  } else {
    return std::apply([](auto&&... t) { return std::vector<at::Tensor>{t...}; }, std::forward<R>(result));
  }
}

template <typename R, size_t... I>
R tupleOf(const std::vector<at::Tensor>& tensors, std::index_sequence<I...>) {
  return R{tensors[I]...};
}

template <typename R>
R fromTensors(std::vector<at::Tensor> tensors) {
  if constexpr (std::is_same_v<R, at::Tensor>) {
    return std::move(tensors[0]);
  } else if constexpr (std::is_same_v<R, std::vector<at::Tensor>>) {
    return tensors;
  } else {
    return tupleOf<R>(tensors, std::make_index_sequence<std::tuple_size_v<R>>());
  }
}

// A call's argument as the unit function keeps it: a copy, or an empty tensor where the
// call takes a tensor (the function gets its tensors as inputs, also in a recompute).
template <typename A>
std::decay_t<A> captureArgument(const A& a) {
  if constexpr (kIsTensor<A>) {
    return at::Tensor();
  } else {
    return a;
  }
}

template <typename Call, typename Tuple, size_t... I>
std::vector<at::Tensor> invokeCaptured(const Call& call, const Tuple& captured, const std::vector<at::Tensor>& tensors,
                                       std::index_sequence<I...>) {
  return toTensors(call(argumentAt<I, Tuple>(captured, tensors)...));
}

// call(args...) as `module`'s unit forward (see unitForward).
template <typename Result, typename Call, typename... Args>
Result callAsUnit(torch::nn::Module& module, Call call, const Args&... args) {
  static_assert(!(kHidesTensors<Args> || ...),
                "a sharding::Unit's forward takes its tensors as at::Tensor arguments (not optional, vector or "
                "TensorList): wrap the module in a forward of plain tensors, or call sharding::unitForward");
  std::vector<at::Tensor> inputs;
  auto collect = [&inputs](const auto& a) {
    if constexpr (kIsTensor<decltype(a)>) inputs.push_back(a);
  };
  (collect(args), ...);
  auto captured = std::make_tuple(captureArgument(args)...);
  UnitFunction fn = [call, captured](const std::vector<at::Tensor>& tensors) {
    return invokeCaptured(call, captured, tensors, std::index_sequence_for<Args...>());
  };
  return fromTensors<Result>(unitForward(module, inputs, fn));
}

template <typename T, typename = void>
struct ImplOf {
  using type = T;  // a module class
};
template <typename T>
struct ImplOf<T, std::void_t<typename T::ContainedType>> {
  using type = typename T::ContainedType;  // a module holder (TORCH_MODULE)
};

}  // namespace detail

// A module of class Impl that is a unit: its forward() goes through unitForward.
template <typename Impl>
class UnitModule : public Impl, public UnitMarker {
 public:
  using Impl::Impl;

  template <typename... Args>
  auto forward(Args&&... args) -> decltype(std::declval<Impl&>().forward(std::forward<Args>(args)...)) {
    using Result = decltype(std::declval<Impl&>().forward(std::forward<Args>(args)...));
    if (!isLiveUnit(*this)) return Impl::forward(std::forward<Args>(args)...);
    return detail::callAsUnit<Result>(
        *this, [this](const auto&... a) { return this->Impl::forward(a...); }, args...);
  }
};

// A unit holding a module of class M (or of a TORCH_MODULE holder's class): constructed
// from M's constructor arguments, used as the holder would be — unit->forward(x), unit(x),
// unit->member — and registered with register_module like any module holder.
template <typename M>
class Unit : public torch::nn::ModuleHolder<UnitModule<typename detail::ImplOf<M>::type>> {
 public:
  using torch::nn::ModuleHolder<UnitModule<typename detail::ImplOf<M>::type>>::ModuleHolder;
};

// A list of units, as torch::nn::ModuleList holds modules (names "0", "1", ...), typed:
// iterating it, or blocks[i], gives each Unit<M>.
template <typename M>
class UnitListImpl : public torch::nn::Module {
 public:
  void push_back(Unit<M> unit) {
    register_module(std::to_string(units_.size()), unit);
    units_.push_back(std::move(unit));
  }
  template <typename... Args>
  Unit<M>& emplace_back(Args&&... args) {
    push_back(Unit<M>(std::forward<Args>(args)...));
    return units_.back();
  }
  size_t size() const { return units_.size(); }
  Unit<M>& operator[](size_t i) { return units_.at(i); }
  auto begin() { return units_.begin(); }
  auto end() { return units_.end(); }

 private:
  std::vector<Unit<M>> units_;
};

template <typename M>
class UnitList : public torch::nn::ModuleHolder<UnitListImpl<M>> {
 public:
  using torch::nn::ModuleHolder<UnitListImpl<M>>::ModuleHolder;
};

}  // namespace tessera::sharding
