// The command-line parse every Tessera program does, on CLI11: --help prints and exits
// 0, a bad argument becomes a tessera::UsageError (exit status 2 under runMain, with
// CLI11's message naming the option). Header-only, so only the programs need CLI11.
#pragma once

#include <CLI/CLI.hpp>

#include <optional>

#include "common/errors.h"

namespace tessera {

// Parses argv into `app`. Returns the exit status when the program is done (--help), and
// nothing when it should go on.
inline std::optional<int> parseCommandLine(CLI::App& app, int argc, char** argv) {
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
