// Collective sharded save, commit protocol, async writer and retention (see
// checkpointer.h for the protocol).
#include "checkpoint/checkpointer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <set>
#include <thread>

#include "checkpoint/file_io.h"
#include "checkpoint/format.h"
#include "checkpoint/metadata.h"
#include "checkpoint/rank_files.h"
#include "checkpoint/reader.h"
#include "common/clock.h"
#include "common/errors.h"
#include "common/trace.h"
#include "common/logging.h"
#include "distributed/communicator.h"
#include "common/filesystem.h"

namespace tessera::checkpoint {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

const char* savePointName(SavePoint point) {
  switch (point) {
    case SavePoint::kStaging: return "staging";
    case SavePoint::kBeforeData: return "before-data";
    case SavePoint::kAfterData: return "after-data";
    case SavePoint::kAfterRankIndex: return "after-rank-index";
    case SavePoint::kBeforeMetadata: return "before-metadata";
    case SavePoint::kBeforeRename: return "before-rename";
    case SavePoint::kBeforeLatest: return "before-latest";
    case SavePoint::kBeforeRetention: return "before-retention";
  }
  return "?";
}

namespace {


std::string mib(int64_t bytes) { return strCat(static_cast<double>(bytes) / (1 << 20), " MiB"); }

}  // namespace

int64_t estimateMetadataBytes(int64_t blockBytes, int64_t stateBytes, int64_t chunks) {
  TESSERA_CHECK(blockBytes > 0 && stateBytes >= 0 && chunks >= 0, "estimateMetadataBytes: block ", blockBytes,
                ", state ", stateBytes, ", chunks ", chunks);
  // dump(1): a checksum is an indented quoted line (~26 bytes); a chunk's fields and
  // brackets ~190 bytes; both rounded up, plus the tensor headers and the file list.
  constexpr int64_t kPerChecksum = 28, kPerChunk = 256, kFixed = 64 << 10;
  return kPerChecksum * (stateBytes / blockBytes + chunks) + kPerChunk * chunks + kFixed;
}

int64_t checksumBlockBytes(int64_t requested, int64_t maxMetadataBytes, int64_t stateBytes, int64_t chunks) {
  int64_t block = requested;
  while (block * 2 <= kMaxBlockBytes && estimateMetadataBytes(block, stateBytes, chunks) > maxMetadataBytes &&
         estimateMetadataBytes(block * 2, stateBytes, chunks) < estimateMetadataBytes(block, stateBytes, chunks)) {
    block *= 2;
  }
  return block;
}

// What one rank writes for one step: everything the writer needs, owned (staged copies
// in async mode), so the caller may change its tensors as soon as save() returns.
namespace {

// Tells rank 0 that `rank` failed this save: the marker's existence is the signal, its text
// the reason. On a full disk the text may not fit (ENOSPC while writing it): the partly
// written marker is published anyway, or an empty one made (a name needs no data blocks),
// so rank 0 stops waiting at once instead of at the commit timeout.
void publishRankError(const std::string& tmpDir, int rank, const std::string& why) {
  const std::string path = (fs::path(tmpDir) / rankErrorFile(rank)).string();
  try {
    writeFileAtomic(path, why, /*syncParent=*/false);
    return;
  } catch (...) {
  }
  std::error_code ec;
  fs::rename(path + ".tmp", path, ec);
  if (!ec) return;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd >= 0) ::close(fd);
}

}  // namespace

struct Checkpointer::Job {
  int rank = 0, world = 1;
  int64_t step = 0;
  std::string root, tmpDir, finalDir;
  std::string strategy, trainerState, rankState;
  std::vector<ComponentRecord> components;
  std::vector<RankRows> sources;
  CheckpointOptions options;
  // Set by the writer thread when its write failed (error holds why): what
  // Checkpointer::writerFailed() reads while the thread may still run.
  std::atomic<bool> failed{false};
  double seconds = 0;
  std::string error;  // set by run()'s caller when it threw
  // Async: an all-reduce every rank issues once its staging copy is done; the writer
  // waits for it (with the communicator's timeout) before it starts, so no writer
  // competes with a copy still running.
  at::Tensor copiesDoneValue;
  std::shared_ptr<distributed::CommHandle> copiesDone;

  void hook(SavePoint p) const {
    if (options.faultHook) options.faultHook(p, rank);
  }

  void run() {
    const auto start = Clock::now();
    try {
      writeRankPart();
    } catch (const std::exception& e) {
      // Tell rank 0 at once rather than letting it wait for the commit timeout.
      publishRankError(tmpDir, rank, e.what());
      throw;
    }
    if (rank == 0) commit();
    seconds = secondsSince(start);
  }

  void writeRankPart() {
    hook(SavePoint::kBeforeData);
    const RankIndex index = writeRankData(tmpDir, rank, world, step, options.blockBytes, rankState, sources);
    hook(SavePoint::kAfterData);
    // No fsync of step_N.tmp after the rename: rank 0 may commit (rename the directory
    // away) as soon as the file appears, and an fsync of the old path would then fail
    // this rank. The index is only a hand-off; rank 0 fsyncs the directory with the
    // metadata.
    writeFileAtomic((fs::path(tmpDir) / rankIndexFile(rank)).string(), toJson(index), /*syncParent=*/false);
    hook(SavePoint::kAfterRankIndex);
  }

  // Rank 0: waits for every rank's chunk table (or error) in the shared directory.
  std::vector<RankIndex> collectIndexes() {
    std::vector<RankIndex> out(static_cast<size_t>(world));
    std::vector<bool> have(static_cast<size_t>(world), false);
    const auto deadline = Clock::now() + options.commitTimeout;
    auto pause = std::chrono::milliseconds(1);
    int remaining = world;
    while (remaining > 0) {
      for (int r = 0; r < world; ++r) {
        if (have[static_cast<size_t>(r)]) continue;
        const std::string err = (fs::path(tmpDir) / rankErrorFile(r)).string();
        if (pathExists(err)) {
          std::string why;
          try {
            why = readFileBounded(err, 1 << 16);
          } catch (const std::exception& e) {
            why = e.what();
          }
          if (why.empty()) why = strCat("(its reason could not be written to ", err, ": is the disk full?)");
          throw Error(strCat("checkpoint step ", step, ": rank ", r, " failed to write its part: ", why));
        }
        const std::string path = (fs::path(tmpDir) / rankIndexFile(r)).string();
        if (!pathExists(path)) continue;
        RankIndex idx = parseRankIndex(readFileBounded(path, kMaxJsonBytes), path);
        TESSERA_CHECK(idx.rank == r && idx.worldSize == world && idx.step == step && idx.blockBytes == options.blockBytes,
                      "checkpoint step ", step, ": ", path, " is for rank ", idx.rank, " of ", idx.worldSize, ", step ",
                      idx.step, ", checksum blocks of ", idx.blockBytes, " bytes (expected rank ", r, " of ", world,
                      ", step ", step, ", blocks of ", options.blockBytes,
                      " bytes: a rank that saves other entries computes another block size)");
        out[static_cast<size_t>(r)] = std::move(idx);
        have[static_cast<size_t>(r)] = true;
        --remaining;
      }
      if (remaining == 0) break;
      if (Clock::now() > deadline) {
        std::string missing;
        for (int r = 0; r < world; ++r) {
          if (!have[static_cast<size_t>(r)]) missing += strCat(missing.empty() ? "" : ", ", r);
        }
        throw TimeoutError(strCat("checkpoint step ", step, ": ranks [", missing, "] did not publish their chunk tables in ",
                                  tmpDir, " within ", options.commitTimeout.count(), " ms"));
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(10));
    }
    return out;
  }

  void commit() {
    std::vector<RankIndex> indexes = collectIndexes();
    CheckpointMetadata md = mergeRankIndexes(indexes, {step, world, options.blockBytes, strategy, components});
    // trainer_state.json first, then metadata.json: metadata records its checksum.
    writeTrainerState(tmpDir, trainerState, md);
    const std::string text = metadataText(md);
    for (int r = 0; r < world; ++r) fs::remove(fs::path(tmpDir) / rankIndexFile(r));
    hook(SavePoint::kBeforeMetadata);
    writeMetadataFile(tmpDir, text);
    hook(SavePoint::kBeforeRename);
    std::string replaced;
    if (pathExists(finalDir)) {
      // Same step saved again: move the old one aside (it stops counting as complete),
      // put the new one in place, delete the old one after `latest` moved.
      replaced = finalDir + ".replaced.tmp";
      removeTree(replaced);
      renamePath(finalDir, replaced);
    }
    renamePath(tmpDir, finalDir);
    syncDirectory(root);
    hook(SavePoint::kBeforeLatest);
    try {
      writeFileAtomic((fs::path(root) / "latest").string(), stepDirName(step) + "\n");
    } catch (const Error& e) {
      // The step is committed; `latest` is only a hint (resume scans for the newest).
      TLOG_WARN("checkpoint step " << step << " is saved, but `latest` was not updated: " << e.what());
    }
    hook(SavePoint::kBeforeRetention);
    if (!replaced.empty()) removeTree(replaced);
    applyRetention();
  }

  void applyRetention() const {
    if (options.keepLast <= 0) return;
    auto all = listCheckpoints(root);
    if (static_cast<int>(all.size()) <= options.keepLast) return;
    for (size_t i = 0; i + static_cast<size_t>(options.keepLast) < all.size(); ++i) {
      if (all[i].step == step) continue;  // never the one just written
      // Rename first: a crash mid-delete leaves a *.tmp (ignored, cleaned), never a
      // half-deleted directory that still has its metadata.
      const std::string doomed = all[i].dir + ".deleted.tmp";
      renamePath(all[i].dir, doomed);
      removeTree(doomed);
      TLOG_DEBUG("checkpoint retention (keep_last " << options.keepLast << "): removed " << all[i].dir);
    }
    syncDirectory(root);
  }
};

Checkpointer::Checkpointer(std::string checkpointsDir, std::shared_ptr<distributed::Communicator> comm,
                           CheckpointOptions options)
    : root_(std::move(checkpointsDir)), comm_(std::move(comm)), options_(std::move(options)) {
  TESSERA_CHECK_AS(ConfigError,
                   options_.blockBytes >= 8 && options_.blockBytes % 8 == 0 && options_.blockBytes <= kMaxBlockBytes,
                   "Checkpointer: blockBytes ", options_.blockBytes, " must be a multiple of 8 in [8, ", kMaxBlockBytes,
                   "]");
  TESSERA_CHECK_AS(ConfigError, options_.keepLast >= 0, "Checkpointer: keep_last ", options_.keepLast, " < 0");
  TESSERA_CHECK_AS(ConfigError, options_.maxMetadataBytes >= 1, "Checkpointer: maxMetadataBytes ",
                   options_.maxMetadataBytes, " < 1");
  if (comm_) {
    rank_ = comm_->rank();
    world_ = comm_->worldSize();
  }
}

Checkpointer::~Checkpointer() {
  const std::string error = waitLocal();
  if (!error.empty()) TLOG_ERROR("checkpoint: the last async save failed and nobody called finish(): " << error);
}

bool Checkpointer::writerFailed() const { return job_ && job_->failed.load(); }

std::string Checkpointer::waitLocal() {
  if (writer_.joinable()) writer_.join();
  if (!job_) return "";
  std::string error = job_->error;
  if (error.empty()) {
    TLOG_INFO0("checkpoint step " << job_->step << " committed to " << job_->finalDir << " (this rank's write took "
                                  << job_->seconds << " s)");
  } else {
    TLOG_ERROR("checkpoint step " << job_->step << " failed on this rank: " << error);
  }
  job_.reset();
  return error;
}

void Checkpointer::prepareTmpDir(const std::string& tmpDir) const {
  std::error_code ec;
  fs::create_directories(root_, ec);
  TESSERA_CHECK(!ec, "cannot create checkpoint directory ", root_, ": ", ec.message());
  for (const auto& entry : fs::directory_iterator(root_)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0 && name.rfind("step_", 0) == 0) {
      TLOG_INFO("checkpoint: removing stale " << entry.path().string());
      removeTree(entry.path().string());
    }
  }
  fs::create_directory(tmpDir, ec);
  TESSERA_CHECK(!ec, "cannot create ", tmpDir, ": ", ec.message());
}

int64_t Checkpointer::stage(const SaveRequest& request, Job& job) {
  job.hook(SavePoint::kStaging);
  int64_t bytes = 0;
  // The previous save's writer is done (save() step 1): the staging buffers are free.
  job.sources = rankRowsOf(request.entries, rank_, options_.async, staging_, bytes);
  return bytes;
}

// The request's checks, before anything happens: names, layouts and dtypes of the
// entries, the JSON objects. Returns the block size every rank computes alike from the
// global shapes (the commit checks it, naming the block sizes).
int64_t Checkpointer::checkRequest(const SaveRequest& request) const {
  TESSERA_CHECK(request.step >= 0, "Checkpointer::save: negative step ", request.step);
  std::set<std::string> names;
  for (const auto& e : request.entries) {
    checkEntry(e, "Checkpointer::save");
    TESSERA_CHECK(names.insert(e.name).second, "Checkpointer::save: entry '", e.name, "' appears twice");
    // A replicated tensor is whole on every rank (rank 0 writes it): its spec's group does
    // not matter. A sharded one must be laid out over this checkpointer's group.
    const bool replicated = e.spec.placement() == dtensor::Placement::kReplicate;
    TESSERA_CHECK(replicated || (e.spec.worldSize() == world_ && e.spec.rank() == rank_), "Checkpointer::save: entry '",
                  e.name, "' has spec ", e.spec.str(), " but this is rank ", rank_, " of ", world_);
  }
  const auto [stateBytes, chunks] = stateSizeOf(request.entries);
  const int64_t blockBytes = checksumBlockBytes(options_.blockBytes, options_.maxMetadataBytes, stateBytes, chunks);
  const int64_t metadataBytes = estimateMetadataBytes(blockBytes, stateBytes, chunks);
  TESSERA_CHECK(metadataBytes <= kMaxJsonBytes, "checkpoint step ", request.step, ": ", mib(stateBytes), " of state in ",
                chunks, " chunks would need a metadata.json of up to ", mib(metadataBytes), ", over the ",
                mib(kMaxJsonBytes), " readers accept, even with checksum blocks of ", mib(blockBytes),
                " (save fewer, larger tensors)");
  if (blockBytes != options_.blockBytes) {
    TLOG_INFO0("checkpoint step " << request.step << ": " << mib(stateBytes) << " of state: checksum blocks of "
                                  << mib(blockBytes) << " instead of " << mib(options_.blockBytes)
                                  << ", so that metadata.json stays under " << mib(options_.maxMetadataBytes));
  }
  return blockBytes;
}

std::shared_ptr<Checkpointer::Job> Checkpointer::makeJob(const SaveRequest& request, int64_t blockBytes) const {
  auto job = std::make_shared<Job>();
  job->rank = rank_;
  job->world = world_;
  job->step = request.step;
  job->root = root_;
  job->tmpDir = (fs::path(root_) / (stepDirName(request.step) + ".tmp")).string();
  job->finalDir = (fs::path(root_) / stepDirName(request.step)).string();
  job->strategy = request.strategy;
  job->trainerState = parseTrainerState(request.trainerState, "SaveRequest.trainerState");
  job->rankState = parseTrainerState(request.rankState, "SaveRequest.rankState");
  job->components = request.components;
  job->options = options_;
  job->options.blockBytes = blockBytes;
  return job;
}

// Steps 2-4 of the protocol (checkpointer.h): rank 0 prepares step_N.tmp, one agreement
// on whether any rank's previous save failed or the directory could not be made
// (overlapped with the staging copy), the staging copy. Throws on every rank when the
// agreement says so; a staging failure is this save's outcome (job.error), told to rank
// 0's commit at once. Returns the bytes this rank writes.
int64_t Checkpointer::agreeAndStage(const SaveRequest& request, Job& job, int64_t previous,
                                    const std::string& previousError, double& stagingSeconds) {
  // Rank 0 prepares step_N.tmp when its own previous save committed: then every rank had
  // published its part of it, so no writer is still inside a *.tmp and every one there is
  // debris of a crash. (When it failed, all ranks throw below.)
  std::string prepError;
  if (rank_ == 0 && previousError.empty()) {
    try {
      prepareTmpDir(job.tmpDir);
    } catch (const std::exception& e) {
      prepError = e.what();
    }
  }
  at::Tensor failedRanks = at::full({2}, int64_t{world_}, at::kLong);  // min over ranks; world_ = none
  int64_t* lowest = failedRanks.data_ptr<int64_t>();
  if (!previousError.empty()) lowest[0] = rank_;
  if (!prepError.empty()) lowest[1] = rank_;
  std::shared_ptr<distributed::CommHandle> agreement;
  if (comm_ && world_ > 1) agreement = comm_->allReduceAsync(failedRanks, distributed::ReduceOp::kMin);

  // The real rows of each entry, contiguous on the CPU: async copies them into the reused
  // staging buffers (the caller keeps training on the originals); sync uses CPU tensors
  // as they are.
  const auto stagingStart = Clock::now();
  int64_t bytes = 0;
  std::string stagingError;
  try {
    const trace::Span span("checkpoint", strCat("stage checkpoint step ", request.step));
    bytes = stage(request, job);
  } catch (const std::exception& e) {
    stagingError = e.what();
  }
  stagingSeconds = options_.async ? secondsSince(stagingStart) : 0.0;
  if (agreement) agreement->wait();
  auto failedRank = [&](int64_t r) { return r == world_ ? -1 : static_cast<int>(r); };
  distributed::throwIfFailed(failedRank(lowest[0]), rank_, previousError,
                             strCat("checkpoint: the previous save (step ", previous, ")"));
  distributed::throwIfFailed(failedRank(lowest[1]), rank_, prepError,
                             strCat("checkpoint step ", request.step, ": preparing ", job.tmpDir));
  if (!stagingError.empty()) {
    job.error = strCat("staging failed: ", stagingError);
    publishRankError(job.tmpDir, rank_, job.error);
  }
  return bytes;
}

// Step 5, async: the writer thread starts once every rank has staged (a writer hashing
// while another rank still copies slows that copy: docs/checkpoint.md). The all-reduce is
// issued here, on the training thread, by every rank (the collective order stays the call
// order); only the wait is the writer's.
void Checkpointer::startWriter(const std::shared_ptr<Job>& job) {
  if (comm_ && world_ > 1) {
    job->copiesDoneValue = at::zeros({1}, at::kLong);
    job->copiesDone = comm_->allReduceAsync(job->copiesDoneValue, distributed::ReduceOp::kMin);
  }
  if (!job->error.empty()) {
    // Like a writer failure: every rank throws at the next save or finish().
    TLOG_ERROR("checkpoint step " << job->step << ": " << job->error);
    if (job->copiesDone) job->copiesDone->wait();  // no writer here to wait for it
    return;
  }
  writer_ = std::thread([job] {
    trace::nameThisThread("checkpoint writer");
    try {
      if (job->copiesDone) job->copiesDone->wait();
      const trace::Span span("checkpoint", strCat("write checkpoint step ", job->step));
      job->run();
    } catch (const std::exception& e) {
      job->error = e.what();
    } catch (...) {
      job->error = "unknown exception in the checkpoint writer";
    }
    job->failed = !job->error.empty();
  });
}

// Step 5, sync: write and commit now; every rank learns whether every rank succeeded.
void Checkpointer::writeNow(Job& job) {
  if (job.error.empty()) {
    try {
      job.run();
    } catch (const std::exception& e) {
      job.error = e.what();
    }
  }
  inFlightStep_ = -1;
  distributed::throwIfAnyRankFailed(comm_.get(), waitLocal(), strCat("checkpoint step ", job.step));
}

SaveStats Checkpointer::save(const SaveRequest& request) {
  const auto start = Clock::now();
  const int64_t blockBytes = checkRequest(request);
  auto job = makeJob(request, blockBytes);
  // At most one save in flight: finish this rank's previous one (its staging buffers are
  // free again after this).
  const int64_t previous = inFlightStep_;
  inFlightStep_ = -1;
  const std::string previousError = waitLocal();
  SaveStats stats;
  stats.waitSeconds = secondsSince(start);
  stats.bytes = agreeAndStage(request, *job, previous, previousError, stats.stagingSeconds);
  stats.step = request.step;
  stats.dir = job->finalDir;
  stats.stagingAllocatedBytes = staging_.takeAllocatedBytes();
  stats.blockBytes = blockBytes;
  stats.async = options_.async;
  job_ = job;
  inFlightStep_ = request.step;
  if (options_.async) {
    startWriter(job);
    stats.stallSeconds = secondsSince(start);
    if (job->error.empty()) {
      TLOG_INFO0("checkpoint step " << request.step << ": async save started; training stall " << stats.stallSeconds
                                    << " s (staging " << mib(stats.bytes) << " took " << stats.stagingSeconds << " s"
                                    << (stats.stagingAllocatedBytes > 0 ? ", allocating the staging buffers" : "")
                                    << ", waiting " << stats.waitSeconds << " s)");
    }
    return stats;
  }
  writeNow(*job);
  stats.stallSeconds = secondsSince(start);
  TLOG_INFO0("checkpoint step " << request.step << " saved in " << stats.stallSeconds << " s (" << mib(stats.bytes)
                                << " on rank 0)");
  return stats;
}

SaveRequest saveRequestOf(int64_t step, const StateMap& states, const SaveOptions& options) {
  SaveRequest request;
  request.step = step;
  request.entries = collectEntries(states);
  request.components = collectComponents(states);
  // A part or export name of a component without entries under it (a model with no
  // parameters) would name nothing: left out, as readers refuse such records.
  auto holds = [&](const std::string& prefix) {
    for (const StateEntry& e : request.entries) {
      if (e.name.compare(0, prefix.size(), prefix) == 0) return true;
    }
    return false;
  };
  for (ComponentRecord& c : request.components) {
    for (auto* names : {&c.parts, &c.exports}) {
      for (auto it = names->begin(); it != names->end();) it = holds(it->second) ? std::next(it) : names->erase(it);
    }
  }
  request.strategy = options.strategy.empty() ? describeStrategies(states) : options.strategy;
  request.trainerState = options.trainerState;
  request.rankState = options.rankState;
  return request;
}

SaveStats Checkpointer::save(int64_t step, const StateMap& states, const SaveOptions& options) {
  return save(saveRequestOf(step, states, options));
}

void Checkpointer::finish() {
  const int64_t previous = inFlightStep_;
  inFlightStep_ = -1;
  distributed::throwIfAnyRankFailed(comm_.get(), waitLocal(), strCat("checkpoint: the save of step ", previous));
}

}  // namespace tessera::checkpoint
