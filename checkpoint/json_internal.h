// Library-internal: strict accessors over nlohmann::json for the readers. Every accessor
// throws CheckpointError naming the document (`source`) and the key path, so a reader
// never leaks nlohmann's exceptions or reads a value of the wrong type. Not a public
// header (nlohmann stays out of the library's interface).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

#include "checkpoint/format.h"

namespace tessera::checkpoint::detail {

using Json = nlohmann::json;

// Parses text into a JSON value, refusing nesting deeper than maxDepth (the parser and
// the destructor recurse, so a hostile "[[[[..." could otherwise exhaust the stack).
Json parseJson(const std::string& text, const std::string& source, int maxDepth = 32);

// A key or name from a file as messages show it: control bytes (a NUL included) escaped as
// \xNN, so nothing cuts the message short or moves the terminal; at most 200 bytes.
std::string printableKey(const std::string& key);

const Json& member(const Json& obj, const char* key, const std::string& where);
bool hasMember(const Json& obj, const char* key);
int64_t asInt(const Json& v, const std::string& where, int64_t min = INT64_MIN, int64_t max = INT64_MAX);
std::string asString(const Json& v, const std::string& where, size_t maxLength = 1 << 20);
const Json& asArray(const Json& v, const std::string& where);
const Json& asObject(const Json& v, const std::string& where);

}  // namespace tessera::checkpoint::detail
