// Post-hoc EMA (EDM2's power-function EMA, docs/ema.md): the snapshots a run writes of its
// power-function profiles, and the reconstruction of the EMA of any sigma_rel from them,
// offline, streaming.
//
// A snapshot is a checkpoint (checkpoint/checkpointer.h: per-rank shards, checksummed,
// atomic) under <run.dir>/posthoc/step_N/ holding only the power-function profiles'
// entries, "ema/<profile>/<param>", and in trainer_state.json which sigma_rel each
// profile has: {"posthoc_profiles": {"generator_ema_phema0.05": 0.05, ...}}, and which
// run wrote it: {"run": {...}} (the trainer's seed and model description). It reshards on
// read like any checkpoint, so the world size that wrote it does not matter.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtensor/sharded_param.h"

namespace tessera::ema {

class ShardedModelEMAManager;

// A snapshot's tensors: `manager`'s power-function profiles, "ema/<profile>/<param>".
std::vector<dtensor::StateEntry> posthocSnapshotEntries(ShardedModelEMAManager& manager);
// The trainer_state.json of a snapshot of `manager`'s power-function profiles; `run`, a
// JSON object, says which run wrote it (snapshots of different runs are never mixed).
std::string posthocSnapshotState(const ShardedModelEMAManager& manager, const std::string& run = "{}");

struct PosthocSnapshot {
  int64_t step = 0;
  std::string dir;                                      // .../posthoc/step_N
  std::vector<std::pair<std::string, double>> profiles;  // profile name -> sigma_rel
};

// The complete snapshots under `dir` — a run directory (its posthoc/) or the posthoc
// directory itself — oldest first. Throws CheckpointError naming the snapshot whose
// state is missing or malformed, whose run differs from the first snapshot's (copied
// from another run), or that gives a profile another sigma_rel than an earlier snapshot
// or than its name says ("..._phema0.05"); UsageError when there is no snapshot.
std::vector<PosthocSnapshot> listPosthocSnapshots(const std::string& dir);

// Throws UsageError naming `--posthoc-ema SIGMA` when a power-function EMA of that
// sigma_rel cannot exist (out of [kMinPowerEmaStd, kMaxPowerEmaStd), or NaN).
void checkPosthocSigma(double sigmaRel);

struct PosthocOptions {
  double sigmaRel = 0.10;
  std::optional<int64_t> atStep;  // reconstruct the EMA at this step (default: the last snapshot's)
  bool verify = true;             // check every block's checksum
  std::map<std::string, std::string> metadata;  // more __metadata__ for the file (the model it holds)
};

struct PosthocResult {
  int64_t step = 0;
  std::vector<PosthocSnapshot> used;  // the snapshots at or before `step`
  std::vector<double> weights;        // per (snapshot, profile), in `used` order
  int64_t tensors = 0;
  int64_t bytes = 0;
  double seconds = 0;
};

// Solves EDM2's Algorithm 3 for the weights of every stored profile at or before the
// step, and writes sum_i w_i * profile_i as one safetensors file with the module's names
// (floating tensors combined in double precision and saved in their dtype; integer
// buffers from the newest snapshot). Streams: one block of rows of one tensor from each
// snapshot at a time. Throws UsageError for a sigma_rel out of range or a step before
// every snapshot, CheckpointError for damaged or inconsistent snapshots.
PosthocResult reconstructPosthocEma(const std::string& dir, const std::string& outPath, const PosthocOptions& options);

}  // namespace tessera::ema
