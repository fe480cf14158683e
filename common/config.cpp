// yaml-cpp-backed implementation of the config schema (see config.h).
#include "common/config.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>
#include <sstream>
#include <type_traits>

#include "common/errors.h"
#include "common/file_open.h"

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

namespace {

std::string typeName(const FieldTarget& target) {
  struct Visitor {
    std::string operator()(bool*) const { return "bool"; }
    std::string operator()(int64_t*) const { return "int"; }
    std::string operator()(int*) const { return "int"; }
    std::string operator()(double*) const { return "float"; }
    std::string operator()(std::chrono::milliseconds*) const { return "float"; }
    std::string operator()(const ChoiceTarget&) const { return "string"; }
    std::string operator()(const PairTarget&) const { return "list[float]"; }
    std::string operator()(const ScaledTarget&) const { return "float"; }
    std::string operator()(const IntOrWordTarget& t) const { return "int|" + t.word; }
    std::string operator()(std::map<std::string, double>*) const { return "map[string, float]"; }
    std::string operator()(std::string*) const { return "string"; }
    std::string operator()(std::optional<std::string>*) const { return "string|null"; }
    std::string operator()(std::vector<int64_t>*) const { return "list[int]"; }
    std::string operator()(std::vector<double>*) const { return "list[float]"; }
    std::string operator()(std::vector<std::string>*) const { return "list[string]"; }
  };
  return std::visit(Visitor{}, target);
}

// The shortest decimal that reads back as `v` (0.05, not 0.050000000000000003): what the
// user wrote, for any value that came from a YAML file.
std::string formatDouble(double v) {
  std::string s;
  for (int precision = 1; precision <= 17; ++precision) {
    std::ostringstream out;
    out.precision(precision);
    out << v;
    s = out.str();
    if (std::strtod(s.c_str(), nullptr) == v) break;
  }
  // Keep floats recognisable as floats in YAML ("1.0", not "1").
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

YAML::Node valueNode(const FieldTarget& target) {
  struct Visitor {
    YAML::Node operator()(bool* v) const { return YAML::Node(*v); }
    YAML::Node operator()(int64_t* v) const { return YAML::Node(*v); }
    YAML::Node operator()(int* v) const { return YAML::Node(*v); }
    YAML::Node operator()(double* v) const { return YAML::Node(formatDouble(*v)); }
    YAML::Node operator()(std::chrono::milliseconds* v) const {
      return YAML::Node(formatDouble(static_cast<double>(v->count()) / 1000.0));  // seconds, exact to the ms
    }
    YAML::Node operator()(const ChoiceTarget& c) const { return YAML::Node(c.names.at(c.get())); }
    YAML::Node operator()(const PairTarget& p) const {
      YAML::Node n(YAML::NodeType::Sequence);
      n.push_back(formatDouble(*p.first));
      n.push_back(formatDouble(*p.second));
      n.SetStyle(YAML::EmitterStyle::Flow);
      return n;
    }
    // The shortest decimal that reads back to the same count (bucket_mb 0.1 -> 104858 bytes
    // prints 0.1, not 0.100000381469727).
    YAML::Node operator()(const ScaledTarget& t) const {
      const double exact = static_cast<double>(*t.target) / t.unit;
      for (int digits = 1; digits <= 17; ++digits) {
        std::ostringstream out;
        out.precision(digits);
        out << exact;
        if (std::round(std::strtod(out.str().c_str(), nullptr) * t.unit) == static_cast<double>(*t.target)) {
          return YAML::Node(formatDouble(std::strtod(out.str().c_str(), nullptr)));
        }
      }
      return YAML::Node(formatDouble(exact));
    }
    YAML::Node operator()(const IntOrWordTarget& t) const {
      return *t.target == t.wordValue ? YAML::Node(t.word) : YAML::Node(*t.target);
    }
    YAML::Node operator()(std::map<std::string, double>* v) const {
      YAML::Node n(YAML::NodeType::Map);
      for (const auto& [k, x] : *v) n[k] = formatDouble(x);
      n.SetStyle(YAML::EmitterStyle::Flow);
      return n;
    }
    YAML::Node operator()(std::string* v) const { return YAML::Node(*v); }
    YAML::Node operator()(std::optional<std::string>* v) const {
      return v->has_value() ? YAML::Node(**v) : YAML::Node(YAML::NodeType::Null);
    }
    YAML::Node operator()(std::vector<int64_t>* v) const {
      YAML::Node n(YAML::NodeType::Sequence);
      for (auto x : *v) n.push_back(x);
      n.SetStyle(YAML::EmitterStyle::Flow);
      return n;
    }
    YAML::Node operator()(std::vector<double>* v) const {
      YAML::Node n(YAML::NodeType::Sequence);
      for (auto x : *v) n.push_back(formatDouble(x));
      n.SetStyle(YAML::EmitterStyle::Flow);
      return n;
    }
    YAML::Node operator()(std::vector<std::string>* v) const {
      YAML::Node n(YAML::NodeType::Sequence);
      for (const auto& x : *v) n.push_back(x);
      n.SetStyle(YAML::EmitterStyle::Flow);
      return n;
    }
  };
  return std::visit(Visitor{}, target);
}

// Sets the variable of `to` to the value of `from`'s (the same kind of target).
struct CopyValue {
  const FieldTarget& from;
  void operator()(const ChoiceTarget& c) const { c.set(std::get<ChoiceTarget>(from).get()); }
  void operator()(const PairTarget& p) const {
    *p.first = *std::get<PairTarget>(from).first;
    *p.second = *std::get<PairTarget>(from).second;
  }
  void operator()(const ScaledTarget& t) const { *t.target = *std::get<ScaledTarget>(from).target; }
  void operator()(const IntOrWordTarget& t) const { *t.target = *std::get<IntOrWordTarget>(from).target; }
  template <typename T>
  void operator()(T* to) const {
    *to = *std::get<T*>(from);
  }
};

void copyValue(const FieldTarget& from, FieldTarget& to) { std::visit(CopyValue{from}, to); }

std::string emitInline(const YAML::Node& node) {
  YAML::Emitter out;
  out.SetMapFormat(YAML::Flow);
  out.SetSeqFormat(YAML::Flow);
  out << node;
  return out.c_str();
}

SourceLocation locate(const std::string& source, const YAML::Node& node) {
  SourceLocation loc;
  loc.source = source;
  const YAML::Mark mark = node.Mark();
  if (mark.line >= 0) {
    loc.line = mark.line + 1;
    loc.column = mark.column + 1;
  }
  return loc;
}

[[noreturn]] void fail(const SourceLocation& loc, const std::string& path, const std::string& what) {
  throw ConfigError(strCat(loc.str(), ": ", path, ": ", what));
}

std::string describe(const YAML::Node& node) {
  if (node.IsNull()) return "null";
  if (node.IsScalar()) {
    // Quote at most the start of one line: a file that is not YAML (base: /etc/passwd)
    // parses as one long scalar, and an error must not echo it.
    constexpr size_t kMaxQuoted = 60;
    const std::string& text = node.Scalar();
    const size_t cut = std::min(text.find('\n'), kMaxQuoted);
    return cut >= text.size() ? strCat("'", text, "'") : strCat("'", text.substr(0, cut), "...'");
  }
  if (node.IsSequence()) return "a list";
  if (node.IsMap()) return "a mapping";
  return "an undefined value";
}

// A constraint's bound as written: 1099511627776, not 1.09951e+12.
std::string bound(double v) {
  if (std::floor(v) == v && std::fabs(v) < 9007199254740992.0) return std::to_string(static_cast<int64_t>(v));
  return strCat(v);
}

bool parseInt(const std::string& text, int64_t* out) {
  if (text.empty()) return false;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end != text.c_str() + text.size()) return false;
  *out = v;
  return true;
}

bool parseDouble(const std::string& text, double* out) {
  if (text.empty()) return false;
  // YAML's spellings of infinity/nan are not accepted: no Tessera key wants them.
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  if (errno != 0 || end != text.c_str() + text.size() || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

// Entry names become tensor-name prefixes and file names: identifiers only.
bool isEntryName(const std::string& name) {
  if (name.empty() || name.size() > 64 || std::isdigit(static_cast<unsigned char>(name[0]))) return false;
  return std::all_of(name.begin(), name.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

bool parseBool(const std::string& text, bool* out) {
  std::string lower = text;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  if (lower == "true" || lower == "yes" || lower == "on") { *out = true; return true; }
  if (lower == "false" || lower == "no" || lower == "off") { *out = false; return true; }
  return false;
}

int64_t toInt(const YAML::Node& node, const SourceLocation& loc, const std::string& path) {
  int64_t v = 0;
  if (!node.IsScalar() || !parseInt(node.Scalar(), &v)) fail(loc, path, strCat("expected an integer, got ", describe(node)));
  return v;
}
double toDouble(const YAML::Node& node, const SourceLocation& loc, const std::string& path) {
  double v = 0;
  if (!node.IsScalar() || !parseDouble(node.Scalar(), &v)) fail(loc, path, strCat("expected a number, got ", describe(node)));
  return v;
}
std::string toString(const YAML::Node& node, const SourceLocation& loc, const std::string& path) {
  if (!node.IsScalar()) fail(loc, path, strCat("expected a string, got ", describe(node)));
  return node.Scalar();
}

template <typename T, typename Convert>
std::vector<T> toList(const YAML::Node& node, const SourceLocation& loc, const std::string& path,
                      const char* what, Convert convert) {
  if (!node.IsSequence()) fail(loc, path, strCat("expected a list of ", what, ", got ", describe(node)));
  std::vector<T> out;
  for (size_t i = 0; i < node.size(); ++i) {
    const YAML::Node item = node[i];
    SourceLocation itemLoc = loc.line > 0 && item.Mark().line >= 0 ? locate(loc.source, item) : loc;
    out.push_back(convert(item, itemLoc, strCat(path, "[", i, "]")));
  }
  return out;
}

}  // namespace

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

bool ConfigSchema::hasKey(const std::string& path) const { return impl_->byPath.count(path) > 0; }

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

namespace {

// The constraints of one key (a Field's, which is private to ConfigSchema), checked on
// each value as it is read; an error names the value and where it came from.
struct FieldChecks {
  const std::string& path;
  const SourceLocation& loc;  // where the key's value came from
  const std::optional<double>& min;
  const std::optional<double>& max;
  const std::optional<double>& greaterThan;
  const std::optional<double>& lessThan;
  const std::vector<std::string>& choices;
  const std::optional<size_t>& exactSize;
  bool nonEmpty;

  // A number (the key's or one element's, `shown` as written) against the key's bounds.
  void number(double v, const std::string& shown, const std::string& where, const SourceLocation& at) const {
    if (min && v < *min) fail(at, where, strCat("value ", shown, " is out of range: must be >= ", bound(*min)));
    if (max && v > *max) fail(at, where, strCat("value ", shown, " is out of range: must be <= ", bound(*max)));
    if (greaterThan && !(v > *greaterThan))
      fail(at, where, strCat("value ", shown, " is out of range: must be > ", bound(*greaterThan)));
    if (lessThan && !(v < *lessThan))
      fail(at, where, strCat("value ", shown, " is out of range: must be < ", bound(*lessThan)));
  }
  // A string against the closed set of choices, if the key has one.
  void choice(const std::string& v, const std::string& where, const SourceLocation& at) const {
    if (choices.empty() || std::find(choices.begin(), choices.end(), v) != choices.end()) return;
    std::string list;
    for (size_t i = 0; i < choices.size(); ++i) list += (i ? ", " : "") + choices[i];
    fail(at, where, strCat("'", v, "' is not one of: ", list));
  }
  // The element count of a list, map or string (nonEmpty, exact size).
  void elementCount(size_t n) const {
    if (nonEmpty && n == 0) fail(loc, path, "must not be empty");
    if (exactSize && n != *exactSize) fail(loc, path, strCat("expected ", *exactSize, " elements, got ", n));
  }
};

// Converts a key's YAML value into its target's type, checks it, and stores it there
// (std::visit over FieldTarget: one operator() per kind of target).
struct AssignValue {
  const YAML::Node& node;
  const SourceLocation& loc;
  const std::string& path;
  const FieldChecks& checks;

  void operator()(bool* v) const {
    bool b = false;
    if (!node.IsScalar() || !parseBool(node.Scalar(), &b)) fail(loc, path, strCat("expected true or false, got ", describe(node)));
    *v = b;
  }
  void operator()(int64_t* v) const {
    int64_t x = toInt(node, loc, path);
    checks.number(static_cast<double>(x), std::to_string(x), path, loc);
    *v = x;
  }
  void operator()(int* v) const {
    int64_t x = toInt(node, loc, path);
    if (x < INT_MIN || x > INT_MAX) fail(loc, path, strCat("value ", x, " does not fit an int"));
    checks.number(static_cast<double>(x), std::to_string(x), path, loc);
    *v = static_cast<int>(x);
  }
  void operator()(const ChoiceTarget& c) const {
    const std::string x = toString(node, loc, path);
    checks.choice(x, path, loc);
    c.set(static_cast<size_t>(std::find(c.names.begin(), c.names.end(), x) - c.names.begin()));
  }
  void operator()(const PairTarget& p) const {
    auto list = toList<double>(node, loc, path, "numbers", [&](const YAML::Node& n, const SourceLocation& l, const std::string& at) {
      double x = toDouble(n, l, at);
      checks.number(x, n.Scalar(), at, l);
      return x;
    });
    checks.elementCount(list.size());
    *p.first = list[0];
    *p.second = list[1];
  }
  void operator()(const ScaledTarget& t) const {
    const double x = toDouble(node, loc, path);
    checks.number(x, node.Scalar(), path, loc);
    const double scaled = std::round(x * t.unit);
    if (!(std::fabs(scaled) < 9.2e18)) fail(loc, path, strCat("value ", node.Scalar(), " is too large"));
    *t.target = static_cast<int64_t>(scaled);
  }
  void operator()(const IntOrWordTarget& t) const {
    if (node.IsScalar() && node.Scalar() == t.word) {
      *t.target = t.wordValue;
      return;
    }
    if (node.IsScalar() && !node.Scalar().empty() && std::isalpha(static_cast<unsigned char>(node.Scalar()[0]))) {
      fail(loc, path, strCat("expected an integer or '", t.word, "', got '", node.Scalar(), "'"));
    }
    const int64_t x = toInt(node, loc, path);
    checks.number(static_cast<double>(x), std::to_string(x), path, loc);
    *t.target = x;
  }
  void operator()(std::map<std::string, double>* v) const {
    if (!node.IsMap()) fail(loc, path, strCat("expected a mapping of names to numbers, got ", describe(node)));
    std::map<std::string, double> out;
    for (auto it = node.begin(); it != node.end(); ++it) {
      const std::string key = toString(it->first, loc, path);
      const std::string at = strCat(path, ".", key);
      const SourceLocation l = loc.line > 0 && it->second.Mark().line >= 0 ? locate(loc.source, it->second) : loc;
      const double x = toDouble(it->second, l, at);
      checks.number(x, it->second.Scalar(), at, l);
      if (!out.emplace(key, x).second) fail(l, at, "appears twice");
    }
    checks.elementCount(out.size());
    *v = out;
  }
  void operator()(double* v) const {
    double x = toDouble(node, loc, path);
    checks.number(x, node.Scalar(), path, loc);
    *v = x;
  }
  // Seconds, held as milliseconds.
  void operator()(std::chrono::milliseconds* v) const {
    const double x = toDouble(node, loc, path);
    checks.number(x, node.Scalar(), path, loc);
    const double ms = std::round(x * 1000.0);
    if (!(std::fabs(ms) < 9.2e18)) fail(loc, path, strCat("value ", node.Scalar(), " is too large"));
    *v = std::chrono::milliseconds(static_cast<int64_t>(ms));
  }
  void operator()(std::string* v) const {
    std::string x = toString(node, loc, path);
    checks.elementCount(x.size());
    checks.choice(x, path, loc);
    *v = x;
  }
  void operator()(std::optional<std::string>* v) const {
    if (node.IsNull()) { v->reset(); return; }
    std::string x = toString(node, loc, path);
    checks.choice(x, path, loc);
    *v = x;
  }
  void operator()(std::vector<int64_t>* v) const {
    auto list = toList<int64_t>(node, loc, path, "integers", [&](const YAML::Node& n, const SourceLocation& l, const std::string& p) {
      int64_t x = toInt(n, l, p);
      checks.number(static_cast<double>(x), std::to_string(x), p, l);
      return x;
    });
    checks.elementCount(list.size());
    *v = list;
  }
  void operator()(std::vector<double>* v) const {
    auto list = toList<double>(node, loc, path, "numbers", [&](const YAML::Node& n, const SourceLocation& l, const std::string& p) {
      double x = toDouble(n, l, p);
      checks.number(x, n.Scalar(), p, l);
      return x;
    });
    checks.elementCount(list.size());
    *v = list;
  }
  void operator()(std::vector<std::string>* v) const {
    auto list = toList<std::string>(node, loc, path, "strings", [&](const YAML::Node& n, const SourceLocation& l, const std::string& p) {
      std::string x = toString(n, l, p);
      checks.choice(x, p, l);
      return x;
    });
    checks.elementCount(list.size());
    *v = list;
  }
};

}  // namespace

void ConfigSchema::Impl::assign(Field& field, const YAML::Node& node, const SourceLocation& loc) {
  const FieldChecks checks{field.path, loc, field.min, field.max, field.greaterThan, field.lessThan,
                           field.choices, field.exactSize, field.nonEmpty};
  std::visit(AssignValue{node, loc, field.path, checks}, field.target);
  field.location = loc;
}

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

// Sets `node` at the dotted `path` below `root`, making the maps on the way (yaml-cpp
// keeps insertion order when emitting).
void setAtPath(YAML::Node& root, const std::string& path, const YAML::Node& value) {
  std::vector<std::string> parts;
  std::stringstream ss(path);
  for (std::string part; std::getline(ss, part, '.');) parts.push_back(part);
  YAML::Node node = root;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    YAML::Node child = node[parts[i]];
    if (!child.IsDefined() || child.IsNull()) node[parts[i]] = YAML::Node(YAML::NodeType::Map);
    node.reset(node[parts[i]]);
  }
  node[parts.back()] = value;
}

}  // namespace

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

void ConfigSchema::Impl::addToYaml(YAML::Node& root) const {
  for (const auto& f : fields) setAtPath(root, f.path, valueNode(f.target));
  for (const auto& [path, section] : namedSections) {
    for (const auto& [name, schema] : section.entries) schema->impl_->addToYaml(root);
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

std::vector<std::string> ConfigSchema::changedKeys(const std::string& prefix) const {
  std::vector<std::string> out;
  for (const auto& f : impl_->fields) {
    if (f.path.compare(0, prefix.size(), prefix) == 0 && emitInline(valueNode(f.target)) != f.defaultText) {
      out.push_back(f.path);
    }
  }
  return out;
}

std::map<std::string, std::string> ConfigSchema::values() const {
  std::map<std::string, std::string> out;
  for (const auto& f : impl_->fields) out[f.path] = emitInline(valueNode(f.target));
  for (const auto& [path, section] : impl_->namedSections) {
    for (const auto& [name, schema] : section.entries) out.merge(schema->values());
  }
  return out;
}

std::string ConfigSchema::toYaml() const {
  YAML::Node root(YAML::NodeType::Map);
  impl_->addToYaml(root);
  YAML::Emitter out;
  out << root;
  return std::string(out.c_str()) + "\n";
}

}  // namespace tessera::config
