// An enum's spellings in configs, checkpoints and messages: one table per enum, which
// parsing, printing and the config schema's binding (common/config.h) all read.
//
//   inline constexpr std::array<EnumName<Kind>, 2> kKindNames = {{{"a", Kind::kA}, {"b", Kind::kB}}};
//   Kind k = parseEnum(kKindNames, text, "sharding strategy");   // ConfigError listing a, b
#pragma once

#include <array>
#include <cstddef>
#include <string>

#include "common/errors.h"

namespace tessera {

template <typename E>
struct EnumName {
  const char* name;
  E value;
};

// "a, b, c": the names of a table, for messages.
template <typename E, size_t N>
std::string enumNameList(const std::array<EnumName<E>, N>& table) {
  std::string out;
  for (const auto& entry : table) out += std::string(out.empty() ? "" : ", ") + entry.name;
  return out;
}

// The value named `text`; tessera::ConfigError naming `what` and the names otherwise.
template <typename E, size_t N>
E parseEnum(const std::array<EnumName<E>, N>& table, const std::string& text, const std::string& what) {
  for (const auto& entry : table) {
    if (text == entry.name) return entry.value;
  }
  throw ConfigError(strCat(what, ": unknown '", text, "' (", enumNameList(table), ")"));
}

// The name of `value` ("?" for a value the table lacks).
template <typename E, size_t N>
const char* enumName(const std::array<EnumName<E>, N>& table, E value) {
  for (const auto& entry : table) {
    if (entry.value == value) return entry.name;
  }
  return "?";
}

}  // namespace tessera
