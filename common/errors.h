// Tessera's exception types and the checks that throw them.
//
// Library code never calls exit() or aborts: it throws one of these, with a message
// that names the thing that is wrong (file, key, rank, tensor). Apps map them to
// exit codes: ConfigError/UsageError -> 2 (bad input), everything else -> 1.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace tessera {

// Base of every Tessera exception.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad configuration: YAML file, --set override, or a value out of range. Exit status 2.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// Bad command-line arguments. Exit status 2.
class UsageError : public Error {
 public:
  using Error::Error;
};

// A collective, rendezvous or wait that did not finish within its timeout.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// A collective that lost a peer: its process exited, it left the operation with an error,
// or this process aborted its communicators (distributed::abortCommunicators). Under
// fault.survive the trainer takes it for a lost replica group and goes on without it.
class PeerLostError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}
}  // namespace detail

// Builds a message from any streamable pieces: strCat("rank ", r, ": ", what).
template <typename... Args>
std::string strCat(Args&&... args) {
  return detail::concat(std::forward<Args>(args)...);
}

// The first line of an error's message: a library's (gloo's, c10's) without the backtrace
// or context lines it appends.
inline std::string firstLine(const std::string& message) { return message.substr(0, message.find('\n')); }

// Text from outside the program (a shard's member name, a label, a key, a path) as a
// message shows it: in single quotes, with control characters, quotes and backslashes
// escaped (\n, \x1b, \', \\), so that no input can end a message early or forge a log
// line of its own; longer than `maxBytes`, cut and marked "...".
inline std::string quote(std::string_view text, size_t maxBytes = 256) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "'";
  for (size_t i = 0; i < text.size() && i < maxBytes; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == '\\' || c == '\'') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (text.size() > maxBytes) out += "...";
  return out + "'";
}

}  // namespace tessera

// TESSERA_CHECK(cond, "Class::method: ", details...) throws tessera::Error.
// (Not TORCH_CHECK_EQ & co: Debian's LibTorch maps those to glog CHECK, which aborts.)
#define TESSERA_CHECK(cond, ...)                                          \
  do {                                                                    \
    if (!(cond)) {                                                        \
      throw ::tessera::Error(::tessera::strCat(__VA_ARGS__));             \
    }                                                                     \
  } while (false)

// Same, with a chosen exception type: TESSERA_CHECK_AS(ConfigError, cond, ...).
#define TESSERA_CHECK_AS(ExceptionType, cond, ...)                        \
  do {                                                                    \
    if (!(cond)) {                                                        \
      throw ::tessera::ExceptionType(::tessera::strCat(__VA_ARGS__));     \
    }                                                                     \
  } while (false)
