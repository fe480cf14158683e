// Which submodules of a model become zero3/hybrid units, and which unit owns each
// parameter: the modules StrategyOptions::wrap names ("blocks.*": every child of blocks),
// or, with no wrap patterns, the model's sharding::Unit modules (sharding/unit.h); modules
// smaller than FullyShardOptions::minUnitParams stay with their parent. The root is always
// a unit too and owns what no other unit does; deeper units claim their parameters first.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace torch::nn {
class Module;
}

namespace tessera::sharding {

struct FoundUnit {
  std::string name;  // qualified module name
  const torch::nn::Module* module = nullptr;
};

// The units below `root` (the root itself excluded), in named_modules() order.
// tessera::ConfigError for a pattern that matches no submodule.
std::vector<FoundUnit> findUnits(const torch::nn::Module& root, const std::vector<std::string>& wrap,
                                 int64_t minParams);

// The index in `units` of the unit owning each of `params` (units.size(): the root).
std::vector<size_t> assignOwners(const std::vector<FoundUnit>& units, const std::vector<at::Tensor>& params);

}  // namespace tessera::sharding
