// The built-in model architectures, by name (see architecture.h).
#include "models/architecture.h"

#include <algorithm>

#include "common/errors.h"
#include "models/model_options.h"

namespace tessera::models {

const std::vector<const ArchitectureSpec*>& architectures() {
  // One line per architecture: its spec, in its own <arch>_spec.cpp.
  static const std::vector<const ArchitectureSpec*> all = {
      &mlpArchitecture(),
      &gptArchitecture(),
      &diffusionArchitecture(),
      &ditArchitecture(),
      &convNetArchitecture(),
  };
  return all;
}

const ArchitectureSpec* findArchitecture(const std::string& name) {
  for (const ArchitectureSpec* spec : architectures()) {
    if (name == spec->name) return spec;
  }
  return nullptr;
}

std::string architectureNames() {
  std::string names;
  for (const ArchitectureSpec* spec : architectures()) names += (names.empty() ? "" : ", ") + std::string(spec->name);
  return names;
}

const ArchitectureSpec& architecture(const std::string& name) {
  if (const ArchitectureSpec* spec = findArchitecture(name)) return *spec;
  throw ConfigError(strCat("model.arch: unknown architecture '", name, "' (", architectureNames(), ")"));
}

namespace {

// "a denoiser's (diffusion, dit)" or "dit's", "gpt's and dit's": who reads `key`.
std::string readersOf(const std::string& key) {
  std::vector<std::string> readers, denoisers;
  for (const ArchitectureSpec* spec : architectures()) {
    if (spec->denoiser) denoisers.push_back(spec->name);
    if (std::find(spec->keys.begin(), spec->keys.end(), key) != spec->keys.end()) readers.push_back(spec->name);
  }
  std::string list;
  for (size_t i = 0; i < readers.size(); ++i) list += (i == 0 ? "" : ", ") + readers[i];
  if (readers == denoisers) return strCat("a denoiser's (", list, ")");
  std::string owners;
  for (size_t i = 0; i < readers.size(); ++i) {
    owners += (i == 0 ? "" : i + 1 == readers.size() ? " and " : ", ") + readers[i] + "'s";
  }
  return owners;
}

}  // namespace

std::vector<KeyProblem> architectureProblems(const ModelOptions& options, const ArchitectureContext& context,
                                             const std::vector<std::string>& changedKeys) {
  const ArchitectureSpec& spec = architecture(options.arch);
  std::vector<KeyProblem> problems;
  for (const std::string& key : changedKeys) {
    if (key == "arch" || key == "init_from") continue;
    const std::vector<std::string>& modelKeys = modelKeyNames();
    if (std::find(modelKeys.begin(), modelKeys.end(), key) == modelKeys.end()) continue;  // another section's
    if (std::find(spec.keys.begin(), spec.keys.end(), key) != spec.keys.end()) continue;
    problems.push_back({key,
                        strCat("is ", readersOf(key), "; ", context.keyPrefix, "arch ", spec.name,
                               " does not read it (remove it, or set it back to its default)"),
                        /*unread=*/true});
  }
  if (spec.check != nullptr) {
    for (KeyProblem& p : spec.check(options, context)) problems.push_back(std::move(p));
  }
  return problems;
}

}  // namespace tessera::models
