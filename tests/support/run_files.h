// What a finished run left in its directory, read back by the end-to-end suites.
#pragma once

#include <nlohmann/json.hpp>

#include <set>
#include <string>
#include <vector>

namespace tessera::test {

// The whole of the file at `path`, as bytes ("" when it cannot be read).
std::string readText(const std::string& path);

// <runDir>/metrics.jsonl, one JSON object per line (empty when the file is missing).
std::vector<nlohmann::json> readMetrics(const std::string& runDir);

// The TensorBoard event files at `path` (a file, or a directory's events.out.tfevents.*)
// as python/read_tensorboard.py reads them: an independent reader (python3-protobuf from
// the same schema, CRC-32C by the crc32c module) that checks every record.
struct TensorBoardValues {
  bool ok = false;     // the reader accepted every record of every file
  std::string output;  // what it printed (its refusal, when not ok)
  std::vector<nlohmann::json> values;  // {"step", "tag", "value" | "image": {...}} each
  std::set<std::string> tags() const;
};
TensorBoardValues readTensorBoard(const std::string& path);

}  // namespace tessera::test
