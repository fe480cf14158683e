// The dmd recipe's regression pairs cached in the run directory (see dmd_pairs.h).
#include "recipes/dmd_pairs.h"

#include <xxhash.h>

#include <fstream>
#include <iomanip>
#include <map>
#include <sstream>

#include "checkpoint/format.h"
#include "checkpoint/safetensors.h"
#include "common/errors.h"
#include "common/logging.h"
#include "models/model_options.h"

namespace tessera::recipes {
namespace fs = std::filesystem;

namespace {

constexpr const char* kKeyMetadata = "tessera.dmd_pairs_key";

// XXH3-64 of the bytes of `files`, in order (a teacher's weights: one file or the shards of
// a sharded export). Throws CheckpointError naming a file it cannot read through.
std::string digestOfFiles(const std::vector<std::string>& files) {
  struct State {
    XXH3_state_t* s = XXH3_createState();
    ~State() { XXH3_freeState(s); }
  } state;
  TESSERA_CHECK(state.s != nullptr, "dmd pairs: out of memory for a digest");
  XXH3_64bits_reset(state.s);
  std::vector<char> buffer(size_t{4} << 20);
  for (const std::string& name : files) {
    std::ifstream in(name, std::ios::binary);
    if (!in) throw checkpoint::CheckpointError(strCat("cannot open the teacher's weights ", name));
    while (in) {
      in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
      XXH3_64bits_update(state.s, buffer.data(), static_cast<size_t>(in.gcount()));
    }
    if (in.bad()) throw checkpoint::CheckpointError(strCat("read error in the teacher's weights ", name));
  }
  return checkpoint::checksumHex(XXH3_64bits_digest(state.s));
}

// The first "field value" of two keys that differs, as "field: file's value vs this run's".
std::string firstDifference(const std::string& file, const std::string& mine) {
  auto fields = [](const std::string& key) {
    std::vector<std::string> out;
    size_t begin = 0;
    while (begin <= key.size()) {
      const size_t end = std::min(key.find("; ", begin), key.size());
      out.push_back(key.substr(begin, end - begin));
      begin = end + 2;
    }
    return out;
  };
  const std::vector<std::string> a = fields(file), b = fields(mine);
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    const std::string x = i < a.size() ? a[i] : "(none)", y = i < b.size() ? b[i] : "(none)";
    if (x == y) continue;
    const std::string field = y.substr(0, y.find(' '));
    const auto value = [](const std::string& f) { return f.size() > 200 ? f.substr(0, 200) + "..." : f; };
    return strCat(field, ": the file's '", value(x), "', this run's '", value(y), "'");
  }
  return "same key";
}

}  // namespace

std::string dmdPairsKey(const DmdPairsKeyParts& p) {
  if (p.teacherTrainable || p.teacherInitFrom.empty()) return "";
  std::ostringstream guidance;
  guidance << std::setprecision(17) << p.guidance;
  // The architecture last: a "; " inside its JSON can only split the last field.
  return strCat("version 1; weights ", digestOfFiles(checkpoint::safetensorsFiles(p.teacherInitFrom)), "; dtype ",
                p.computeDtype, "; device ", p.device, "; seed ", p.seed, "; pairs ", p.pairs, "; pair_steps ",
                p.pairSteps, "; guidance ", guidance.str(), models::guidanceIntervalText(p.guidanceInterval),
                "; sample_shape ", at::IntArrayRef(p.sampleShape), "; classes ", p.classes, "; teacher ",
                p.teacherModelJson);
}

DmdPairsCache::DmdPairsCache(const fs::path& runDir, const DmdPairsKeyParts& parts, distributed::Communicator& hostComm)
    : file_(runDir / "cache" / "dmd_pairs.safetensors"), parts_(parts), hostComm_(hostComm) {
  if (hostComm_.rank() != 0) return;
  try {
    key_ = dmdPairsKey(parts_);
  } catch (const std::exception& e) {
    TLOG_WARN0("dmd: the regression pairs are not kept in " << file_.string() << ": the teacher's model.init_from "
                                                            << parts_.teacherInitFrom << " cannot be read for their key ("
                                                            << e.what() << ")");
  }
}

std::optional<DmdPairs> DmdPairsCache::load() {
  const int64_t pairs = parts_.pairs;
  const bool conditional = parts_.classes > 0;
  std::vector<int64_t> shape{pairs};
  shape.insert(shape.end(), parts_.sampleShape.begin(), parts_.sampleShape.end());
  DmdPairs out;
  at::Tensor found = at::zeros({1}, at::kLong);
  std::error_code ec;
  const fs::file_status status = fs::symlink_status(file_, ec);
  if (hostComm_.rank() == 0 && !key_.empty() && fs::exists(status)) {
    std::string problem;
    if (!fs::is_regular_file(status)) {
      problem = "not a regular file (a link, FIFO or directory is never read through, nor written)";
    } else {
      try {
        const checkpoint::SafetensorsReader reader(file_.string());
        const auto& metadata = reader.header().metadata;
        const auto k = metadata.find(kKeyMetadata);
        if (k == metadata.end()) {
          problem = strCat("no '", kKeyMetadata, "' in its metadata");
        } else if (k->second != key_) {
          problem = strCat("made for other settings: ", firstDifference(k->second, key_));
        } else {
          // Exactly the pairs' tensors, before any data is read.
          checkpoint::SafetensorsLayout want = {{"noise", {shape, at::kFloat}}, {"samples", {shape, at::kFloat}}};
          if (conditional) want["labels"] = {{pairs}, at::kLong};
          problem = checkpoint::safetensorsLayoutProblem(reader.header(), want);
          if (problem.empty()) {
            out.noise = reader.read("noise");
            out.samples = reader.read("samples");
            if (conditional) out.labels = reader.read("labels");
            for (const char* name : {"noise", "samples"}) {
              const at::Tensor& t = std::string(name) == "noise" ? out.noise : out.samples;
              if (problem.empty() && !at::isfinite(t).all().item<bool>()) problem = strCat("'", name, "' holds non-finite values");
            }
            if (problem.empty() && conditional && pairs > 0 &&
                (out.labels.min().item<int64_t>() < 0 || out.labels.max().item<int64_t>() >= parts_.classes)) {
              problem = strCat("'labels' outside [0, ", parts_.classes, ")");
            }
            if (!problem.empty()) out = DmdPairs{};
          }
        }
      } catch (const c10::Error& e) {
        problem = e.what_without_backtrace();  // LibTorch's words, without its stack
      } catch (const std::exception& e) {
        problem = e.what();
      }
    }
    if (problem.empty()) {
      found[0] = 1;
    } else {
      TLOG_WARN0("dmd: the cached regression pairs " << file_.string() << " are not used (" << problem
                                                      << "); sampling them again");
    }
  }
  hostComm_.broadcast(found, 0);
  if (found[0].item<int64_t>() == 0) return std::nullopt;
  if (hostComm_.rank() != 0) {
    out.noise = at::empty(shape, at::kFloat);
    out.samples = at::empty(shape, at::kFloat);
    if (conditional) out.labels = at::empty({pairs}, at::kLong);
  }
  hostComm_.broadcast(out.noise, 0);
  hostComm_.broadcast(out.samples, 0);
  if (conditional) hostComm_.broadcast(out.labels, 0);
  TLOG_INFO0("dmd: " << pairs << " regression pairs read from " << file_.string());
  return out;
}

void DmdPairsCache::store(const DmdPairs& pairs) {
  if (hostComm_.rank() != 0 || key_.empty()) return;
  try {
    std::error_code ec;
    const fs::file_status status = fs::symlink_status(file_, ec);
    if (fs::exists(status) && !fs::is_regular_file(status)) {
      throw checkpoint::CheckpointError("something that is not a regular file is in its place");
    }
    fs::create_directories(file_.parent_path());
    std::map<std::string, at::Tensor> tensors{{"noise", pairs.noise}, {"samples", pairs.samples}};
    if (pairs.labels.defined()) tensors.emplace("labels", pairs.labels);
    checkpoint::saveSafetensors(file_.string(), tensors, {{kKeyMetadata, key_}});
  } catch (const std::exception& e) {
    TLOG_WARN0("dmd: could not keep the regression pairs in " << file_.string() << " (" << e.what()
                                                              << "); a restart samples them again");
  }
}

}  // namespace tessera::recipes
