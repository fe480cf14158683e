// Reading back a run's files (see run_files.h).
#include "tests/support/run_files.h"

#include <filesystem>
#include <fstream>

namespace tessera::test {

std::vector<nlohmann::json> readMetrics(const std::string& runDir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(std::filesystem::path(runDir) / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

}  // namespace tessera::test
