// libFuzzer target: the elastic rendezvous's messages (distributed/elastic_protocol.h).
// Each line of the input is a request to one server state (a run of 1 to 3 nodes), whose
// answer must be a JSON object the launchers' own reader accepts; and the same line as an
// answer a launcher reads (a foreign process on the port), which may only be refused
// with tessera::Error, and whose closed round, when accepted, holds this node.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/errors.h"
#include "distributed/elastic_protocol.h"

namespace {

tessera::distributed::ElasticOptions fuzzOptions() {
  tessera::distributed::ElasticOptions o;
  o.runId = "fuzz";
  o.minNodes = 1;
  o.maxNodes = 3;
  o.joinTimeoutS = 1e9;
  o.lastCallS = 1e9;
  return o;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessera::distributed;
  const ElasticOptions options = fuzzOptions();
  RendezvousState state(options);
  const std::string input(reinterpret_cast<const char*>(data), size);
  size_t begin = 0;
  while (begin <= input.size()) {
    size_t end = input.find('\n', begin);
    if (end == std::string::npos) end = input.size();
    const std::string line = input.substr(begin, end - begin);
    begin = end + 1;
    // The server: every request gets an answer a launcher can read (or an error).
    const std::string answer = state.answer(line, "10.0.0.1");
    try {
      (void)parseRendezvousAnswer(answer, "server");
    } catch (const tessera::Error&) {
      std::abort();  // the server wrote what its own clients refuse
    }
    // A launcher reading the line as an answer.
    try {
      const RendezvousAnswer a = parseRendezvousAnswer(line, "fuzz");
      if (a.error.empty() && !a.open && a.nodeRank >= 0) {
        const std::string me = a.nodes.empty() ? "x" : a.nodes.front().id;
        const ElasticRound round = closedRound(a, "fuzz", options, me, 2);
        if (round.nodes.at(static_cast<size_t>(round.nodeRank)).id != me) std::abort();
      }
    } catch (const tessera::Error&) {
      // Refused with a message: what a launcher does with a bad answer.
    }
  }
  return 0;
}
