// The config schema's private parts, shared by its three files (config.h): the schema
// itself (config.cpp), one key's value between YAML and its variable (config_values.cpp),
// and the documents that set values: files, their base: chains, --set overrides
// (config_loading.cpp). Not installed; yaml-cpp stays behind these files.
#pragma once

#include <yaml-cpp/yaml.h>

#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/config.h"

namespace tessera::config {

struct ConfigSchema::Field {
  std::string path;
  FieldTarget target;
  std::string doc;
  std::string defaultText;
  std::optional<double> min, max, greaterThan, lessThan;
  std::vector<std::string> choices;
  std::optional<size_t> exactSize;
  bool required = false;
  bool nonEmpty = false;
  SourceLocation location;  // where the current value came from
};

struct ConfigSchema::Impl {
  std::vector<Field> fields;
  std::map<std::string, size_t> byPath;
  std::set<std::string> sectionPaths;  // every proper prefix of a field path
  std::map<std::string, std::string> sectionDocs;
  // Sections whose keys are names the user picks (addNamedSection).
  struct NamedSection {
    std::function<void(ConfigSchema&, const std::string&)> bindEntry;
    std::vector<std::pair<std::string, std::unique_ptr<ConfigSchema>>> entries;  // in order of appearance
  };
  std::map<std::string, NamedSection> namedSections;

  // Entry `name` of named section `section`, made on first use.
  ConfigSchema& entry(NamedSection& section, const std::string& name);
  // The named section `path` is the first part of, with the entry name; nullptr if none.
  std::pair<NamedSection*, std::string> namedSectionOf(const std::string& path);
  // Adds every field's value to `root` under its dotted path.
  void addToYaml(YAML::Node& root) const;

  // Converts `node` into the field's type, checks its constraints, stores it.
  void assign(Field& field, const YAML::Node& node, const SourceLocation& loc);
  // Walks a YAML mapping at key prefix `prefix` ("" for the root).
  // skipBase: the root map of a config file, whose `base` key loadFile handled.
  void loadMap(const YAML::Node& map, const std::string& prefix, const std::string& source, const ConfigSchema& schema,
               bool skipBase = false);
  // The closest key for an unknown `path`, phrased for an error message.
  static std::string suggestion(const ConfigSchema& schema, const std::string& path);
};

namespace detail {

// The type of a target as docs name it ("int", "list[float]", ...).
std::string typeName(const FieldTarget& target);
// A variable's value as a YAML node (floats in the shortest form that reads back).
YAML::Node valueNode(const FieldTarget& target);
// Sets the variable of `to` to the value of `from`'s (the same kind of target).
void copyValue(const FieldTarget& from, FieldTarget& to);
// A node on one line (flow style): how values and defaults are compared and printed.
std::string emitInline(const YAML::Node& node);
// Where `node` is in file `source`.
SourceLocation locate(const std::string& source, const YAML::Node& node);
// ConfigError "<loc>: <path>: <what>".
[[noreturn]] void fail(const SourceLocation& loc, const std::string& path, const std::string& what);
// A value as an error message shows it: the start of a scalar, "a list", "a mapping".
std::string describe(const YAML::Node& node);
// A constraint's bound as written: 1099511627776, not 1.09951e+12.
std::string bound(double v);

}  // namespace detail
}  // namespace tessera::config
