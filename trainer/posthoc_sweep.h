// Post-hoc EMA's choice of the EMA length, as EDM2 makes it: the EMA of each sigma_rel in a
// list reconstructed from a run's power-function snapshots (ema/posthoc.h), sampled and
// judged by a classifier (judge.h); the one with the lowest Frechet distance is kept as the
// export, beside a table and a plot of the sweep.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "trainer/judge.h"

namespace tessera::distributed {
class Communicator;
}  // namespace tessera::distributed

namespace tessera::trainer {

// The model description a run's newest complete checkpoint recorded for its EMA (`runDir`:
// the run directory or its posthoc/ directory), so that a post-hoc export says which model
// it holds as the run's own exports do; "" when the run has no checkpoint that says.
std::string posthocModelMetadata(const std::string& runDir);

struct PosthocSweepOptions {
  std::vector<double> sigmas;     // sigma_rel values to reconstruct and judge
  std::optional<int64_t> atStep;  // default: the last snapshot's step
  bool verify = true;
  std::string judge;              // the classifier export (judge.h)
  int64_t perClass = 100;         // samples per class, from the noise of `seed` (as tessera-sample draws)
  std::optional<int64_t> steps;   // DDIM steps; unset: the model's sample_timesteps (a distilled
                                  // generator's), or 50 evenly spaced when it has none
  double cfg = 2.0;               // classifier-free guidance
  std::vector<int64_t> cfgInterval;  // [first, last] timesteps where it applies (empty: all)
  int64_t seed = 1;
};

struct PosthocSweepPoint {
  double sigmaRel = 0;
  Judgement judgement;
};

struct PosthocSweepResult {
  int64_t step = 0;
  std::vector<PosthocSweepPoint> points;  // in the order asked
  size_t best = 0;                        // index of the lowest Frechet distance
  std::string sampler;                    // how it sampled: "DDIM 50 steps", "DDIM at the model's timesteps 999"
  std::string table, plot;                // the .tsv and .svg written beside outPath
};

// Reconstructs, samples and judges each sigma_rel in turn (beside outPath: the one being
// judged and the best so far), keeps the best as outPath (a non-finite distance never), and writes <outPath without
// .safetensors>_sweep.tsv and _sweep.svg (Frechet distance and accuracy against sigma_rel).
// UsageError for an empty list, a duplicate sigma or a run whose snapshots hold no model
// description to sample with.
// With a communicator of several ranks (tessera-export under a launcher) the samples are
// split over the ranks as tessera-sample splits them; rank 0 alone reads the run directory,
// reconstructs, judges and writes, and broadcasts the model description and each
// reconstruction's weights to the others (which need no file: they may be on nodes without
// a shared file system); a failure on any rank stops every rank. Every rank calls it; the
// result is rank 0's (the others' holds no points).
PosthocSweepResult sweepPosthocEma(const std::string& runDir, const std::string& outPath,
                                   const PosthocSweepOptions& options, distributed::Communicator* comm = nullptr);

}  // namespace tessera::trainer
