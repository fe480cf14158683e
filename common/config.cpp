// The config schema itself (see config.h): its keys, their docs and constraints, named
// sections, inheritance, where each value came from, and error messages that say so;
// values and documents are config_values.cpp's and config_loading.cpp's.
#include "common/config.h"

#include <algorithm>
#include <cctype>

#include "common/config_internal.h"
#include "common/errors.h"

namespace tessera::config {

std::string SourceLocation::str() const {
  if (source.empty()) return "<default>";
  if (line <= 0) return source;
  return strCat(source, ":", line, ":", column);
}

size_t editDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t subst = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, subst});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

using namespace detail;

// ---- FieldRef ---------------------------------------------------------------------

#define TESSERA_FIELD (schema_->impl_->fields[index_])
FieldRef& FieldRef::min(double value) { TESSERA_FIELD.min = value; return *this; }
FieldRef& FieldRef::max(double value) { TESSERA_FIELD.max = value; return *this; }
FieldRef& FieldRef::greaterThan(double value) { TESSERA_FIELD.greaterThan = value; return *this; }
FieldRef& FieldRef::lessThan(double value) { TESSERA_FIELD.lessThan = value; return *this; }
FieldRef& FieldRef::oneOf(std::vector<std::string> choices) { TESSERA_FIELD.choices = std::move(choices); return *this; }
FieldRef& FieldRef::required() { TESSERA_FIELD.required = true; return *this; }
FieldRef& FieldRef::nonEmpty() { TESSERA_FIELD.nonEmpty = true; return *this; }
FieldRef& FieldRef::size(size_t exact) { TESSERA_FIELD.exactSize = exact; return *this; }
#undef TESSERA_FIELD

// ---- ConfigSchema -------------------------------------------------------------------

ConfigSchema::ConfigSchema() : impl_(std::make_unique<Impl>()) {}
ConfigSchema::~ConfigSchema() = default;

FieldRef ConfigSchema::add(const std::string& path, FieldTarget target, std::string doc) {
  TESSERA_CHECK(!path.empty() && path.front() != '.' && path.back() != '.',
                "ConfigSchema::add: bad key path '", path, "'");
  TESSERA_CHECK(!impl_->byPath.count(path) && !impl_->sectionPaths.count(path),
                "ConfigSchema::add: key '", path, "' registered twice");
  for (size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', dot + 1)) {
    std::string prefix = path.substr(0, dot);
    TESSERA_CHECK(!impl_->byPath.count(prefix), "ConfigSchema::add: '", path, "' is inside value key '", prefix, "'");
    impl_->sectionPaths.insert(prefix);
  }
  Field field;
  field.path = path;
  field.target = target;
  field.doc = std::move(doc);
  if (const auto* c = std::get_if<ChoiceTarget>(&target)) field.choices = c->names;  // the closed set, in docs and errors
  if (std::holds_alternative<PairTarget>(target)) field.exactSize = 2;
  field.defaultText = emitInline(valueNode(target));
  impl_->byPath[path] = impl_->fields.size();
  impl_->fields.push_back(std::move(field));
  return FieldRef(impl_->fields.size() - 1, this);
}

void ConfigSchema::describeSection(const std::string& path, std::string doc) {
  impl_->sectionDocs[path] = std::move(doc);
}

std::string ConfigSchema::closestKey(const std::string& path) const {
  std::string best;
  size_t bestDistance = std::string::npos, bestPrefix = 0;
  // Beyond a third of the key's length a suggestion is noise; a candidate whose length
  // differs by more is that far away already, and is not measured.
  const size_t noise = std::max<size_t>(2, path.size() / 3);
  // Ties go to the candidate sharing the longest prefix with `path` ("optim.lrate"
  // suggests "optim.lr", not "optim.name").
  auto consider = [&](const std::string& candidate) {
    const size_t lengthGap = candidate.size() > path.size() ? candidate.size() - path.size() : path.size() - candidate.size();
    if (lengthGap > noise) return;
    const size_t d = editDistance(path, candidate);
    size_t prefix = 0;
    while (prefix < path.size() && prefix < candidate.size() && path[prefix] == candidate[prefix]) ++prefix;
    if (d < bestDistance || (d == bestDistance && prefix > bestPrefix)) {
      bestDistance = d;
      bestPrefix = prefix;
      best = candidate;
    }
  };
  for (const auto& f : impl_->fields) consider(f.path);
  for (const auto& s : impl_->sectionPaths) consider(s);
  for (const auto& [s, section] : impl_->namedSections) consider(s);
  if (bestDistance == std::string::npos || bestDistance > noise) return "";
  return best;
}

SourceLocation ConfigSchema::locationOf(const std::string& path) const {
  auto it = impl_->byPath.find(path);
  TESSERA_CHECK(it != impl_->byPath.end(), "ConfigSchema::locationOf: unknown key '", path, "'");
  return impl_->fields[it->second].location;
}

KeyOrigins ConfigSchema::origins() const {
  KeyOrigins out;
  for (const auto& f : impl_->fields) out.add(f.path, f.location);
  for (const auto& [path, section] : impl_->namedSections) {
    for (const auto& [name, entry] : section.entries) {
      for (const auto& f : entry->impl_->fields) out.add(f.path, f.location);
    }
  }
  return out;
}

std::string ConfigSchema::errorMessage(const std::string& path, const std::string& what) const {
  return origins().errorMessage(path, what);
}

void KeyOrigins::add(const std::string& path, SourceLocation location) { byPath_[path] = std::move(location); }

SourceLocation KeyOrigins::of(const std::string& path) const {
  auto it = byPath_.find(path);
  return it == byPath_.end() ? SourceLocation{} : it->second;
}

std::string KeyOrigins::errorMessage(const std::string& path, const std::string& what) const {
  const SourceLocation at = of(path);
  // A key is named in `what` when it appears as a whole dotted path, not as part of a longer one.
  auto partOfPath = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.'; };
  auto names = [&](const std::string& key) {
    for (size_t pos = what.find(key); pos != std::string::npos; pos = what.find(key, pos + 1)) {
      const size_t end = pos + key.size();
      const bool startOk = pos == 0 || !partOfPath(what[pos - 1]);
      const bool endOk = end == what.size() || !partOfPath(what[end]) ||
                         (what[end] == '.' && (end + 1 == what.size() || !partOfPath(what[end + 1])));
      if (startOk && endOk) return true;
    }
    return false;
  };
  std::string others;
  for (const auto& [key, location] : byPath_) {
    if (key == path || location.isDefault() || !names(key)) continue;
    others += strCat(others.empty() ? "" : "; ", key, ": ", location.str());
  }
  return strCat(at.str(), ": ", path, ": ", what, others.empty() ? "" : strCat(" (", others, ")"));
}

std::vector<FieldInfo> ConfigSchema::fields() const {
  std::vector<FieldInfo> out;
  for (const auto& f : impl_->fields) {
    FieldInfo info;
    info.path = f.path;
    info.type = typeName(f.target);
    info.doc = f.doc;
    info.defaultText = f.defaultText;
    info.required = f.required;
    std::vector<std::string> parts;
    if (f.min) parts.push_back(strCat(">= ", bound(*f.min)));
    if (f.greaterThan) parts.push_back(strCat("> ", bound(*f.greaterThan)));
    if (f.max) parts.push_back(strCat("<= ", bound(*f.max)));
    if (f.lessThan) parts.push_back(strCat("< ", bound(*f.lessThan)));
    if (!f.choices.empty()) {
      std::string c = "one of:";
      for (size_t i = 0; i < f.choices.size(); ++i) c += strCat(i ? ", " : " ", f.choices[i]);
      parts.push_back(c);
    }
    if (f.nonEmpty) parts.push_back("not empty");
    if (f.exactSize) parts.push_back(strCat(*f.exactSize, " elements"));
    for (size_t i = 0; i < parts.size(); ++i) info.constraint += (i ? "; " : "") + parts[i];
    out.push_back(std::move(info));
  }
  return out;
}

std::map<std::string, std::string> ConfigSchema::sections() const {
  std::map<std::string, std::string> out;
  for (const auto& s : impl_->sectionPaths) {
    auto it = impl_->sectionDocs.find(s);
    out[s] = it == impl_->sectionDocs.end() ? "" : it->second;
  }
  for (const auto& [s, section] : impl_->namedSections) out[s] = impl_->sectionDocs.at(s);
  return out;
}

std::string ConfigSchema::Impl::suggestion(const ConfigSchema& schema, const std::string& path) {
  std::string closest = schema.closestKey(path);
  return closest.empty() ? std::string() : strCat(" (did you mean '", closest, "'?)");
}

ConfigSchema& ConfigSchema::Impl::entry(NamedSection& section, const std::string& name) {
  for (auto& [existing, schema] : section.entries) {
    if (existing == name) return *schema;  // a base file and this one name the same entry
  }
  auto schema = std::make_unique<ConfigSchema>();
  section.bindEntry(*schema, name);
  section.entries.emplace_back(name, std::move(schema));
  return *section.entries.back().second;
}

std::pair<ConfigSchema::Impl::NamedSection*, std::string> ConfigSchema::Impl::namedSectionOf(const std::string& path) {
  for (auto& [sectionPath, section] : namedSections) {
    if (path.size() > sectionPath.size() + 1 && path.compare(0, sectionPath.size() + 1, sectionPath + ".") == 0) {
      const std::string rest = path.substr(sectionPath.size() + 1);
      return {&section, rest.substr(0, rest.find('.'))};
    }
  }
  return {nullptr, ""};
}

void ConfigSchema::checkRequired() const {
  for (const auto& f : impl_->fields) {
    if (f.required && f.location.source.empty()) {
      // Point at the section the key belongs in, if that section was given.
      std::string section = f.path.substr(0, f.path.rfind('.'));
      SourceLocation where;
      for (const auto& other : impl_->fields) {
        if (!other.location.source.empty() && other.path.rfind(section + ".", 0) == 0) {
          where = other.location;
          break;
        }
      }
      std::string at = where.source.empty() ? "<config>" : where.str();
      throw ConfigError(strCat(at, ": ", f.path, ": missing required key"));
    }
  }
  for (const auto& [path, section] : impl_->namedSections) {
    for (const auto& [name, schema] : section.entries) schema->checkRequired();
  }
}

void ConfigSchema::addNamedSection(const std::string& path, std::string doc,
                                   std::function<void(ConfigSchema& entry, const std::string& name)> bindEntry) {
  TESSERA_CHECK(!path.empty() && !impl_->byPath.count(path) && !impl_->sectionPaths.count(path) &&
                    !impl_->namedSections.count(path),
                "ConfigSchema::addNamedSection: '", path, "' is taken");
  impl_->namedSections[path].bindEntry = std::move(bindEntry);
  impl_->sectionDocs[path] = std::move(doc);
}

std::vector<std::pair<std::string, ConfigSchema*>> ConfigSchema::entries(const std::string& path) const {
  auto it = impl_->namedSections.find(path);
  TESSERA_CHECK(it != impl_->namedSections.end(), "ConfigSchema::entries: no named section '", path, "'");
  std::vector<std::pair<std::string, ConfigSchema*>> out;
  for (const auto& [name, schema] : it->second.entries) out.emplace_back(name, schema.get());
  return out;
}

void ConfigSchema::inheritUnset(const ConfigSchema& defaults,
                                const std::function<std::string(const std::string&)>& defaultPath) {
  for (auto& f : impl_->fields) {
    if (!f.location.source.empty()) continue;
    auto it = defaults.impl_->byPath.find(defaultPath(f.path));
    if (it == defaults.impl_->byPath.end()) continue;
    const Field& from = defaults.impl_->fields[it->second];
    if (from.target.index() != f.target.index()) continue;
    copyValue(from.target, f.target);
    f.location = from.location;
  }
}

}  // namespace tessera::config
