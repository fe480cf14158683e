// The command-line parse every Tessera program does, on CLI11: --help prints and exits
// 0, a bad argument becomes a tessera::UsageError (exit status 2 under runMain, with
// CLI11's message naming the option), and so does an option given an empty value
// (`--timesteps ''`, `--out=`), which CLI11 would take for no value at all. Header-only,
// so only the programs need CLI11.
#pragma once

#include <CLI/CLI.hpp>

#include <optional>
#include <string>

#include "common/errors.h"

namespace tessera {

// Parses argv into `app`. Returns the exit status when the program is done (--help), and
// nothing when it should go on.
inline std::optional<int> parseCommandLine(CLI::App& app, int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;  // what follows is the program's (tessera-run's PROGRAM ARGS)
    if (arg.size() < 2 || arg[0] != '-') {
      if (app.get_prefix_command()) break;  // PROGRAM: it and its arguments are not ours
      continue;
    }
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(0, eq);
    const CLI::Option* option = app.get_option_no_throw(name);
    if (option == nullptr || option->get_type_size() == 0) continue;  // not ours, or a flag
    const bool empty = eq != std::string::npos ? eq + 1 == arg.size() : i + 1 < argc && argv[i + 1][0] == '\0';
    if (empty) throw UsageError(strCat(name, ": an empty value (leave the option out for its default)"));
    if (eq == std::string::npos) ++i;  // its value
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    throw UsageError(e.what());
  }
  return std::nullopt;
}

}  // namespace tessera
