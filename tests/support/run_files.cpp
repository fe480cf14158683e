// Reading back a run's files (see run_files.h).
#include "tests/support/run_files.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "tests/support/run_command.h"

namespace tessera::test {

std::string readText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<nlohmann::json> readMetrics(const std::string& runDir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(std::filesystem::path(runDir) / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

std::set<std::string> TensorBoardValues::tags() const {
  std::set<std::string> out;
  for (const auto& v : values) out.insert(v.at("tag").get<std::string>());
  return out;
}

TensorBoardValues readTensorBoard(const std::string& path) {
  const CommandResult r = runCommand(std::string(TESSERA_PYTHON3) + " " + TESSERA_SOURCE_DIR +
                                     "/python/read_tensorboard.py " + shellQuote(path) + " 2>&1");
  TensorBoardValues out;
  out.ok = r.status == 0;
  out.output = r.output;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty() && line[0] == '{') out.values.push_back(nlohmann::json::parse(line));
  }
  return out;
}

}  // namespace tessera::test
