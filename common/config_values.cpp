// One key's value between YAML and its variable (see config_internal.h): typed parsing
// with the key's constraints checked, the value printed back (the resolved config, the
// defaults in docs), and what the schema reports of its values.
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "common/config_internal.h"
#include "common/errors.h"

namespace tessera::config {
namespace detail {

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

namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

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

std::string bound(double v) {
  if (std::floor(v) == v && std::fabs(v) < 9007199254740992.0) return std::to_string(static_cast<int64_t>(v));
  return strCat(v);
}

}  // namespace detail

using namespace detail;

namespace {

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

void ConfigSchema::Impl::addToYaml(YAML::Node& root) const {
  for (const auto& f : fields) setAtPath(root, f.path, valueNode(f.target));
  for (const auto& [path, section] : namedSections) {
    for (const auto& [name, schema] : section.entries) schema->impl_->addToYaml(root);
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
