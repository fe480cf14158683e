// libFuzzer target: a flight-recorder dump as tessera-flight and tessera-run read it
// (diagnostics/flight_verdict.h), beside a well-formed dump of another rank so that the
// cross-rank analysis (behind, disagreeing, silent ranks) runs on what the input holds.
// flightVerdict must never throw for what is in the directory and must always say
// something.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "diagnostics/flight_verdict.h"

namespace {

const char* kOtherRank = R"({"format": "tessera.flight/1", "rank": 1, "world_size": 2, "reason": "SIGTERM",
  "step": 3, "threads": [{"thread": "main", "doing": ["step 3", "forward layers.1"], "for_s": 3.0}],
  "groups": [{"group": "world_cpu", "backend": "gloo", "rank": 1, "members": [0, 1], "next_seq": 2,
  "entries": [{"seq": 0, "op": "all_reduce", "dtype": "Float", "numel": 256, "bytes": 1024, "tag": "layers.1",
  "thread": "main", "step": 1, "state": "completed", "issued_s_ago": 5.0},
  {"seq": 1, "op": "all_reduce", "dtype": "Float", "numel": 256, "bytes": 1024, "tag": "layers.1",
  "thread": "main", "step": 2, "state": "completed", "issued_s_ago": 4.0}]}]})";

std::string scratchDir() {
  const std::string dir = (std::filesystem::temp_directory_path() / ("tessera_flight_fuzz_" + std::to_string(::getpid()))).string();
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/rank_1.json") << kOtherRank;
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = scratchDir();
  {
    std::ofstream out(dir + "/rank_0.json", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  tessera::diagnostics::VerdictInput input;
  input.dir = dir;
  input.fates[0] = "exit code 1";
  if (tessera::diagnostics::flightVerdict(input).empty()) std::abort();  // a verdict always says something
  return 0;
}
