// Activation checkpointing of zero3/hybrid units (FullyShardOptions::activationCheckpointing):
// a unit's forward runs without keeping its activations, and its backward gathers the unit
// again, recomputes the forward from the saved inputs (with the CPU generator's state the
// forward saw, so dropout draws alike) and runs a nested backward through it, where the
// parameters' gradient hooks reduce the unit as usual.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "sharding/unit.h"

namespace tessera::sharding {

class FullyShardState;
class FsdpUnit;

// Runs `fn(inputs)` as unit `u`'s checkpointed forward (grad mode; u not the root).
std::vector<at::Tensor> runCheckpointed(FullyShardState& state, FsdpUnit& u, const std::vector<at::Tensor>& inputs,
                                        const UnitFunction& fn);

}  // namespace tessera::sharding
