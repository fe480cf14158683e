// Finding a model's units and their parameters (see unit_discovery.h).
#include "sharding/unit_discovery.h"

#include <torch/nn/module.h>

#include <unordered_map>

#include "common/errors.h"
#include "sharding/unit.h"

namespace tessera::sharding {
namespace {

// Whether module `name` matches pattern: "a.*" is every direct child of a, else the name.
bool matches(const std::string& pattern, const std::string& name) {
  if (name == pattern) return true;
  const bool children = pattern.size() > 2 && pattern.compare(pattern.size() - 2, 2, ".*") == 0;
  if (!children) return false;
  const std::string parent = pattern.substr(0, pattern.size() - 2);
  return name.size() > parent.size() + 1 && name.compare(0, parent.size() + 1, parent + ".") == 0 &&
         name.find('.', parent.size() + 1) == std::string::npos;
}

int64_t parameterCount(const torch::nn::Module& module) {
  int64_t count = 0;
  for (const at::Tensor& p : module.parameters(/*recurse=*/true)) count += p.numel();
  return count;
}

}  // namespace

std::vector<FoundUnit> findUnits(const torch::nn::Module& root, const std::vector<std::string>& wrap,
                                 int64_t minParams) {
  const auto modules = root.named_modules("", /*include_self=*/false);
  std::vector<bool> chosen(modules.size(), false);
  for (const std::string& pattern : wrap) {
    int hits = 0;
    for (size_t i = 0; i < modules.size(); ++i) {
      if (!matches(pattern, modules[i].key())) continue;
      chosen[i] = true;
      ++hits;
    }
    TESSERA_CHECK_AS(ConfigError, hits > 0, "sharding.wrap: pattern '", pattern, "' matches no submodule");
  }
  if (wrap.empty()) {
    for (size_t i = 0; i < modules.size(); ++i) chosen[i] = isUnitModule(*modules[i].value());
  }
  std::vector<FoundUnit> out;
  for (size_t i = 0; i < modules.size(); ++i) {
    if (chosen[i] && parameterCount(*modules[i].value()) >= minParams) {
      out.push_back({modules[i].key(), modules[i].value().get()});
    }
  }
  return out;
}

std::vector<size_t> assignOwners(const std::vector<FoundUnit>& units, const std::vector<at::Tensor>& params) {
  std::unordered_map<const c10::TensorImpl*, size_t> index;
  for (size_t i = 0; i < params.size(); ++i) index.emplace(params[i].unsafeGetTensorImpl(), i);
  std::vector<size_t> owner(params.size(), units.size());
  std::vector<bool> claimed(params.size(), false);
  for (size_t ui = units.size(); ui-- > 0;) {  // deeper units come later in named_modules() order
    for (const at::Tensor& p : units[ui].module->parameters(/*recurse=*/true)) {
      auto it = index.find(p.unsafeGetTensorImpl());
      if (it == index.end() || claimed[it->second]) continue;  // an inner unit's
      claimed[it->second] = true;
      owner[it->second] = ui;
    }
  }
  return owner;
}

}  // namespace tessera::sharding
