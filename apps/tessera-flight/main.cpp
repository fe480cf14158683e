// tessera-flight: reads every rank's flight-recorder dump of a run and prints the verdict:
// who is behind and at which collective and phase, who disagrees on collective #n, who
// left no dump.
//   tessera-flight DIR [--world-size N]
// DIR: <run.dir>/flight (or the run directory itself), or tessera-run's <log-dir>/flight.
// Exit status: 0 verdict printed; 2 bad arguments; 1 DIR unreadable.
#include <filesystem>
#include <iostream>

#include "common/app_main.h"
#include "common/command_line.h"
#include "common/errors.h"
#include "diagnostics/flight_verdict.h"

int main(int argc, char** argv) {
  return tessera::runMain("tessera-flight", [&]() -> int {
    CLI::App app{"tessera-flight DIR: the verdict from every rank's flight-recorder dump (rank_N.json)"};
    tessera::diagnostics::VerdictInput input;
    app.add_option("dir", input.dir, "<run.dir>/flight, the run directory, or tessera-run's <log-dir>/flight")
        ->required();
    app.add_option("--world-size", input.worldSize, "Ranks of the run (default: as the dumps say)")->check(CLI::Range(1, 1 << 20));
    if (const auto done = tessera::parseCommandLine(app, argc, argv)) return *done;
    std::error_code ec;
    const std::filesystem::path flight = std::filesystem::path(input.dir) / "flight";
    if (std::filesystem::is_directory(flight, ec)) input.dir = flight.string();  // the run directory was given
    if (!std::filesystem::is_directory(input.dir, ec)) {
      throw tessera::UsageError(tessera::strCat("'", input.dir, "' is not a directory (give <run.dir>/flight)"));
    }
    for (const auto& line : tessera::diagnostics::flightVerdict(input)) std::cout << line << "\n";
    return 0;
  });
}
