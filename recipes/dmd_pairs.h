// The regression pairs of the dmd recipe (recipe.regression_pairs noises and the teacher's
// guided DDIM samples of them: 244 s for 1024 of the fashion DiT on 2 cores) kept in
// <run.dir>/cache/dmd_pairs.safetensors, so that a resume, or a restart of the same run,
// reads them instead of sampling them again. The file records everything the pairs depend
// on (its key: the teacher's architecture and the digest of its weights file, dtype and
// device, the seed, count, steps, guidance, the sample shape); a file with another key, or
// one that does not read as pairs, is named in a warning and replaced. Only a frozen teacher
// started from a file is cached: otherwise its weights are not known before they are used.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "distributed/communicator.h"

namespace tessera::recipes {

struct DmdPairs {
  at::Tensor noise;    // [n, sample shape...] fp32, CPU
  at::Tensor samples;  // the teacher's samples of them, same shape
  at::Tensor labels;   // [n] int64, their classes; undefined for an unconditional teacher
};

// What the pairs depend on.
struct DmdPairsKeyParts {
  std::string teacherModelJson;             // its architecture (model metadata JSON)
  std::string teacherInitFrom;              // model.init_from ("" if none)
  bool teacherTrainable = false;
  std::string computeDtype, device;         // the teacher's param dtype (and run.matmul_dtype when bf16), where it runs
  int64_t seed = 0, pairs = 0, pairSteps = 0;
  double guidance = 1.0;
  std::vector<int64_t> guidanceInterval;    // recipe.guidance_interval (empty: every timestep)
  std::vector<int64_t> sampleShape;
  int64_t classes = 0;
};

// The key as "field value; field value; ...", the weights file read for its XXH3 digest
// ("" when the pairs cannot be cached: a trainable teacher or one not started from a
// file). Throws tessera::checkpoint::CheckpointError naming a weights file it cannot read.
std::string dmdPairsKey(const DmdPairsKeyParts& parts);

// The cache of one run. Rank 0 alone reads and writes the file (the others need not see
// the same file system) and computes the key; load() broadcasts what it read.
class DmdPairsCache {
 public:
  // <runDir>/cache/dmd_pairs.safetensors. A teacher file that cannot be read for the key is
  // a warning (the pairs are then sampled and not kept).
  DmdPairsCache(const std::filesystem::path& runDir, const DmdPairsKeyParts& parts,
                distributed::Communicator& hostComm);

  // The cached pairs when rank 0 finds a file with this key holding pairs of the expected
  // shapes and classes; nullopt otherwise. Collective over hostComm.
  std::optional<DmdPairs> load();
  // Rank 0 writes the pairs with their key (atomically: a partial file is never read); a
  // failure to write is a warning (the next start samples them again).
  void store(const DmdPairs& pairs);


 private:
  std::filesystem::path file_;
  DmdPairsKeyParts parts_;
  distributed::Communicator& hostComm_;
  std::string key_;  // rank 0's; "" elsewhere and when not cached
};

}  // namespace tessera::recipes
