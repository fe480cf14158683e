// Collective sharded save, commit protocol, async writer and retention (see
// checkpointer.h for the protocol).
#include "checkpoint/checkpointer.h"

#include <algorithm>
#include <filesystem>
#include <set>
#include <thread>

#include "checkpoint/file_io.h"
#include "checkpoint/format.h"
#include "checkpoint/metadata.h"
#include "checkpoint/reader.h"
#include "common/errors.h"
#include "common/logging.h"
#include "distributed/communicator.h"
#include "common/filesystem.h"

namespace tessera::checkpoint {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

const char* savePointName(SavePoint point) {
  switch (point) {
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

double secondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string mib(int64_t bytes) { return strCat(static_cast<double>(bytes) / (1 << 20), " MiB"); }

}  // namespace

// What one rank writes for one step: everything the writer needs, owned (staged copies
// in async mode), so the caller may change its tensors as soon as save() returns.
struct Checkpointer::Job {
  struct Source {
    TensorInfo head;   // name, dtype, shape, placement (no chunks)
    at::Tensor rows;   // contiguous CPU real rows of this rank, undefined when none
    int64_t rowBegin = 0, rowEnd = 0;
  };
  int rank = 0, world = 1;
  int64_t step = 0;
  std::string root, tmpDir, finalDir;
  std::string strategy, trainerState, rankState;
  std::map<std::string, std::string> aliases;
  std::vector<Source> sources;
  CheckpointOptions options;
  double seconds = 0;
  std::string error;  // set by run()'s caller when it threw

  void hook(SavePoint p) const {
    if (options.faultHook) options.faultHook(p, rank);
  }

  void run() {
    const auto start = Clock::now();
    try {
      writeRankPart();
    } catch (const std::exception& e) {
      // Tell rank 0 at once rather than letting it wait for the commit timeout.
      try {
        writeFileAtomic((fs::path(tmpDir) / rankErrorFile(rank)).string(), e.what());
      } catch (...) {
      }
      throw;
    }
    if (rank == 0) commit();
    seconds = secondsSince(start);
  }

  void writeRankPart() {
    hook(SavePoint::kBeforeData);
    RankIndex index;
    index.rank = rank;
    index.worldSize = world;
    index.step = step;
    index.blockBytes = options.blockBytes;
    index.file.name = rankDataFile(rank);
    index.rankState = rankState;
    File f = File::openWrite((fs::path(tmpDir) / index.file.name).string());
    int64_t offset = 0;
    for (const auto& s : sources) {
      TensorInfo t = s.head;
      if (s.rowEnd > s.rowBegin) {
        ChunkInfo c;
        c.rank = rank;
        c.file = index.file.name;
        c.offset = offset;
        c.length = (s.rowEnd - s.rowBegin) * t.rowBytes();
        c.rowBegin = s.rowBegin;
        c.rowEnd = s.rowEnd;
        const auto* data = static_cast<const uint8_t*>(c.length > 0 ? s.rows.data_ptr() : nullptr);
        for (int64_t b = 0; b < c.length; b += options.blockBytes) {
          c.checksums.push_back(checksum(data + b, static_cast<size_t>(std::min(options.blockBytes, c.length - b))));
        }
        if (c.length > 0) f.writeAll(data, static_cast<size_t>(c.length));
        offset += c.length;
        t.chunks.push_back(std::move(c));
      }
      index.tensors.push_back(std::move(t));
    }
    index.file.bytes = offset;
    f.sync();
    f.close();
    hook(SavePoint::kAfterData);
    writeFileAtomic((fs::path(tmpDir) / rankIndexFile(rank)).string(), toJson(index));
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
          throw Error(strCat("checkpoint step ", step, ": rank ", r, " failed to write its part: ", why));
        }
        const std::string path = (fs::path(tmpDir) / rankIndexFile(r)).string();
        if (!pathExists(path)) continue;
        RankIndex idx = parseRankIndex(readFileBounded(path, kMaxJsonBytes), path);
        TESSERA_CHECK(idx.rank == r && idx.worldSize == world && idx.step == step && idx.blockBytes == options.blockBytes,
                      "checkpoint step ", step, ": ", path, " is for rank ", idx.rank, " of ", idx.worldSize, ", step ",
                      idx.step, " (expected rank ", r, " of ", world, ", step ", step, ")");
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

  CheckpointMetadata merge(std::vector<RankIndex>& indexes) const {
    CheckpointMetadata md;
    md.step = step;
    md.worldSize = world;
    md.strategy = strategy;
    md.blockBytes = options.blockBytes;
    md.aliases = aliases;
    const auto& first = indexes[0].tensors;
    for (const auto& idx : indexes) {
      md.files.push_back(idx.file);
      md.rankStates.push_back(idx.rankState);
      TESSERA_CHECK(idx.tensors.size() == first.size(), "checkpoint step ", step, ": rank ", idx.rank, " saved ",
                    idx.tensors.size(), " tensors, rank 0 saved ", first.size(), " (every rank must save the same entries)");
    }
    for (size_t i = 0; i < first.size(); ++i) {
      TensorInfo t = first[i];
      t.chunks.clear();
      for (const auto& idx : indexes) {
        const TensorInfo& o = idx.tensors[i];
        TESSERA_CHECK(o.name == t.name && o.dtype == t.dtype && o.shape == t.shape && o.placement == t.placement,
                      "checkpoint step ", step, ": entry ", i, " is '", o.name, "' ", dtypeName(o.dtype), " ",
                      at::IntArrayRef(o.shape), " on rank ", idx.rank, " but '", t.name, "' ", dtypeName(t.dtype), " ",
                      at::IntArrayRef(t.shape), " on rank 0 (every rank must save the same entries, in the same order)");
        for (const auto& c : o.chunks) t.chunks.push_back(c);
      }
      md.tensors.push_back(std::move(t));
    }
    return md;
  }

  void commit() {
    std::vector<RankIndex> indexes = collectIndexes();
    CheckpointMetadata md = merge(indexes);
    // trainer_state.json first, then metadata.json: metadata records its checksum.
    const std::string tsPath = (fs::path(tmpDir) / kTrainerStateFile).string();
    {
      File f = File::openWrite(tsPath);
      f.writeAll(trainerState.data(), trainerState.size());
      f.sync();
      f.close();
    }
    md.trainerState = {kTrainerStateFile, static_cast<int64_t>(trainerState.size())};
    md.trainerStateChecksum = checksum(trainerState.data(), trainerState.size());
    const std::string text = toJson(md);
    // Whatever the loader will refuse must fail the save instead.
    parseMetadata(text, strCat("merged metadata of step ", step));
    for (int r = 0; r < world; ++r) fs::remove(fs::path(tmpDir) / rankIndexFile(r));
    hook(SavePoint::kBeforeMetadata);
    {
      File f = File::openWrite((fs::path(tmpDir) / kMetadataFile).string());
      f.writeAll(text.data(), text.size());
      f.sync();
      f.close();
    }
    syncDirectory(tmpDir);
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
    writeFileAtomic((fs::path(root) / "latest").string(), stepDirName(step) + "\n");
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
  TESSERA_CHECK_AS(ConfigError, options_.blockBytes >= 8 && options_.blockBytes % 8 == 0,
                   "Checkpointer: blockBytes ", options_.blockBytes, " must be a positive multiple of 8");
  TESSERA_CHECK_AS(ConfigError, options_.keepLast >= 0, "Checkpointer: keep_last ", options_.keepLast, " < 0");
  if (comm_) {
    rank_ = comm_->rank();
    world_ = comm_->worldSize();
  }
}

Checkpointer::~Checkpointer() {
  const std::string error = waitLocal();
  if (!error.empty()) TLOG_ERROR("checkpoint: the last async save failed and nobody called finish(): " << error);
}

double Checkpointer::lastWriteSeconds() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return lastWriteSeconds_;
}

std::string Checkpointer::waitLocal() {
  if (writer_.joinable()) writer_.join();
  if (!job_) return "";
  std::string error = job_->error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    lastWriteSeconds_ = job_->seconds;
  }
  if (error.empty()) {
    TLOG_INFO0("checkpoint step " << job_->step << " committed to " << job_->finalDir << " (this rank's write took "
                                  << job_->seconds << " s)");
  } else {
    TLOG_ERROR("checkpoint step " << job_->step << " failed on this rank: " << error);
  }
  job_.reset();
  return error;
}

SaveStats Checkpointer::save(const SaveRequest& request) {
  const auto start = Clock::now();
  TESSERA_CHECK(request.step >= 0, "Checkpointer::save: negative step ", request.step);
  const std::string trainerState = parseTrainerState(request.trainerState, "SaveRequest.trainerState");
  const std::string rankState = parseTrainerState(request.rankState, "SaveRequest.rankState");
  std::set<std::string> names;
  for (const auto& e : request.entries) {
    checkEntry(e, "Checkpointer::save");
    TESSERA_CHECK(names.insert(e.name).second, "Checkpointer::save: entry '", e.name, "' appears twice");
    TESSERA_CHECK(e.spec.worldSize() == world_ && e.spec.rank() == rank_, "Checkpointer::save: entry '", e.name,
                  "' has spec ", e.spec.str(), " but this is rank ", rank_, " of ", world_);
    dtypeName(e.spec.dtype());  // throws for dtypes the format cannot hold
  }

  // 1. At most one save in flight: finish the previous one, and fail everywhere if it
  //    failed anywhere.
  const int64_t previous = inFlightStep_;
  inFlightStep_ = -1;
  distributed::throwIfAnyRankFailed(comm_.get(), waitLocal(), strCat("checkpoint: the previous save (step ", previous, ")"));
  const double waitSeconds = secondsSince(start);

  // 2. Rank 0 prepares step_N.tmp; everyone agrees it exists before writing into it.
  auto job = std::make_shared<Job>();
  job->rank = rank_;
  job->world = world_;
  job->step = request.step;
  job->root = root_;
  job->tmpDir = (fs::path(root_) / (stepDirName(request.step) + ".tmp")).string();
  job->finalDir = (fs::path(root_) / stepDirName(request.step)).string();
  job->strategy = request.strategy;
  job->trainerState = trainerState;
  job->rankState = rankState;
  job->aliases = request.aliases;
  job->options = options_;
  std::string prepError;
  if (rank_ == 0) {
    try {
      std::error_code ec;
      fs::create_directories(root_, ec);
      TESSERA_CHECK(!ec, "cannot create checkpoint directory ", root_, ": ", ec.message());
      // No save is in flight anywhere (step 1), so every *.tmp is debris of a crash.
      for (const auto& entry : fs::directory_iterator(root_)) {
        const std::string name = entry.path().filename().string();
        if (name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0 && name.rfind("step_", 0) == 0) {
          TLOG_INFO("checkpoint: removing stale " << entry.path().string());
          removeTree(entry.path().string());
        }
      }
      fs::create_directory(job->tmpDir, ec);
      TESSERA_CHECK(!ec, "cannot create ", job->tmpDir, ": ", ec.message());
    } catch (const std::exception& e) {
      prepError = e.what();
    }
  }
  distributed::throwIfAnyRankFailed(comm_.get(), prepError, strCat("checkpoint step ", request.step, ": preparing ", job->tmpDir));

  // 3. Stage: the real rows of each entry, contiguous on the CPU. Async copies them
  //    (the caller keeps training on the originals); sync uses CPU tensors as they are.
  const auto stagingStart = Clock::now();
  int64_t bytes = 0;
  for (const auto& e : request.entries) {
    Job::Source s;
    s.head.name = e.name;
    s.head.dtype = e.spec.dtype();
    s.head.shape = e.spec.globalShape();
    s.head.placement = e.spec.placement();
    const bool replicated = e.spec.placement() == sharding::Placement::kReplicate;
    if (!replicated || rank_ == 0) {
      std::tie(s.rowBegin, s.rowEnd) = e.spec.localRowRange();
      if (s.rowEnd > s.rowBegin) {
        const int64_t bufferRows = replicated ? e.spec.globalRows() : e.spec.chunkRows();
        at::Tensor rows = e.local.reshape({bufferRows, e.spec.rowNumel()}).narrow(0, 0, s.rowEnd - s.rowBegin);
        if (options_.async || !rows.device().is_cpu()) {
          at::Tensor staged = at::empty(rows.sizes(), at::TensorOptions()
                                                          .dtype(rows.scalar_type())
                                                          .pinned_memory(rows.device().is_cuda()));
          staged.copy_(rows);
          s.rows = staged;
        } else {
          s.rows = rows.contiguous();
        }
        bytes += s.rows.numel() * static_cast<int64_t>(s.rows.element_size());
      }
    }
    job->sources.push_back(std::move(s));
  }
  const double stagingSeconds = options_.async ? secondsSince(stagingStart) : 0.0;

  SaveStats stats;
  stats.step = request.step;
  stats.dir = job->finalDir;
  stats.bytes = bytes;
  stats.waitSeconds = waitSeconds;
  stats.stagingSeconds = stagingSeconds;
  stats.async = options_.async;

  job_ = job;
  inFlightStep_ = request.step;
  if (options_.async) {
    writer_ = std::thread([job] {
      try {
        job->run();
      } catch (const std::exception& e) {
        job->error = e.what();
      } catch (...) {
        job->error = "unknown exception in the checkpoint writer";
      }
    });
    stats.stallSeconds = secondsSince(start);
    TLOG_INFO0("checkpoint step " << request.step << ": async save started; training stall " << stats.stallSeconds
                                  << " s (staging " << mib(bytes) << " took " << stagingSeconds << " s, waiting "
                                  << waitSeconds << " s)");
    return stats;
  }
  try {
    job->run();
  } catch (const std::exception& e) {
    job->error = e.what();
  }
  inFlightStep_ = -1;
  distributed::throwIfAnyRankFailed(comm_.get(), waitLocal(), strCat("checkpoint step ", request.step));
  stats.stallSeconds = secondsSince(start);
  TLOG_INFO0("checkpoint step " << request.step << " saved in " << stats.stallSeconds << " s (" << mib(bytes)
                                << " on rank 0)");
  return stats;
}

void Checkpointer::finish() {
  const int64_t previous = inFlightStep_;
  inFlightStep_ = -1;
  distributed::throwIfAnyRankFailed(comm_.get(), waitLocal(), strCat("checkpoint: the save of step ", previous));
}

}  // namespace tessera::checkpoint
