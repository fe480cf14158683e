// What a finished run left in its directory, read back by the end-to-end suites.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace tessera::test {

// <runDir>/metrics.jsonl, one JSON object per line (empty when the file is missing).
std::vector<nlohmann::json> readMetrics(const std::string& runDir);

}  // namespace tessera::test
