// The dmd recipe's regression pairs cached in the run directory (see dmd_pairs.h).
#include "recipes/dmd_pairs.h"

#include <xxhash.h>

#include <fstream>
#include <map>
#include <sstream>

#include "checkpoint/format.h"
#include "checkpoint/safetensors.h"
#include "common/errors.h"
#include "common/logging.h"

namespace tessera::recipes {
namespace fs = std::filesystem;

namespace {

constexpr const char* kKeyMetadata = "tessera.dmd_pairs_key";

// XXH3-64 of the bytes of `files`, in order (a teacher's weights: one file or the shards of
// a sharded export).
std::string digestOfFiles(const std::vector<std::string>& files) {
  XXH3_state_t* state = XXH3_createState();
  TESSERA_CHECK(state != nullptr, "dmd pairs: out of memory for a digest");
  XXH3_64bits_reset(state);
  std::vector<char> buffer(size_t{4} << 20);
  for (const std::string& name : files) {
    std::ifstream in(name, std::ios::binary);
    if (!in) {
      XXH3_freeState(state);
      throw checkpoint::CheckpointError(strCat("dmd pairs: cannot read the teacher's weights ", name));
    }
    while (in) {
      in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
      XXH3_64bits_update(state, buffer.data(), static_cast<size_t>(in.gcount()));
    }
  }
  const uint64_t digest = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return checkpoint::checksumHex(digest);
}

std::string shapeText(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}

// Why `t` is not a pairs tensor of `want` shape and dtype ("" when it is).
std::string mismatch(const std::map<std::string, at::Tensor>& tensors, const std::string& name,
                     const std::vector<int64_t>& want, at::ScalarType dtype) {
  const auto it = tensors.find(name);
  if (it == tensors.end()) return strCat("no tensor '", name, "'");
  if (it->second.sizes().vec() != want || it->second.scalar_type() != dtype) {
    return strCat("'", name, "' is ", it->second.toString(), " ", shapeText(it->second.sizes().vec()), ", not ",
                  c10::toString(dtype), " ", shapeText(want));
  }
  if (dtype == at::kFloat && !at::isfinite(it->second).all().item<bool>()) return strCat("'", name, "' holds non-finite values");
  return "";
}

}  // namespace

std::string dmdPairsKey(const DmdPairsKeyParts& p) {
  if (p.teacherTrainable || p.teacherInitFrom.empty()) return "";
  return strCat("dmd pairs v1; teacher ", p.teacherModelJson, "; weights xxh3 ",
                digestOfFiles(checkpoint::safetensorsFiles(p.teacherInitFrom)), "; dtype ", p.computeDtype, "; device ",
                p.device, "; seed ", p.seed, "; pairs ", p.pairs, "; pair_steps ", p.pairSteps, "; guidance ",
                strCat(p.guidance), "; sample shape ", shapeText(p.sampleShape), "; classes ", p.classes);
}

fs::path dmdPairsCachePath(const fs::path& runDir) { return runDir / "cache" / "dmd_pairs.safetensors"; }

std::optional<DmdPairs> loadDmdPairs(const fs::path& file, const std::string& key, int64_t pairs,
                                     const std::vector<int64_t>& sampleShape, bool conditional,
                                     distributed::Communicator& hostComm) {
  std::vector<int64_t> shape{pairs};
  shape.insert(shape.end(), sampleShape.begin(), sampleShape.end());
  DmdPairs out;
  at::Tensor found = at::zeros({1}, at::kLong);
  if (hostComm.rank() == 0) {
    std::error_code ec;
    if (!key.empty() && fs::is_regular_file(fs::symlink_status(file, ec))) {  // never through a link
      std::string problem;
      try {
        const checkpoint::SafetensorsReader reader(file.string());
        const auto& metadata = reader.header().metadata;
        const auto k = metadata.find(kKeyMetadata);
        if (k == metadata.end() || k->second != key) {
          problem = "made for another teacher or other recipe settings";
        } else {
          const std::map<std::string, at::Tensor> tensors = checkpoint::loadSafetensors(file.string());
          problem = mismatch(tensors, "noise", shape, at::kFloat);
          if (problem.empty()) problem = mismatch(tensors, "samples", shape, at::kFloat);
          if (problem.empty() && conditional) problem = mismatch(tensors, "labels", {pairs}, at::kLong);
          if (problem.empty()) {
            out.noise = tensors.at("noise");
            out.samples = tensors.at("samples");
            if (conditional) out.labels = tensors.at("labels");
          }
        }
      } catch (const std::exception& e) {
        problem = e.what();
      }
      if (problem.empty()) {
        found[0] = 1;
      } else {
        TLOG_WARN0("dmd: the cached regression pairs " << file.string() << " are not used (" << problem
                                                       << "); sampling them again");
      }
    }
  }
  hostComm.broadcast(found, 0);
  if (found[0].item<int64_t>() == 0) return std::nullopt;
  if (hostComm.rank() != 0) {
    out.noise = at::empty(shape, at::kFloat);
    out.samples = at::empty(shape, at::kFloat);
    if (conditional) out.labels = at::empty({pairs}, at::kLong);
  }
  hostComm.broadcast(out.noise, 0);
  hostComm.broadcast(out.samples, 0);
  if (conditional) hostComm.broadcast(out.labels, 0);
  TLOG_INFO0("dmd: " << pairs << " regression pairs read from " << file.string());
  return out;
}

void storeDmdPairs(const fs::path& file, const std::string& key, const DmdPairs& pairs, int rank) {
  if (rank != 0 || key.empty()) return;
  try {
    fs::create_directories(file.parent_path());
    std::map<std::string, at::Tensor> tensors{{"noise", pairs.noise}, {"samples", pairs.samples}};
    if (pairs.labels.defined()) tensors.emplace("labels", pairs.labels);
    checkpoint::saveSafetensors(file.string(), tensors, {{kKeyMetadata, key}});
  } catch (const std::exception& e) {
    TLOG_WARN0("dmd: could not keep the regression pairs in " << file.string() << " (" << e.what()
                                                              << "); a restart samples them again");
  }
}

}  // namespace tessera::recipes
