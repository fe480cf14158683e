// The node-local tier's files (see local_tier_files.h).
#include "checkpoint/local_tier_files.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <map>

#include "checkpoint/file_io.h"
#include "checkpoint/format.h"
#include "checkpoint/metadata.h"
#include "checkpoint/reader.h"
#include "common/errors.h"
#include "common/filesystem.h"
#include "common/logging.h"

namespace tessera::checkpoint {

namespace fs = std::filesystem;

std::optional<std::string> stepOwner(const fs::path& stepDir) {
  try {
    const std::string text = readFileBounded((stepDir / kTierOwnerFile).string(), 64 << 10, LinkPolicy::kRefuse);
    const nlohmann::json j = nlohmann::json::parse(text);
    if (j.is_object() && j.contains("owner") && j.at("owner").is_string()) return j.at("owner").get<std::string>();
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

void claimStepDir(const fs::path& dir, const std::string& owner, int64_t step, int rank) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(dir, ec))) {
    const fs::path aside = strCat(dir.string(), ".", rank, ".tmp");
    removeTree(aside.string(), ec);
    fs::create_directories(aside, ec);
    if (ec) throw Error(strCat("cannot create ", aside.string(), ": ", ec.message()));
    File f = File::openWrite((aside / kTierOwnerFile).string());
    const std::string text = nlohmann::json{{"owner", owner}, {"step", step}}.dump();
    f.writeAll(text.data(), text.size());
    f.close();
    // Another rank's may have got there first: then this one goes (the two are the same).
    if (::rename(aside.c_str(), dir.c_str()) != 0) removeTree(aside.string(), ec);
  }
  const std::optional<std::string> by = fs::is_directory(fs::symlink_status(dir, ec)) ? stepOwner(dir) : std::nullopt;
  if (!by || *by != owner) {
    throw Error(strCat(dir.string(), " exists and is not this run's (",
                       by ? strCat("written for ", quote(*by)) : std::string("not written by the local tier"),
                       "): left as it is"));
  }
}

std::vector<std::pair<int64_t, fs::path>> ownedStepDirs(const std::string& dir, const std::string& owner,
                                                        std::vector<std::string>* others) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  if (!fs::is_directory(fs::symlink_status(dir, ec))) return out;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::optional<int64_t> step = parseStepDirName(entry.path().filename().string());
    if (!step) continue;
    if (!fs::is_directory(fs::symlink_status(entry.path(), ec))) {
      if (others) others->push_back(strCat(entry.path().string(), " (not a directory: a link or a file)"));
      continue;
    }
    const std::optional<std::string> by = stepOwner(entry.path());
    if (by && *by == owner) {
      out.emplace_back(*step, entry.path());
    } else if (others) {
      others->push_back(by ? strCat(entry.path().string(), " (written for ", quote(*by), ")")
                           : strCat(entry.path().string(), " (not written by the local tier)"));
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

bool isComplete(const fs::path& stepDir) {
  std::error_code ec;
  return fs::is_regular_file(fs::symlink_status(stepDir / kMetadataFile, ec));
}

void removeSteps(const std::string& dir, const std::string& owner) {
  for (const auto& [step, path] : ownedStepDirs(dir, owner)) {
    std::error_code ec;
    removeTree(path.string(), ec);
    if (ec) TLOG_WARN("checkpoint.local: cannot remove " << path.string() << ": " << ec.message());
  }
}

std::vector<HeldStep> inventory(const std::string& dir, const std::string& owner, int64_t after) {
  std::vector<HeldStep> out;
  std::vector<std::string> others;
  for (const auto& [step, path] : ownedStepDirs(dir, owner, &others)) {
    if (step <= after || !isComplete(path)) continue;
    try {
      CheckpointReader reader(path.string());
      const CheckpointMetadata& md = reader.metadata();
      if (md.step != step) continue;
      const std::string mdPath = (path / kMetadataFile).string();
      const std::string text = readFileBounded(mdPath, kMaxJsonBytes);
      HeldStep held;
      held.step = step;
      held.metadata = checksum(text.data(), text.size());
      held.savedWorld = md.worldSize;
      for (int r = 0; r < md.worldSize; ++r) {
        const FileInfo& f = md.files.at(static_cast<size_t>(r));
        std::error_code ec;
        const fs::path file = path / f.name;
        if (f.name != rankDataFile(r) || !fs::is_regular_file(fs::symlink_status(file, ec))) continue;
        try {
          reader.verifyFile(f.name);
          held.ranks.push_back(r);
        } catch (const std::exception& e) {
          TLOG_WARN("checkpoint.local: " << file.string() << " is not used: " << e.what());
        }
      }
      try {
        reader.trainerState(/*verify=*/true);
        held.trainerState = true;
      } catch (const std::exception& e) {
        TLOG_WARN("checkpoint.local: " << (path / kTrainerStateFile).string() << " is not used: " << e.what());
      }
      if (!held.ranks.empty()) out.push_back(std::move(held));
    } catch (const std::exception& e) {
      TLOG_WARN("checkpoint.local: ignoring " << path.string() << ": " << e.what());
    }
  }
  for (const std::string& other : others) TLOG_WARN("checkpoint.local: left alone: " << other);
  return out;
}

std::string inventoryJson(const std::vector<HeldStep>& held) {
  nlohmann::json steps = nlohmann::json::array();
  for (const HeldStep& h : held) {
    steps.push_back({{"step", h.step}, {"metadata", h.metadata}, {"world", h.savedWorld}, {"ranks", h.ranks},
                     {"state", h.trainerState}});
  }
  return steps.dump();
}

std::vector<HeldStep> parseInventory(const std::string& text) {
  std::vector<HeldStep> out;
  for (const auto& s : nlohmann::json::parse(text)) {
    HeldStep h;
    h.step = s.at("step").get<int64_t>();
    h.metadata = s.at("metadata").get<uint64_t>();
    h.savedWorld = s.at("world").get<int>();
    h.ranks = s.at("ranks").get<std::vector<int>>();
    h.trainerState = s.at("state").get<bool>();
    out.push_back(std::move(h));
  }
  return out;
}

std::optional<PromotionChoice> choosePromotion(const std::vector<std::vector<HeldStep>>& held, int64_t newestPersistent,
                                               bool* incomplete) {
  // Every (step, metadata) held anywhere: for each saved rank the lowest rank holding its file.
  std::map<std::pair<int64_t, uint64_t>, PromotionChoice> candidates;
  for (size_t r = 0; r < held.size(); ++r) {
    for (const HeldStep& h : held[r]) {
      if (h.step <= newestPersistent || h.savedWorld <= 0) continue;
      PromotionChoice& c = candidates[{h.step, h.metadata}];
      c.step = h.step;
      c.metadata = h.metadata;
      if (c.copier.empty()) c.copier.assign(static_cast<size_t>(h.savedWorld), -1);
      if (static_cast<int>(c.copier.size()) != h.savedWorld) continue;  // the same metadata: cannot happen
      if (h.trainerState && (c.holders.empty() || c.holders.back() != static_cast<int>(r))) {
        c.holders.push_back(static_cast<int>(r));
      }
      for (const int saved : h.ranks) {
        if (saved < 0 || saved >= h.savedWorld) continue;
        int& copier = c.copier[static_cast<size_t>(saved)];
        if (copier < 0) copier = static_cast<int>(r);
      }
    }
  }
  if (incomplete != nullptr) *incomplete = !candidates.empty();
  for (auto it = candidates.rbegin(); it != candidates.rend(); ++it) {
    const PromotionChoice& c = it->second;
    if (!c.holders.empty() && std::all_of(c.copier.begin(), c.copier.end(), [](int r) { return r >= 0; })) {
      if (incomplete != nullptr) *incomplete = false;
      return c;
    }
  }
  return std::nullopt;
}

}  // namespace tessera::checkpoint
