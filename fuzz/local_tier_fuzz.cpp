// libFuzzer target: what a node-local tier directory holds when a run starts and promotes
// from it (checkpoint/local_tier_files.h). The input is one step directory's files —
// tier_owner.json, metadata.json, trainer_state.json and rank_00000.bin, each after a
// 4-byte little-endian length (the last takes the rest) — written as step_00000004 of a tier
// directory that also holds another run's step and a file the tier never wrote. Then:
//   - the inventory never throws, lists only steps newer than asked, of this run, with
//     ranks the metadata has, and survives the exchange between ranks (JSON, back);
//   - the promotion's choice over the ranks' inventories picks only such a step, whole;
//   - removing the run's steps leaves the other run's step and the foreign file alone, and
//     removes the fuzzed step only when its mark names this run.
// fuzz/corpus/local_tier/ holds a real one-rank step written by tessera-train.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "checkpoint/local_tier_files.h"
#include "common/errors.h"
#include "common/filesystem.h"
#include "common/logging.h"

namespace fs = std::filesystem;
namespace ckpt = tessera::checkpoint;

namespace {

constexpr char kRun[] = "host:/runs/a";
constexpr char kOtherRun[] = "host:/runs/b";

// The next piece of the input: a 4-byte length, then that many bytes (or what is left).
std::string take(const uint8_t*& data, size_t& size, bool last) {
  if (last) {
    std::string out(reinterpret_cast<const char*>(data), size);
    size = 0;
    return out;
  }
  if (size < 4) {
    size = 0;
    return "";
  }
  uint32_t n = 0;
  std::memcpy(&n, data, 4);
  data += 4;
  size -= 4;
  n = static_cast<uint32_t>(std::min<size_t>(n, size));
  std::string out(reinterpret_cast<const char*>(data), n);
  data += n;
  size -= n;
  return out;
}

void write(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) std::abort();
}

// One tier directory per process, emptied for each input.
const fs::path& tierDir() {
  static const fs::path dir = [] {
    tessera::log::LogOptions quiet;
    quiet.level = "off";  // the inventory's warnings about damaged files
    tessera::log::init(quiet);
    const fs::path d = fs::temp_directory_path() / ("tessera_tier_fuzz_" + std::to_string(::getpid()));
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path& dir = tierDir();
  std::error_code ec;
  tessera::removeTree(dir.string(), ec);
  fs::create_directories(dir / "step_00000004");
  fs::create_directories(dir / "step_00000002");
  write(dir / "step_00000002" / ckpt::kTierOwnerFile, std::string("{\"owner\": \"") + kOtherRun + "\", \"step\": 2}");
  write(dir / "notes.txt", "not the tier's");

  const fs::path step = dir / "step_00000004";
  write(step / ckpt::kTierOwnerFile, take(data, size, false));
  write(step / "metadata.json", take(data, size, false));
  write(step / "trainer_state.json", take(data, size, false));
  write(step / "rank_00000.bin", take(data, size, true));

  const bool ours = ckpt::stepOwner(step) == std::string(kRun);
  for (const int64_t after : {int64_t{0}, int64_t{4}}) {
    const std::vector<ckpt::HeldStep> held = ckpt::inventory(dir.string(), kRun, after);
    for (const ckpt::HeldStep& h : held) {
      if (!ours || h.step != 4 || h.step <= after || h.ranks.empty()) std::abort();
      for (const int r : h.ranks) {
        if (r < 0 || r >= h.savedWorld) std::abort();
      }
    }
    const std::vector<ckpt::HeldStep> back = ckpt::parseInventory(ckpt::inventoryJson(held));
    if (back.size() != held.size()) std::abort();
    // The promotion's choice over two ranks holding the same: only this run's step, newer than
    // asked, every saved rank's file with a copier among the ranks, a trainer state holder;
    // and chosen whenever one rank holds all of it.
    const auto chosen = ckpt::choosePromotion({held, back}, after);
    if (chosen) {
      if (chosen->step != 4 || chosen->step <= after || chosen->holders.empty()) std::abort();
      for (const int c : chosen->copier) {
        if (c < 0 || c > 1) std::abort();
      }
    }
    for (const ckpt::HeldStep& h : held) {
      if (h.trainerState && static_cast<int>(h.ranks.size()) == h.savedWorld && !chosen) std::abort();
    }
    for (size_t i = 0; i < held.size(); ++i) {
      if (back[i].step != held[i].step || back[i].metadata != held[i].metadata || back[i].ranks != held[i].ranks ||
          back[i].savedWorld != held[i].savedWorld || back[i].trainerState != held[i].trainerState) {
        std::abort();
      }
    }
  }

  ckpt::removeSteps(dir.string(), kRun);
  if (!fs::is_directory(dir / "step_00000002") || !fs::is_regular_file(dir / "notes.txt")) std::abort();
  if (fs::exists(step) == ours) std::abort();
  return 0;
}
