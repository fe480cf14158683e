// runCommand (see run_command.h).
#include "tests/support/run_command.h"

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace tessera::test {

std::string shellQuote(const std::string& text) {
  std::string out = "'";
  for (char c : text) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

CommandResult runCommand(const std::string& command, int timeoutSeconds) {
  static int calls = 0;  // a test may run several commands
  const std::filesystem::path out = std::filesystem::temp_directory_path() /
                                    ("tessera_command_" + std::to_string(::getpid()) + "_" + std::to_string(++calls));
  // -k: a program that ignores SIGTERM is killed 10 s later.
  const std::string full = "timeout -k 10 " + std::to_string(timeoutSeconds) + " sh -c " + shellQuote(command) +
                           " < /dev/null > " + shellQuote(out.string()) + " 2>&1";
  const auto start = std::chrono::steady_clock::now();
  const int raw = std::system(full.c_str());
  CommandResult r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  std::ifstream in(out);
  std::stringstream s;
  s << in.rdbuf();
  r.output = s.str();
  std::filesystem::remove(out);
  return r;
}

}  // namespace tessera::test
