// ShardedParam: one parameter as a sharding strategy holds it, and the one record every
// other part of a run refers to (the optimizer, the EMA, checkpoints and exports reach a
// parameter's state through it, never through a parallel vector).
//
// A strategy (sharding/strategy.h) builds one record per parameter of its module, in
// named_parameters() order — frozen ones (requires_grad false) too: they are sharded and
// checkpointed like the others, but never stepped — and owns them for its lifetime;
// other code keeps pointers or references to them. StateEntry is the checkpoint's view of any
// piece of sharded state (a master, an optimizer moment, an EMA shard): a name, its
// ShardSpec and the local buffer the spec places.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "dtensor/shard_spec.h"

namespace tessera::dtensor {

struct ShardedParam {
  // As module.named_parameters() names it ("blocks.0.fc1.weight"): the name in
  // checkpoints ("model/<name>") and exports.
  std::string name;
  // The global shape, fp32, and the layout of `master`, `grad` and the optimizer state
  // over the strategy's state group: Shard(0) for zero1/zero2/zero3/hybrid, Replicate for
  // no_shard.
  ShardSpec spec;
  // The fp32 master (spec.localShape(); padding rows zero), updated in place by the
  // optimizer. It may alias the module's parameter storage (fp32 no_shard/zero1/zero2).
  at::Tensor master;
  // The averaged gradient in the master's layout, set by the strategy's gradient
  // synchronisation for the optimizer step that follows, reset after it. Undefined: no
  // gradient this step (the optimizer leaves the parameter and its state alone).
  at::Tensor grad;
  // The module's parameter tensor (the compute copy, in the strategy's param dtype). The
  // same tensor object for the whole run: autograd and the module keep references to it.
  at::Tensor moduleParam;
  // false: a frozen parameter (requires_grad false): no gradient, no optimizer state.
  bool trainable = true;

  // The rows of this parameter this rank owns, as a Shard(0) layout over the state group:
  // `spec` itself when sharded; for a replicated master, an equal share of its rows. What
  // an EMA follows and what an evaluation swaps in, so that state is 1/N of the model per
  // rank under every strategy.
  ShardSpec ownedSpec() const;
  // The owned rows of `master` as a view: the padded master when sharded, this rank's
  // real rows ([rows, rowNumel]) when replicated.
  at::Tensor ownedMaster() const;
};

// One named piece of sharded state, as checkpoints save and load it in place.
struct StateEntry {
  StateEntry() = default;
  StateEntry(std::string name, ShardSpec spec, at::Tensor local)
      : name(std::move(name)), spec(std::move(spec)), local(std::move(local)) {}

  // "model/<param>", "optim/<state>/<param>", "ema/<ema name>/<param>", ...: exports select
  // a prefix and strip it back to the module's names.
  std::string name;
  // Layout of `local` on this rank. Placement::kReplicate: every rank holds the whole
  // tensor; only rank 0 writes it, every rank reads it.
  ShardSpec spec;
  // Shard(0): the padded local buffer (spec.paddedNumel() elements, rows past
  // spec.localRows() are padding). Replicate: the full tensor. dtype == spec.dtype().
  // CPU or CUDA; any shape with the right element count; contiguity not required.
  at::Tensor local;
  // A load that does not find it leaves `local` as it is and reports it
  // (LoadResult::missingOptional): state added after older checkpoints were written.
  bool optional = false;
  // The name older checkpoints hold it under ("" = none): a load that does not find `name`
  // reads this one.
  std::string formerName;
};

}  // namespace tessera::dtensor
