// Checkpointer: collective sharded save with an atomic commit, optional async writing,
// and keep_last retention. What a save writes (docs/checkpoint.md, "On disk"):
//   step_00000100/      metadata.json, trainer_state.json, rank_0000R.bin (see metadata.h)
//   latest              "step_00000100\n", replaced atomically after the step is durable
//   step_00000200.tmp/  a save in progress, or the remains of one that crashed: never
//                       loaded, removed by the next save
// The commit protocol (docs/checkpoint.md, "Commit protocol"): every rank waits for its
// previous save; rank 0 prepares step_N.tmp/; one all-reduce, overlapped with the
// staging copy, agrees whether any rank's previous save failed; every rank writes its
// rows to rank_R.bin (checksummed per block, fsynced) and publishes its chunk table as
// rank_R.json (or rank_R.error); rank 0 merges them, writes metadata.json last, renames
// step_N.tmp -> step_N and replaces `latest`, then applies keep_last. Writing runs on the
// caller's thread (sync) or one writer thread per rank (async: the stall is the staging
// copy); writers hand off through the shared filesystem, never through a collective. A
// crash leaves the previous checkpoints plus an ignored step_N.tmp, or a complete step_N.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/staging_buffers.h"
#include "checkpoint/state.h"

namespace tessera::distributed {
class Communicator;
}

namespace tessera::checkpoint {

// Points of the protocol where tests inject failures (throw) or crashes (SIGKILL).
enum class SavePoint {
  kStaging,          // every rank, on the caller's thread, before copying its rows
  kBeforeData,       // every rank, before creating its data file
  kAfterData,        // every rank, data fsynced, index not yet published
  kAfterRankIndex,   // every rank, index published
  kBeforeMetadata,   // rank 0, chunk tables merged, trainer_state.json written
  kBeforeRename,     // rank 0, metadata.json written and fsynced
  kBeforeLatest,     // rank 0, step_N renamed into place
  kBeforeRetention,  // rank 0, `latest` replaced
};
const char* savePointName(SavePoint point);

struct CheckpointOptions {
  // Keep this many newest complete checkpoints (0 = keep all).
  int keepLast = 0;
  // Write in a background thread; save() returns after staging.
  bool async = false;
  // Checksum granularity (multiple of 8): a resharding reader reads at most 2 extra
  // blocks per chunk. 1 MiB: a 4 -> 3 rank resharded load of bench/checkpoint_bench
  // reads 1.05x the checkpoint's bytes (1.16x with 4 MiB blocks). The smallest block a
  // save uses: see maxMetadataBytes.
  int64_t blockBytes = int64_t{1} << 20;
  // The size metadata.json may reach (every rank parses it to load): ~26 bytes per
  // checksum block and ~256 per chunk (estimateMetadataBytes). A save whose estimate is
  // larger doubles its block size until it fits (up to kMaxBlockBytes); one whose
  // metadata could not fit the 256 MiB readers accept (kMaxJsonBytes) even then fails
  // before writing anything. 128 MiB: 1 MiB blocks up to ~4.5 TiB of state.
  int64_t maxMetadataBytes = int64_t{128} << 20;
  // How long rank 0 waits for the other ranks' chunk tables.
  std::chrono::milliseconds commitTimeout = std::chrono::minutes(10);
  // Tests: called at each SavePoint with the rank; a throw fails the save there.
  std::function<void(SavePoint point, int rank)> faultHook;
};

// An upper bound on the size of metadata.json for a state of `stateBytes` in `chunks`
// chunks with checksum blocks of `blockBytes` (each chunk ends in a partial block).
int64_t estimateMetadataBytes(int64_t blockBytes, int64_t stateBytes, int64_t chunks);
// The checksum block size a save uses: `requested`, doubled while the estimate is over
// `maxMetadataBytes` and doubling still lowers it, at most kMaxBlockBytes.
int64_t checksumBlockBytes(int64_t requested, int64_t maxMetadataBytes, int64_t stateBytes, int64_t chunks);

struct SaveRequest {
  int64_t step = 0;
  std::string strategy;                 // recorded for info / resume checks ("zero3", ...)
  std::vector<StateEntry> entries;      // same names, order, shapes and dtypes on every rank
  std::string trainerState = "{}";      // JSON object; rank 0's is saved
  std::string rankState = "{}";         // JSON object; every rank's is saved (RNG, ...)
  // What each tensor prefix is and the names it exports under (metadata.h; rank 0's are
  // saved); none for a save that is not made of Stateful components.
  std::vector<ComponentRecord> components;
};

// What a Stateful save records besides the components' tensors (see SaveRequest).
struct SaveOptions {
  std::string strategy;             // "" = the strategies among the components (describeStrategies)
  std::string trainerState = "{}";  // JSON object; rank 0's is saved
  std::string rankState = "{}";     // JSON object; every rank's is saved
};

// The request a save of Stateful components makes: their entries under "<key>/", their
// records as the component table (less the parts and exports with no entries under
// them, which readers refuse).
SaveRequest saveRequestOf(int64_t step, const StateMap& states, const SaveOptions& options = {});

struct SaveStats {
  int64_t step = 0;
  std::string dir;              // the final step_N directory
  int64_t bytes = 0;            // data bytes this rank writes
  double waitSeconds = 0;       // waiting for the previous save + agreeing on its outcome
  double stagingSeconds = 0;    // copying the shards (async), or 0
  int64_t stagingAllocatedBytes = 0;  // staging memory this save had to allocate (0 once reused)
  int64_t blockBytes = 0;       // the checksum block size this save used (see maxMetadataBytes)
  double stallSeconds = 0;      // total time save() kept the caller (the training stall)
  bool async = false;
};

class Checkpointer {
 public:
  // `comm`: the group the entries' specs are sharded over (nullptr: one process).
  Checkpointer(std::string checkpointsDir, std::shared_ptr<distributed::Communicator> comm,
               CheckpointOptions options = {});
  // Waits for an in-flight save; a failure there is logged (a destructor cannot throw:
  // call finish() at the end of a run to get it as an exception).
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Collective. Saves the request as step_<step>; returns once written and committed
  // (sync) or once staged (async). Throws tessera::Error on every rank when any rank's
  // previous async save failed or (sync) this save failed anywhere. Saving a step that
  // already exists replaces it.
  SaveStats save(const SaveRequest& request);
  // The same for a map of Stateful components (checkpoint/state.h): their entries under
  // "<key>/", their records as the checkpoint's component table.
  SaveStats save(int64_t step, const StateMap& states, const SaveOptions& options = {});
  // Collective. Waits for the in-flight save and throws on every rank if it failed on any.
  void finish();
  // Whether this rank's in-flight async save has already failed (a full disk, say): not
  // collective, so a caller shares it with the other ranks (the trainer: on the step's
  // all-reduce) and then all call finish(), which throws everywhere within a step instead
  // of at the next save.
  bool writerFailed() const;


  struct Job;  // one rank's write of one step (checkpointer.cpp)

 private:
  std::string waitLocal();  // joins the writer; returns its error ("" when none)
  // Rank 0: removes the *.tmp debris of crashed saves and creates tmpDir.
  void prepareTmpDir(const std::string& tmpDir) const;
  // The steps of save() (the protocol in the header comment).
  int64_t checkRequest(const SaveRequest& request) const;
  std::shared_ptr<Job> makeJob(const SaveRequest& request, int64_t blockBytes) const;
  int64_t agreeAndStage(const SaveRequest& request, Job& job, int64_t previous, const std::string& previousError,
                        double& stagingSeconds);
  void startWriter(const std::shared_ptr<Job>& job);
  void writeNow(Job& job);
  // Fills job.sources with the rows of the request's entries (staged copies where
  // async or on a device); returns the bytes this rank writes.
  int64_t stage(const SaveRequest& request, Job& job);

  std::string root_;
  std::shared_ptr<distributed::Communicator> comm_;
  CheckpointOptions options_;
  int rank_ = 0;
  int world_ = 1;
  std::thread writer_;
  std::shared_ptr<Job> job_;
  StagingBuffers staging_;  // reused by every save; the in-flight job reads them
  int64_t inFlightStep_ = -1;
};

}  // namespace tessera::checkpoint
