// The node-local tier's files (local_tier.h): which step directories a run owns (each holds
// a tier_owner.json naming it), making one, removing them, and what a node holds of a step
// with every file verified against its checksums. No communicator: the fuzz build compiles
// it (fuzz/local_tier_fuzz.cpp), since a node's directory is input the run did not check.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace tessera::checkpoint {

// The file in each step directory that says which owner wrote it.
inline constexpr char kTierOwnerFile[] = "tier_owner.json";

// The owner a step directory's tier_owner.json names, or nullopt when it has none (or an
// unreadable one): a directory the tier did not write.
std::optional<std::string> stepOwner(const std::filesystem::path& stepDir);

// Makes step directory `dir`, marked as `owner`'s, or finds it made by another rank of the
// node: each rank builds it aside (dir.<rank>.tmp, the mark inside) and renames it into
// place, so that no rank ever sees the directory without its mark. Error when `dir` is
// there and not `owner`'s (another run's, or not the tier's): it is left as it is.
void claimStepDir(const std::filesystem::path& dir, const std::string& owner, int64_t step, int rank);

// `owner`'s step directories in `dir` (complete or not), ascending: real directories named
// step_<digits>, never links, whose tier_owner.json names `owner`. The other step
// directories are listed in `others` (when given) with why they are not the owner's.
std::vector<std::pair<int64_t, std::filesystem::path>> ownedStepDirs(const std::string& dir, const std::string& owner,
                                                                     std::vector<std::string>* others = nullptr);

// A step directory whose metadata is written (its save committed on this node).
bool isComplete(const std::filesystem::path& stepDir);

// Removes `owner`'s step directories in `dir` (a failure is logged: the next save's
// retention or the next start tries again). Nothing else in `dir` is touched.
void removeSteps(const std::string& dir, const std::string& owner);

// What one node's directory holds of one of its owner's steps: the checksum of its metadata
// (so that only copies of the same save are put together), the saved ranks whose files are
// there with every checksum right, and whether its trainer state is intact (what the rank
// that copies the metadata needs).
struct HeldStep {
  int64_t step = 0;
  uint64_t metadata = 0;
  int savedWorld = 0;
  std::vector<int> ranks;
  bool trainerState = false;
};

// `owner`'s complete steps in `dir` newer than `after` (older ones would not be promoted),
// each of their files read once to verify it; what is damaged or foreign is logged and left
// out, never thrown.
std::vector<HeldStep> inventory(const std::string& dir, const std::string& owner, int64_t after);

// An inventory as the ranks exchange it (JSON), and back; parseInventory throws on text
// that is not one.
std::string inventoryJson(const std::vector<HeldStep>& held);
std::vector<HeldStep> parseInventory(const std::string& text);

// The step a start promotes, from what every rank holds (`held[r]`: rank r's inventory): the
// newest step newer than `newestPersistent` of which some rank holds every saved rank's file
// and some rank an intact trainer state (copies of one save only: the same metadata
// checksum). `copier[s]`: the lowest rank holding saved rank s's file; `holders`: the ranks
// with its trainer state, ascending. nullopt when no step is complete; `incomplete` (when
// given) then says whether some newer step was held in part.
struct PromotionChoice {
  int64_t step = -1;
  uint64_t metadata = 0;
  std::vector<int> copier;
  std::vector<int> holders;
};
std::optional<PromotionChoice> choosePromotion(const std::vector<std::vector<HeldStep>>& held, int64_t newestPersistent,
                                               bool* incomplete = nullptr);

}  // namespace tessera::checkpoint
