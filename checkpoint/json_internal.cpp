// Strict JSON accessors for the checkpoint readers (see json_internal.h).
#include "checkpoint/json_internal.h"

#include <cstdio>
#include <set>
#include <string>
#include <vector>

namespace tessera::checkpoint::detail {

std::string printableKey(const std::string& key) {
  std::string out;
  for (char c : key.substr(0, 200)) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", u);
      out += hex;
    } else {
      out += c;
    }
  }
  return key.size() > 200 ? out + "..." : out;
}

Json parseJson(const std::string& text, const std::string& source, int maxDepth) {
  // Depth pre-scan outside strings: cheap, and keeps recursion bounded for the parser
  // and for ~basic_json on whatever it builds.
  int depth = 0;
  bool inString = false, escaped = false;
  for (char c : text) {
    if (inString) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        inString = false;
      }
      continue;
    }
    if (c == '"') {
      inString = true;
    } else if (c == '[' || c == '{') {
      if (++depth > maxDepth) throw CheckpointError(strCat(source, ": JSON nested deeper than ", maxDepth, " levels"));
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  // Duplicate keys: nlohmann keeps the last one silently, so a file edited by appending a
  // key would read as the edit. Each object's keys are collected while parsing.
  std::vector<std::set<std::string>> open;
  std::string duplicate;
  const Json::parser_callback_t noDuplicates = [&](int, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::object_start) {
      open.emplace_back();
    } else if (event == Json::parse_event_t::object_end) {
      if (!open.empty()) open.pop_back();
    } else if (event == Json::parse_event_t::key && !open.empty() && duplicate.empty()) {
      const std::string key = parsed.get<std::string>();
      if (!open.back().insert(key).second) duplicate = key;
    }
    return true;
  };
  Json j = Json::parse(text, noDuplicates, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw CheckpointError(strCat(source, ": not valid JSON"));
  if (!duplicate.empty()) {
    throw CheckpointError(strCat(source, ": key '", printableKey(duplicate), "' appears twice in one object"));
  }
  return j;
}

bool hasMember(const Json& obj, const char* key) { return obj.is_object() && obj.contains(key); }

const Json& member(const Json& obj, const char* key, const std::string& where) {
  if (!obj.is_object()) throw CheckpointError(strCat(where, ": expected a JSON object"));
  auto it = obj.find(key);
  if (it == obj.end()) throw CheckpointError(strCat(where, ": missing key '", key, "'"));
  return *it;
}

int64_t asInt(const Json& v, const std::string& where, int64_t min, int64_t max) {
  int64_t out;
  if (v.is_number_integer() && !v.is_number_unsigned()) {
    out = v.get<int64_t>();
  } else if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX)) throw CheckpointError(strCat(where, ": integer ", u, " is too large"));
    out = static_cast<int64_t>(u);
  } else {
    throw CheckpointError(strCat(where, ": expected an integer, got ", v.type_name()));
  }
  if (out < min || out > max) {
    throw CheckpointError(strCat(where, ": ", out, " is outside [", min, ", ", max, "]"));
  }
  return out;
}

std::string asString(const Json& v, const std::string& where, size_t maxLength) {
  if (!v.is_string()) throw CheckpointError(strCat(where, ": expected a string, got ", v.type_name()));
  const auto& s = v.get_ref<const std::string&>();
  if (s.size() > maxLength) throw CheckpointError(strCat(where, ": string of ", s.size(), " bytes is too long"));
  return s;
}

const Json& asArray(const Json& v, const std::string& where) {
  if (!v.is_array()) throw CheckpointError(strCat(where, ": expected an array, got ", v.type_name()));
  return v;
}

const Json& asObject(const Json& v, const std::string& where) {
  if (!v.is_object()) throw CheckpointError(strCat(where, ": expected an object, got ", v.type_name()));
  return v;
}

}  // namespace tessera::checkpoint::detail
