// The documents that set a config's values (see config_internal.h): YAML files with their
// base: chains, strings, --set overrides; each key found where it appears, unknown ones
// named with the closest known key.
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <set>
#include <sstream>

#include "common/config_internal.h"
#include "common/errors.h"
#include "common/file_open.h"

namespace tessera::config {

using namespace detail;

namespace {

// Entry names become tensor-name prefixes and file names: identifiers only.
bool isEntryName(const std::string& name) {
  if (name.empty() || name.size() > 64 || std::isdigit(static_cast<unsigned char>(name[0]))) return false;
  return std::all_of(name.begin(), name.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

}  // namespace

void ConfigSchema::Impl::loadMap(const YAML::Node& map, const std::string& prefix, const std::string& source,
                                 const ConfigSchema& schema, bool skipBase) {
  std::set<std::string> seen;
  for (auto it = map.begin(); it != map.end(); ++it) {
    const YAML::Node keyNode = it->first;
    const YAML::Node value = it->second;
    SourceLocation keyLoc = locate(source, keyNode);
    if (!keyNode.IsScalar()) fail(keyLoc, prefix.empty() ? "<root>" : prefix, "keys must be plain names");
    if (skipBase && keyNode.Scalar() == "base") continue;
    const std::string path = prefix.empty() ? keyNode.Scalar() : prefix + "." + keyNode.Scalar();
    if (!seen.insert(keyNode.Scalar()).second) fail(keyLoc, path, "duplicate key");
    auto found = byPath.find(path);
    if (found != byPath.end()) {
      // Values are located at the value (e.g. the "fast" of "lr: fast"), or at the
      // key when the value is empty.
      SourceLocation valueLoc = value.Mark().line >= 0 ? locate(source, value) : keyLoc;
      assign(fields[found->second], value, valueLoc);
    } else if (sectionPaths.count(path)) {
      if (value.IsNull()) continue;  // "ema:" with nothing under it keeps the defaults
      if (!value.IsMap()) fail(keyLoc, path, strCat("is a section: expected a mapping, got ", describe(value)));
      loadMap(value, path, source, schema);
    } else if (auto named = namedSections.find(path); named != namedSections.end()) {
      if (value.IsNull()) continue;
      if (!value.IsMap()) fail(keyLoc, path, strCat("expected a mapping of names to entries, got ", describe(value)));
      std::set<std::string> names;
      for (auto e = value.begin(); e != value.end(); ++e) {
        const SourceLocation nameLoc = locate(source, e->first);
        if (!e->first.IsScalar()) fail(nameLoc, path, "entry names must be plain names");
        const std::string& name = e->first.Scalar();
        const std::string entryPath = path + "." + name;
        if (!names.insert(name).second) fail(nameLoc, entryPath, "named twice");
        if (!isEntryName(name)) {
          fail(nameLoc, entryPath, "entry names are identifiers: letters, digits and '_', not starting with a digit");
        }
        if (!e->second.IsNull() && !e->second.IsMap()) {
          fail(nameLoc, entryPath, strCat("expected a mapping of keys, got ", describe(e->second)));
        }
        ConfigSchema& entrySchema = entry(named->second, name);
        if (e->second.IsMap()) entrySchema.impl_->loadMap(e->second, entryPath, source, entrySchema);
      }
    } else {
      fail(keyLoc, path, strCat("unknown key", suggestion(schema, path)));
    }
  }
}

namespace {

// Records where each document the parser hands out starts (the events themselves are not
// needed: YAML::Load builds the node).
class DocumentStarts : public YAML::EventHandler {
 public:
  YAML::Mark start;
  void OnDocumentStart(const YAML::Mark& mark) override { start = mark; }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

YAML::Node parseRoot(const std::string& yamlText, const std::string& sourceName) {
  YAML::Node root;
  try {
    // YAML::Load reads the first document and drops the rest: a config holding a second
    // document (or trailing text yaml-cpp skips, such as a stray ',') would run with half
    // of what it says. Not YAML::LoadAll: yaml-cpp 0.7's loops forever on a stray ','
    // (its parser hands out the same empty document again without consuming it), so the
    // parser is asked for at most two documents here.
    root = YAML::Load(yamlText);
    std::istringstream in(yamlText);
    YAML::Parser parser(in);
    DocumentStarts starts;
    if (parser.HandleNextDocument(starts) && parser.HandleNextDocument(starts)) {
      const SourceLocation loc{sourceName, starts.start.line + 1, starts.start.column + 1};
      throw ConfigError(strCat(loc.str(), ": text after the first YAML document (a second document after '---', or ",
                               "a stray character such as ','): a config file holds one document (merge them, or ",
                               "use base:)"));
    }
  } catch (const YAML::Exception& e) {
    SourceLocation loc{sourceName, e.mark.line + 1, e.mark.column + 1};
    if (e.mark.line < 0) loc.line = 0;
    throw ConfigError(strCat(loc.str(), ": malformed YAML: ", e.msg));
  }
  if (!root.IsNull() && !root.IsMap()) {
    fail(locate(sourceName, root), "<root>", strCat("expected a mapping of sections, got ", describe(root)));
  }
  return root;
}

std::string readConfigFile(const std::string& file) {
  // A config is a few KiB; the bound stops /dev/zero-like inputs (refused anyway as not
  // regular) and a mistyped multi-GB file from being read whole.
  constexpr int64_t kMaxConfigBytes = int64_t{4} << 20;
  try {
    return readRegularFile(file, kMaxConfigBytes);
  } catch (const Error& e) {
    throw ConfigError(strCat(file, ": cannot read config file: ", e.what(), relativePathNote(file)));
  }
}

}  // namespace

void ConfigSchema::loadString(const std::string& yamlText, const std::string& sourceName) {
  const YAML::Node root = parseRoot(yamlText, sourceName);
  if (root.IsNull()) return;  // an empty file sets nothing
  if (root["base"]) {
    fail(locate(sourceName, root["base"]), "base", "is only allowed in config files (it names a file next to them)");
  }
  impl_->loadMap(root, "", sourceName, *this);
}

void ConfigSchema::loadFile(const std::string& file) { loadFileWithBase(file, {}); }

void ConfigSchema::loadFileWithBase(const std::string& file, std::vector<std::string> chain) {
  constexpr size_t kMaxBaseDepth = 8;
  const YAML::Node root = parseRoot(readConfigFile(file), file);
  if (root.IsNull()) return;
  if (const YAML::Node base = root["base"]) {
    // `base: other.yaml` (relative to this file): other.yaml's values first, this file's
    // keys override them.
    const SourceLocation loc = locate(file, base);
    if (!base.IsScalar() || base.Scalar().empty()) fail(loc, "base", "expected the path of a config file");
    std::filesystem::path path(base.Scalar());
    if (path.is_relative()) path = std::filesystem::path(file).parent_path() / path;
    path = path.lexically_normal();
    chain.push_back(std::filesystem::path(file).lexically_normal().string());
    if (std::find(chain.begin(), chain.end(), path.string()) != chain.end()) {
      fail(loc, "base", strCat("'", path.string(), "' is already being loaded (a cycle of base files)"));
    }
    if (chain.size() > kMaxBaseDepth) fail(loc, "base", strCat("more than ", kMaxBaseDepth, " levels of base files"));
    loadFileWithBase(path.string(), chain);
  }
  impl_->loadMap(root, "", file, *this, /*skipBase=*/true);
}

void ConfigSchema::applyOverride(const std::string& assignment) {
  const SourceLocation loc{strCat("--set ", assignment), 0, 0};
  const size_t eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    throw ConfigError(strCat(loc.str(), ": expected KEY=VALUE, e.g. --set optim.lr=1e-4"));
  const std::string path = assignment.substr(0, eq);
  const std::string text = assignment.substr(eq + 1);
  auto found = impl_->byPath.find(path);
  if (found == impl_->byPath.end()) {
    if (impl_->sectionPaths.count(path) || impl_->namedSections.count(path)) {
      fail(loc, path, "is a section, not a value; set one of its keys");
    }
    if (auto [section, name] = impl_->namedSectionOf(path); section != nullptr) {
      std::string names;
      for (auto& [existing, entry] : section->entries) {
        if (existing == name) return entry->applyOverride(assignment);
        names += (names.empty() ? "" : ", ") + existing;
      }
      fail(loc, path, strCat("no entry '", name, "' (the config has: ", names.empty() ? "none" : names,
                             "); --set cannot add one, the config file must name it"));
    }
    fail(loc, path, strCat("unknown key", Impl::suggestion(*this, path)));
  }
  Field& field = impl_->fields[found->second];
  YAML::Node node;
  const bool isStringField = std::holds_alternative<std::string*>(field.target) ||
                             std::holds_alternative<std::optional<std::string>*>(field.target);
  if (isStringField && text != "null" && text != "~") {
    node = YAML::Node(text);  // strings are taken verbatim: "--set run.name=a: b" is fine
  } else {
    try {
      node = YAML::Load(text);
    } catch (const YAML::Exception& e) {
      fail(loc, path, strCat("cannot parse value '", text, "': ", e.msg));
    }
  }
  impl_->assign(field, node, loc);
}

}  // namespace tessera::config
