// Schema-driven configuration: typed options structs bound to YAML keys.
//
// An options struct keeps its defaults in-class; a bind function registers each of
// its fields with a ConfigSchema under a dotted key path, with a doc string and its
// constraints. The schema then loads YAML files, applies `--set a.b.c=value`
// overrides (typed like the key they set), validates, and prints the resolved config.
//
//   struct RunOptions { int64_t steps = 200; double lr = 3e-4; };
//   ConfigSchema schema;
//   schema.add("run.steps", &opts.steps, "Optimizer steps to run").min(1);
//   schema.loadFile("my.yaml");          // throws ConfigError "my.yaml:3:10: run.steps: ..."
//   schema.applyOverride("run.steps=5");
//
// Every error is a tessera::ConfigError whose message names the key path and, for
// YAML input, the file, line and column (1-based); apps exit with status 2 on it.
// yaml-cpp stays inside the schema's files (config.cpp, config_values.cpp,
// config_loading.cpp and their private config_internal.h).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "common/enum_names.h"
#include "common/key_origins.h"

namespace tessera::config {

// A key whose value is one of a closed set of names, bound to an enum variable: choiceOf
// builds it from the enum's name table (common/enum_names.h).
struct ChoiceTarget {
  std::vector<std::string> names;
  std::function<size_t()> get;      // the index in `names` of the variable's value
  std::function<void(size_t)> set;  // sets the variable to the value of names[i]
};
template <typename E, size_t N>
ChoiceTarget choiceOf(E* target, const std::array<EnumName<E>, N>& table) {
  ChoiceTarget c;
  for (const auto& entry : table) c.names.push_back(entry.name);
  c.get = [target, table] {
    for (size_t i = 0; i < N; ++i) {
      if (table[i].value == *target) return i;
    }
    return size_t{0};
  };
  c.set = [target, table](size_t i) { *target = table[i].value; };
  return c;
}

// Two numbers written as a list of two ([0.9, 0.999]), bound to two variables.
struct PairTarget {
  double* first;
  double* second;
};

// A number written in `unit`s and held as an integer count (MiB in the config, bytes in
// the variable); constraints apply to the number as written.
struct ScaledTarget {
  int64_t* target;
  double unit;
};

// An integer that may also be written as one word (data.micro_batch: auto), held in the
// integer as `wordValue` (outside the range the constraints allow numbers).
struct IntOrWordTarget {
  int64_t* target;
  std::string word;
  int64_t wordValue;
};

// The C++ variables a key can be bound to. A std::chrono::milliseconds is written in
// seconds (a number; constraints apply to the seconds), so a library's timeout binds as it is.
using FieldTarget = std::variant<bool*, int64_t*, int*, double*, std::string*, std::optional<std::string>*,
                                 std::vector<int64_t>*, std::vector<double>*, std::vector<std::string>*,
                                 std::map<std::string, double>*, std::chrono::milliseconds*, ChoiceTarget,
                                 PairTarget, ScaledTarget, IntOrWordTarget>;

class ConfigSchema;

// Constraints on one registered key; returned by ConfigSchema::add for chaining.
class FieldRef {
 public:
  FieldRef& min(double value);           // numbers (and each element of numeric lists) >= value
  FieldRef& max(double value);           // <= value
  FieldRef& greaterThan(double value);   // > value
  FieldRef& lessThan(double value);      // < value
  FieldRef& oneOf(std::vector<std::string> choices);  // strings (and string list elements)
  FieldRef& required();                  // the key must appear in the YAML (or a --set)
  FieldRef& nonEmpty();                  // strings and lists must not be empty
  FieldRef& size(size_t exact);          // lists must have exactly this many elements

 private:
  friend class ConfigSchema;
  explicit FieldRef(size_t index, ConfigSchema* schema) : index_(index), schema_(schema) {}
  size_t index_;
  ConfigSchema* schema_;
};

// Description of one key, for docs and tests.
struct FieldInfo {
  std::string path;
  std::string type;         // "bool", "int", "float", "string", "string|null", "list[int]", ...
  std::string doc;
  std::string defaultText;  // the default value as YAML
  std::string constraint;   // human-readable, e.g. ">= 1", "one of: mlp, gpt"
  bool required = false;
};

class ConfigSchema {
 public:
  ConfigSchema();
  ~ConfigSchema();
  ConfigSchema(const ConfigSchema&) = delete;
  ConfigSchema& operator=(const ConfigSchema&) = delete;

  // Registers `path` (dotted, e.g. "optim.lr") bound to `target`. The variable's
  // current value is the default. Paths must be unique and not prefix one another.
  FieldRef add(const std::string& path, FieldTarget target, std::string doc);

  // Documents a section ("optim") for the printed schema; optional.
  void describeSection(const std::string& path, std::string doc);

  // Loads YAML text/file onto the bound variables; keys not mentioned keep their
  // values. Throws ConfigError for unreadable files, malformed YAML, unknown keys
  // (with the closest known key), wrong types, out-of-range values, duplicate keys.
  // A file may start with `base: other.yaml` (a path relative to the file): other.yaml
  // is loaded first and this file's keys override it (nested up to 8 levels; cycles are
  // errors). loadString text cannot name a base.
  void loadFile(const std::string& file);
  void loadString(const std::string& yamlText, const std::string& sourceName = "<string>");

  // Applies one "a.b.c=value" override; the value is parsed as a YAML scalar or flow
  // sequence and converted to the key's type.
  void applyOverride(const std::string& assignment);

  // A section whose keys are names the user picks, each entry holding the same keys:
  //   models:
  //     generator: {arch: diffusion, optim: {lr: 1.0e-4}}
  //     critic: {arch: diffusion}
  // Each entry gets a schema of its own, made when the entry first appears in a file
  // (`--set models.<name>.<key>=...` sets a key of an entry that exists; it cannot make
  // one). `bindEntry(entry, name)` creates the entry's storage and registers its keys with
  // their full paths ("models.generator.arch"). Entry names are identifiers (letters,
  // digits, '_'; not starting with a digit): they become tensor-name prefixes and file names.
  void addNamedSection(const std::string& path, std::string doc,
                       std::function<void(ConfigSchema& entry, const std::string& name)> bindEntry);
  // The entries of a named section, in the order they first appeared.
  std::vector<std::pair<std::string, ConfigSchema*>> entries(const std::string& path) const;
  // Sets every key that no file or override set to the value of `defaults`' key
  // `defaultPath(key)` when it has one of the same type (keeping where that value came
  // from): an entry inherits what it does not say from the top level.
  void inheritUnset(const ConfigSchema& defaults, const std::function<std::string(const std::string&)>& defaultPath);
  // The keys starting with `prefix` whose value differs from their default (whoever set it).
  std::vector<std::string> changedKeys(const std::string& prefix) const;

  // Throws ConfigError for every required key that was never given (the first one),
  // entries of named sections included.
  void checkRequired() const;

  // The resolved configuration as YAML (every key, in registration order).
  std::string toYaml() const;
  // Every key's value as inline YAML ("0.05", "[8, 4]", "null"), named sections' entries
  // included, by dotted path: what two configurations are compared by.
  std::map<std::string, std::string> values() const;

  // Where the current value of `path` came from (empty source = default).
  SourceLocation locationOf(const std::string& path) const;
  // Where every key's value came from, named sections' entries included.
  KeyOrigins origins() const;
  // Builds a ConfigError message for a cross-field check: origins().errorMessage(path, what).
  std::string errorMessage(const std::string& path, const std::string& what) const;

  std::vector<FieldInfo> fields() const;
  // Every section path ("ema", "ema.posthoc", named ones: "models") with its doc.
  std::map<std::string, std::string> sections() const;

  // The known key closest to `path` by edit distance ("" if none is close).
  std::string closestKey(const std::string& path) const;

 private:
  friend class FieldRef;
  struct Field;
  void loadFileWithBase(const std::string& file, std::vector<std::string> chain);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Levenshtein distance, used for "did you mean" suggestions.
size_t editDistance(const std::string& a, const std::string& b);

}  // namespace tessera::config
