// The profile window and its Chrome-trace files (see profiler.h).
#include "trainer/profiler.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <map>

#include "common/errors.h"
#include "common/file_open.h"
#include "common/logging.h"
#include "distributed/communicator.h"

namespace tessera::trainer {

std::string chromeTraceEvents(const std::vector<trace::Event>& events, int rank, int64_t originNs) {
  // Tracks in order of first appearance: the main thread first, as the recorder named it.
  std::map<std::string, int> tids;
  nlohmann::json out = nlohmann::json::array();
  out.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"args", {{"name", strCat("rank ", rank)}}}});
  out.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", rank}, {"args", {{"sort_index", rank}}}});
  for (const trace::Event& e : events) {
    auto [it, added] = tids.emplace(e.track, static_cast<int>(tids.size()) + 1);
    if (added) {
      out.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank}, {"tid", it->second},
                     {"args", {{"name", e.track}}}});
      out.push_back({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", rank}, {"tid", it->second},
                     {"args", {{"sort_index", it->second}}}});
    }
    out.push_back({{"name", e.name},
                   {"cat", e.category},
                   {"ph", "X"},
                   {"pid", rank},
                   {"tid", it->second},
                   {"ts", static_cast<double>(e.beginNs - originNs) / 1000.0},
                   {"dur", static_cast<double>(e.endNs - e.beginNs) / 1000.0}});
  }
  return out.dump();
}

namespace {

struct OpBegin : at::ObserverContext {
  int64_t ns = 0;
};

std::unique_ptr<at::ObserverContext> onOpStart(const at::RecordFunction& /*op*/) {
  auto begin = std::make_unique<OpBegin>();
  begin->ns = trace::nowNs();
  return begin;
}

void onOpEnd(const at::RecordFunction& op, at::ObserverContext* begin) {
  if (begin == nullptr || !trace::active()) return;
  trace::record({op.name(), "aten", trace::thisThreadName(), static_cast<OpBegin*>(begin)->ns, trace::nowNs()});
}

}  // namespace

AtenOpRecorder::AtenOpRecorder()
    : handle_(at::addGlobalCallback(at::RecordFunctionCallback(&onOpStart, &onOpEnd)
                                        .needsInputs(false)
                                        .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}))) {}

AtenOpRecorder::~AtenOpRecorder() { at::removeCallback(handle_); }

ProfileWindow::ProfileWindow(const ProfileSection& profile, distributed::Communicator& hostComm,
                             std::filesystem::path runDir)
    : profile_(profile), comm_(hostComm), dir_(std::move(runDir) / "profile") {}

void ProfileWindow::beforeStep(int64_t done) {
  if (profile_.start_step <= 0 || done + 1 != profile_.start_step) return;
  // Every rank leaves the barrier within the gloo round trip: each rank's reading here is
  // taken as the same instant, rank 0's clock the origin of the merged trace.
  comm_.barrier();
  originNs_ = trace::nowNs();
  trace::start();
  if (profile_.aten_ops) atenOps_ = std::make_unique<AtenOpRecorder>();
  open_ = true;
}

std::string ProfileWindow::afterStep(int64_t done) {
  if (!open_ || done != profile_.start_step + profile_.steps - 1) return "";
  open_ = false;
  atenOps_.reset();
  const std::vector<trace::Event> events = trace::stop();
  const std::string mine = chromeTraceEvents(events, comm_.rank(), originNs_);
  std::filesystem::create_directories(dir_);
  replaceFile((dir_ / strCat("rank_", comm_.rank(), ".json")).string(), "{\"traceEvents\": " + mine + "}\n");
  // Rank 0 merges: every rank's events, padded to the longest, gathered as bytes.
  const int world = comm_.worldSize();
  at::Tensor lengths = at::zeros({world}, at::kLong);
  lengths[comm_.rank()] = static_cast<int64_t>(mine.size());
  comm_.allReduce(lengths, distributed::ReduceOp::kSum);
  const int64_t longest = lengths.max().item<int64_t>();
  at::Tensor local = at::zeros({longest}, at::kByte);
  std::memcpy(local.data_ptr(), mine.data(), mine.size());
  at::Tensor all = comm_.rank() == 0 ? at::empty({world * longest}, at::kByte) : at::Tensor();
  comm_.gatherToRoot(all, local, 0);
  if (comm_.rank() != 0) return "";
  std::string merged = "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [";
  for (int r = 0; r < world; ++r) {
    const char* bytes = reinterpret_cast<const char*>(all.data_ptr()) + r * longest;
    const std::string events(bytes, static_cast<size_t>(lengths[r].item<int64_t>()));
    // Each rank's is a JSON array: its elements join the merged one.
    const std::string inner = events.size() > 2 ? events.substr(1, events.size() - 2) : "";
    if (inner.empty()) continue;
    if (merged.back() != '[') merged += ",";
    merged += inner;
  }
  merged += "]}\n";
  const std::string path = (dir_ / "trace.json").string();
  replaceFile(path, merged);
  TLOG_INFO0("profile: steps " << profile_.start_step << "-" << done << " of " << world
                               << " ranks traced into " << path << " (open it in ui.perfetto.dev or chrome://tracing)");
  return path;
}

}  // namespace tessera::trainer
