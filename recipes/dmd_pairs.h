// The regression pairs of the dmd recipe (recipe.regression_pairs noises and the
// teacher's guided DDIM samples of them, about 2 minutes for 1024 on 2 cores) kept in
// <run.dir>/cache/dmd_pairs.safetensors, so that a resume, or a restart of the same run,
// reads them instead of sampling them again. The file records everything the pairs depend
// on (its key: the teacher's architecture and weights file digest, dtype and device, the
// seed, counts, steps, guidance, the sample shape); a file with another key, or one that
// does not read as pairs, is replaced. Only a frozen teacher started from a file is cached:
// otherwise its weights are not known before they are used.
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

// What the pairs depend on, as a string ("" when they cannot be cached: a trainable
// teacher, or one that does not start from a file). Reads the teacher's weights files.
struct DmdPairsKeyParts {
  std::string teacherModelJson;             // its architecture (model metadata JSON)
  std::string teacherInitFrom;              // model.init_from ("" if none)
  bool teacherTrainable = false;
  std::string computeDtype, device;         // the teacher's param dtype, where it runs
  int64_t seed = 0, pairs = 0, pairSteps = 0;
  double guidance = 1.0;
  std::vector<int64_t> sampleShape;
  int64_t classes = 0;
};
std::string dmdPairsKey(const DmdPairsKeyParts& parts);

// <run.dir>/cache/dmd_pairs.safetensors.
std::filesystem::path dmdPairsCachePath(const std::filesystem::path& runDir);

// The cached pairs when rank 0 finds a file with this key whose tensors have the
// expected shapes (then broadcast over `hostComm` to every rank); nullopt otherwise (a
// damaged or foreign file is named in a warning). Collective over hostComm.
std::optional<DmdPairs> loadDmdPairs(const std::filesystem::path& file, const std::string& key, int64_t pairs,
                                     const std::vector<int64_t>& sampleShape, bool conditional,
                                     distributed::Communicator& hostComm);

// Rank 0 writes the pairs with their key (atomically: a partial file is never read); a
// failure to write is a warning (the next start samples them again).
void storeDmdPairs(const std::filesystem::path& file, const std::string& key, const DmdPairs& pairs, int rank);

}  // namespace tessera::recipes
