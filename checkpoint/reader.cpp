// Resharding load, resume-auto and the listing of checkpoints (see reader.h); the reader
// of one checkpoint directory is checkpoint_reader.cpp.
#include "checkpoint/reader.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <set>

#include "checkpoint/format.h"
#include "checkpoint/safetensors.h"
#include "common/errors.h"
#include "common/logging.h"
#include "distributed/communicator.h"

namespace tessera::checkpoint {

namespace fs = std::filesystem;

void checkEntry(const StateEntry& e, const char* where) {
  TESSERA_CHECK(!e.name.empty(), where, ": a state entry has an empty name");
  TESSERA_CHECK(e.local.defined(), where, ": entry '", e.name, "' has an undefined tensor");
  const bool replicated = e.spec.placement() == dtensor::Placement::kReplicate;
  const int64_t need = replicated ? e.spec.globalNumel() : e.spec.paddedNumel();
  TESSERA_CHECK(e.local.numel() == need, where, ": entry '", e.name, "' holds ", e.local.numel(),
                " elements, its spec ", e.spec.str(), " needs ", need);
  TESSERA_CHECK(e.local.scalar_type() == e.spec.dtype(), where, ": entry '", e.name, "' is ", e.local.scalar_type(),
                ", its spec says ", c10::toString(e.spec.dtype()));
}

std::vector<PlanMismatch> planLoad(const CheckpointMetadata& md, const std::vector<StateEntry>& entries, bool strict) {
  std::vector<PlanMismatch> out;
  std::set<std::string> used;
  for (const auto& e : entries) {
    const TensorInfo* t = md.find(e.name);
    if (t == nullptr && !e.formerName.empty()) t = md.find(e.formerName);
    if (t == nullptr) {
      if (!e.optional) out.push_back({e.name, "not in the checkpoint"});
      continue;
    }
    used.insert(t->name);
    if (t->dtype != e.spec.dtype()) {
      out.push_back({e.name, strCat("saved as ", dtypeName(t->dtype), ", this program has ", dtypeName(e.spec.dtype()))});
    } else if (t->shape != e.spec.globalShape()) {
      out.push_back({e.name, strCat("saved with shape ", at::IntArrayRef(t->shape), ", this program has ",
                                    at::IntArrayRef(e.spec.globalShape()))});
    }
  }
  if (strict) {
    for (const auto& t : md.tensors) {
      if (!used.count(t.name)) out.push_back({t.name, "in the checkpoint, not in this program"});
    }
  }
  return out;
}

std::string describeMismatches(const std::vector<PlanMismatch>& mismatches, size_t limit) {
  std::string out;
  for (size_t i = 0; i < mismatches.size() && i < limit; ++i) {
    out += strCat(i == 0 ? "" : "; ", "'", mismatches[i].tensor, "' ", mismatches[i].problem);
  }
  if (mismatches.size() > limit) out += strCat("; and ", mismatches.size() - limit, " more");
  return out;
}

namespace {

LoadPlanError planError(const std::string& dir, std::vector<PlanMismatch> mismatches) {
  const std::string message =
      strCat("checkpoint ", dir, " holds another layout of this state: ", describeMismatches(mismatches));
  return LoadPlanError(dir, std::move(mismatches), message);
}

// One rank's attempt at loading a checkpoint, agreed with the others.
struct AgreedLoad {
  int failedRank = -1;             // the lowest rank whose load failed; -1 when none did
  std::exception_ptr failure;      // this rank's, when it failed
  std::string error;               // its message
};

// Runs `load` (of checkpoint `dir`) on this rank and agrees with the others on how it went.
// A load refused by its plan (LoadPlanError: the checkpoint is sound, the state has another
// layout) makes every rank throw LoadPlanError, the others naming the lowest rank it
// happened on, so that no rank falls back from it; any other failure is returned. The plan
// runs inside the load, on the metadata it has read anyway, before any tensor byte.
AgreedLoad loadOnEveryRank(distributed::Communicator* comm, const std::string& dir, const std::function<void()>& load) {
  AgreedLoad agreed;
  std::optional<LoadPlanError> plan;
  try {
    load();
  } catch (const LoadPlanError& e) {
    plan = e;
    agreed.failure = std::current_exception();
    agreed.error = e.what();
  } catch (const std::exception& e) {
    // Any failure (also a c10::Error from a tensor op) must reach the agreement below,
    // or the other ranks would wait for this one in the all-reduce.
    agreed.failure = std::current_exception();
    agreed.error = e.what();
    if (agreed.error.empty()) agreed.error = "unknown error";
  }
  agreed.failedRank = distributed::lowestFailingRank(comm, agreed.failure != nullptr);
  if (agreed.failedRank < 0) return agreed;
  const int planRank = distributed::lowestFailingRank(comm, plan.has_value());  // every rank: all know of a failure
  if (plan) throw *plan;
  if (planRank >= 0) {
    throw LoadPlanError(dir, {}, strCat("checkpoint ", dir, " holds another layout of the state rank ", planRank,
                                        " loads (see its log)"));
  }
  return agreed;
}

}  // namespace

LoadResult loadCheckpoint(const std::string& dir, const std::vector<StateEntry>& entries, const LoadOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  CheckpointReader reader(dir);
  const auto& md = reader.metadata();
  for (const auto& e : entries) checkEntry(e, "loadCheckpoint");
  std::vector<PlanMismatch> mismatches = planLoad(md, entries, options.strict);
  if (!mismatches.empty()) throw planError(dir, std::move(mismatches));
  std::vector<std::string> missingOptional;
  for (const auto& e : entries) {
    const bool former = md.find(e.name) == nullptr && !e.formerName.empty() && md.find(e.formerName) != nullptr;
    if (e.optional && md.find(e.name) == nullptr && !former) {
      missingOptional.push_back(e.name);
      continue;
    }
    const TensorInfo& t = reader.tensor(former ? e.formerName : e.name);  // planned: name, dtype, shape fit
    auto [rb, re] = e.spec.localRowRange();
    const bool replicated = e.spec.placement() == dtensor::Placement::kReplicate;
    const int64_t bufferRows = replicated ? t.rows() : e.spec.chunkRows();
    const int64_t rowElems = t.rowElements();
    // Read straight into the destination when it is plain CPU memory.
    const bool direct = e.local.device().is_cpu() && e.local.is_contiguous();
    at::Tensor buf = direct ? e.local.view({bufferRows, rowElems})
                            : at::empty({bufferRows, rowElems}, at::TensorOptions().dtype(t.dtype));
    if (re > rb) reader.readRows(t, rb, re, buf.data_ptr(), options.verify);
    if (bufferRows > re - rb) buf.narrow(0, re - rb, bufferRows - (re - rb)).zero_();
    if (!direct) e.local.copy_(buf.view(e.local.sizes()));
  }
  LoadResult r;
  r.dir = dir;
  r.step = md.step;
  r.savedWorldSize = md.worldSize;
  r.strategy = md.strategy;
  r.trainerState = reader.trainerState(options.verify);
  r.rankStates = md.rankStates;
  r.bytesRead = reader.bytesRead();
  r.missingOptional = std::move(missingOptional);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

LoadResult load(const std::string& dir, const StateMap& states, distributed::Communicator* comm,
                const LoadOptions& options) {
  LoadResult result;
  const AgreedLoad agreed = loadOnEveryRank(comm, dir, [&] {
    result = loadCheckpoint(dir, collectEntries(states), options);
    if (options.check) options.check(result);
  });
  if (agreed.failure) std::rethrow_exception(agreed.failure);
  if (agreed.failedRank >= 0) {
    throw Error(strCat("loading checkpoint ", dir, " failed on rank ", agreed.failedRank, " (its log has the reason)"));
  }
  afterLoad(states);  // collective: outside the agreement above
  return result;
}

std::optional<LoadResult> resumeLatest(const std::string& checkpointsDir, const StateMap& states,
                                       distributed::Communicator* comm, const LoadOptions& options) {
  std::optional<LoadResult> result = resumeAuto(checkpointsDir, collectEntries(states), comm, options);
  if (result) afterLoad(states);
  return result;
}

std::vector<CheckpointRef> listCheckpoints(const std::string& checkpointsDir) {
  std::vector<CheckpointRef> out;
  std::error_code ec;
  if (!fs::is_directory(checkpointsDir, ec)) return out;
  for (const auto& entry : fs::directory_iterator(checkpointsDir, ec)) {
    const std::string name = entry.path().filename().string();
    const std::optional<int64_t> step = parseStepDirName(name);
    if (!step) {
      // step_N.tmp, step_N.deleting are the protocol's own; a hand-named "step_20" is not a
      // checkpoint directory and is said so, not half-used.
      const bool stepLike = name.rfind("step_", 0) == 0 && name.find('.') == std::string::npos;
      if (stepLike) TLOG_WARN0("checkpoints: ignoring " << entry.path().string() << ": not named step_<8+ digits>");
      continue;
    }
    // A checkpoint never reads outside its step directory, so a linked one is not listed.
    if (entry.is_symlink(ec)) {
      TLOG_WARN0("checkpoints: ignoring " << entry.path().string() << ": a symbolic link, not a directory");
      continue;
    }
    if (!entry.is_directory(ec) || !pathExists((entry.path() / kMetadataFile).string())) continue;
    out.push_back({*step, entry.path().string()});
  }
  std::sort(out.begin(), out.end(), [](const CheckpointRef& a, const CheckpointRef& b) { return a.step < b.step; });
  return out;
}

std::string checkpointOrNewestIn(const std::string& dir) {
  if (pathExists((fs::path(dir) / kMetadataFile).string())) return dir;
  const auto all = listCheckpoints(dir);
  return all.empty() ? std::string() : all.back().dir;
}

namespace {

// A checkpoint step directory or snapshot: named step_<digits> (step_N.tmp, .replaced.tmp,
// .deleted.tmp included), or holding metadata.json.
bool isStepDirectory(const fs::path& dir) {
  const std::string name = dir.filename().string();
  if (name.rfind("step_", 0) == 0) {
    const std::string digits = name.substr(5, name.find('.') == std::string::npos ? std::string::npos : name.find('.') - 5);
    if (!digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos) return true;
  }
  std::error_code ec;
  return fs::is_regular_file(dir / kMetadataFile, ec);
}

// A directory of checkpoints: holding `latest`, or a checkpoint as resume and `list`
// find them (listCheckpoints: step_<digits> directories with metadata.json, no links).
bool isCheckpointsDirectory(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / "latest", ec) || !listCheckpoints(dir.string()).empty();
}

}  // namespace

void checkOutputOutsideState(const std::string& out, const std::string& option,
                             const std::vector<std::string>& inputs) {
  if (out.empty()) return;
  std::error_code ec;
  for (const std::string& input : inputs) {
    if (input.empty()) continue;
    // A sharded export's index stands for its shard files too.
    std::vector<std::string> files{input};
    try {
      for (const std::string& file : safetensorsFiles(input)) {
        if (file != input) files.push_back(file);
      }
    } catch (const std::exception&) {
      // An unreadable index: reading it as an input will say why.
    }
    for (const std::string& file : files) {
      if (fs::equivalent(out, file, ec)) {
        throw UsageError(strCat(option, " ", out, " is an input of this command (", file, "): it would be overwritten"));
      }
    }
  }
  // The directory the output goes into (or is), as it resolves: a link into a checkpoint
  // counts as the checkpoint.
  const fs::path target = fs::weakly_canonical(fs::absolute(out), ec);
  if (ec) return;  // unresolvable: the write itself will say why
  const bool outIsDirectory = fs::is_directory(target, ec);
  for (fs::path dir = outIsDirectory ? target : target.parent_path(); !dir.empty(); dir = dir.parent_path()) {
    if (fs::is_directory(dir, ec) && isStepDirectory(dir)) {
      throw UsageError(strCat(option, " ", out, " is inside the checkpoint ", dir.string(),
                              ": writing there would overwrite or pollute it; write elsewhere"));
    }
    if (dir == dir.parent_path()) break;
  }
  const fs::path parent = outIsDirectory ? target : target.parent_path();
  if (fs::is_directory(parent, ec) && isCheckpointsDirectory(parent)) {
    throw UsageError(strCat(option, " ", out, " is in the checkpoints directory ", parent.string(),
                            ", next to its step directories: write elsewhere"));
  }
}

std::string readLatest(const std::string& checkpointsDir) {
  const std::string path = (fs::path(checkpointsDir) / "latest").string();
  if (!pathExists(path)) return "";
  // Only a hint (resume picks the newest complete checkpoint anyway): a damaged one is
  // reported and ignored, never fatal.
  try {
    std::string text = readFileBounded(path, 4096);
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    if (!parseStepDirName(text)) throw CheckpointError(strCat("it does not name a step directory"));
    return text;
  } catch (const Error& e) {
    TLOG_WARN0("checkpoints: ignoring " << path << ": " << e.what());
    return "";
  }
}

std::optional<LoadResult> resumeAuto(const std::string& checkpointsDir, const std::vector<StateEntry>& entries,
                                     distributed::Communicator* comm, const LoadOptions& options) {
  // Rank 0's listing decides the candidates, so every rank tries the same ones in the
  // same order even if directory listings differ momentarily on a shared filesystem.
  std::vector<CheckpointRef> local = listCheckpoints(checkpointsDir);
  std::vector<int64_t> steps;
  for (auto it = local.rbegin(); it != local.rend(); ++it) steps.push_back(it->step);
  if (comm != nullptr && comm->worldSize() > 1) {
    at::Tensor count = at::tensor({static_cast<int64_t>(steps.size())}, at::kLong);
    comm->broadcast(count, 0);
    at::Tensor list = at::zeros({std::max<int64_t>(1, count.item<int64_t>())}, at::kLong);
    if (comm->rank() == 0 && !steps.empty()) std::memcpy(list.data_ptr<int64_t>(), steps.data(), steps.size() * 8);
    comm->broadcast(list, 0);
    steps.assign(list.data_ptr<int64_t>(), list.data_ptr<int64_t>() + count.item<int64_t>());
  }
  if (steps.empty()) {
    TLOG_INFO0("resume auto: no complete checkpoint in " << checkpointsDir << ", starting fresh");
    return std::nullopt;
  }
  const std::string latest = readLatest(checkpointsDir);
  std::string failures;
  for (size_t i = 0; i < steps.size(); ++i) {
    const std::string dir = (fs::path(checkpointsDir) / stepDirName(steps[i])).string();
    std::optional<LoadResult> result;
    // A sound checkpoint of another layout is this run's mismatch, not damage: an older
    // checkpoint of the same run would have the same layout, so loadOnEveryRank throws
    // LoadPlanError instead of returning a failure to fall back from.
    const AgreedLoad agreed = loadOnEveryRank(comm, dir, [&] {
      result = loadCheckpoint(dir, entries, options);
      if (options.check) options.check(*result);
    });
    const int failedRank = agreed.failedRank;
    const std::string& error = agreed.error;
    if (failedRank < 0) {
      if (i > 0 || (!latest.empty() && fs::path(latest).filename() != stepDirName(steps[i]))) {
        TLOG_WARN0("resume auto: resuming from " << dir << " (latest names '" << latest << "')");
      }
      TLOG_INFO0("resume auto: loaded " << dir << " (step " << result->step << ", saved on " << result->savedWorldSize
                                        << " ranks) in " << result->seconds << " s");
      return result;
    }
    if (!error.empty()) {
      TLOG_WARN("resume auto: checkpoint " << dir << " failed on this rank: " << error);
    }
    const std::string next =
        i + 1 < steps.size() ? (fs::path(checkpointsDir) / stepDirName(steps[i + 1])).string() : "nothing (no older one)";
    TLOG_WARN0("resume auto: checkpoint " << dir << " failed verification on rank " << failedRank
                                          << "; falling back to " << next);
    failures += strCat("\n  ", dir, ": failed on rank ", failedRank, error.empty() ? "" : ": ", error);
  }
  throw CheckpointError(strCat("resume auto: no checkpoint in ", checkpointsDir, " could be loaded:", failures));
}

CheckpointSummary summarizeCheckpoint(const std::string& dir) {
  CheckpointReader reader(dir);
  const auto& md = reader.metadata();
  CheckpointSummary s;
  s.dir = dir;
  s.metadata = md;
  s.tensorBytes = md.tensorBytes();
  for (const auto& f : md.files) s.fileBytes += f.bytes;
  s.fileBytes += md.trainerState.bytes;
  return s;
}

}  // namespace tessera::checkpoint
