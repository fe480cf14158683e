// One run per run.dir (see run_dir.h).
#include "trainer/run_dir.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <ctime>
#include <system_error>

#include "common/errors.h"
#include "common/logging.h"

namespace tessera::trainer {
namespace fs = std::filesystem;

namespace {

// The files and folders a run writes into run.dir, besides checkpoints/ and logs/.
const char* const kRunOutputs[] = {"metrics.jsonl", "loss.svg", "tb", "export", "samples", "posthoc", "profile"};

// A real directory with entries or a regular file. A link or a FIFO planted at an output's
// name is no earlier run's output: it is left to the writer of that output, which refuses
// or replaces it without writing through it.
bool nonEmpty(const fs::path& p) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(p, ec);
  if (fs::is_directory(st)) return fs::directory_iterator(p, ec) != fs::directory_iterator();
  return fs::is_regular_file(st);
}

std::string utcStamp() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y%m%d-%H%M%S", &utc);
  return buf;
}

std::string joined(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

}  // namespace

EarlierRun findEarlierRun(const fs::path& runDir) {
  EarlierRun found;
  std::error_code ec;
  const fs::path checkpoints = runDir / "checkpoints";
  if (fs::is_directory(fs::symlink_status(checkpoints, ec))) {
    std::vector<std::string> steps;
    for (const fs::directory_entry& e : fs::directory_iterator(checkpoints, ec)) {
      const std::string name = e.path().filename().string();
      const bool debris = name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0;  // a crashed save's
      if (name.rfind("step_", 0) == 0 && !debris) steps.push_back(name);
    }
    if (!steps.empty()) {
      found.newestCheckpoint = *std::max_element(steps.begin(), steps.end());
      found.outputs.push_back(strCat("checkpoints/ (", steps.size(), ", newest ", found.newestCheckpoint, ")"));
      found.movable.push_back("checkpoints");
    }
  }
  for (const char* name : kRunOutputs) {
    if (!nonEmpty(runDir / name)) continue;
    const bool dir = fs::is_directory(fs::symlink_status(runDir / name, ec));
    found.outputs.push_back(std::string(name) + (dir ? "/" : ""));
    found.movable.push_back(name);
  }
  return found;
}

void claimRunDir(const TrainConfig& cfg) {
  const fs::path runDir = cfg.run.dir;
  const EarlierRun earlier = findEarlierRun(runDir);
  if (earlier.empty()) return;
  const std::string& resume = cfg.checkpoint.resume;
  if (resume == "none") {
    throw ConfigError(cfg.origins.errorMessage(
        "run.dir",
        strCat("'", runDir.string(), "' holds an earlier run (", joined(earlier.outputs),
               "); --resume none starts afresh only in a new or empty run.dir, so that two runs never share "
               "metrics, exports or checkpoints. Set another run.dir, move that one away, or continue it with "
               "--resume auto")));
  }
  if (resume != "auto" || !earlier.newestCheckpoint.empty()) return;
  // A run that stopped before its first checkpoint: nothing to resume, its outputs kept
  // aside rather than mixed with this run's.
  const fs::path aside = runDir / ("replaced-" + utcStamp());
  std::error_code ec;
  fs::create_directories(aside, ec);
  if (ec) throw Error(strCat("run.dir: cannot create '", aside.string(), "' to keep an earlier run's outputs: ", ec.message()));
  for (const std::string& name : earlier.movable) {
    fs::rename(runDir / name, aside / name, ec);
    if (ec) {
      throw Error(strCat("run.dir: cannot move '", (runDir / name).string(), "' into '", aside.string(),
                         "': ", ec.message()));
    }
  }
  TLOG_WARN0("run.dir " << runDir.string() << " held the outputs of an earlier run that stopped before its first "
                        << "checkpoint (" << joined(earlier.outputs) << "); moved into " << aside.string()
                        << " and starting afresh");
}

void makeWritableRunDir(const fs::path& runDir) {
  const auto refuse = [&](const fs::path& what, const std::string& reason) {
    throw ConfigError(strCat("run.dir '", runDir.string(), "': cannot write ", what.string(), ": ", reason,
                             " (set run.dir to a directory this user can write)"));
  };
  const fs::path logs = runDir / "logs";
  std::error_code ec;
  fs::create_directories(logs, ec);
  if (ec) refuse(logs, ec.message());
  const fs::path probe = logs / strCat(".write-check-", ::getpid());
  {
    std::ofstream out(probe, std::ios::binary | std::ios::trunc);
    const int error = errno;
    if (!out || !(out << "ok") || !out.flush()) refuse(probe, out ? "write failed" : std::strerror(error));
  }
  fs::remove(probe, ec);
}

}  // namespace tessera::trainer
