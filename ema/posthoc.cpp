// Post-hoc EMA snapshots and reconstruction (see posthoc.h).
#include "ema/posthoc.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>

#include "checkpoint/format.h"
#include "checkpoint/reader.h"
#include "checkpoint/safetensors.h"
#include "common/errors.h"
#include "ema/ema_manager.h"
#include "ema/posthoc_state.h"
#include "ema/power_ema.h"

namespace tessera::ema {

namespace fs = std::filesystem;
using checkpoint::CheckpointError;

namespace {

// Rows combined at a time: about this many bytes of each snapshot's tensor.
constexpr int64_t kBlockBytes = int64_t{4} << 20;

std::string snapshotsDir(const std::string& dir) {
  const fs::path posthoc = fs::path(dir) / "posthoc";
  std::error_code ec;
  return fs::is_directory(posthoc, ec) ? posthoc.string() : dir;
}

}  // namespace

std::vector<dtensor::StateEntry> posthocSnapshotEntries(ShardedModelEMAManager& manager) {
  std::vector<dtensor::StateEntry> entries;
  for (size_t i = 0; i < manager.numProfiles(); ++i) {
    if (!manager.isPowerProfile(i)) continue;
    for (auto& e : manager.profileEntries(i, dtensor::statePrefix(dtensor::kEmaKey))) entries.push_back(std::move(e));
  }
  return entries;
}

std::string posthocSnapshotState(const ShardedModelEMAManager& manager, const std::string& run) {
  nlohmann::json profiles = nlohmann::json::object();
  for (size_t i = 0; i < manager.numProfiles(); ++i) {
    if (manager.isPowerProfile(i)) profiles[manager.stateName(i)] = manager.powerStd(i);
  }
  nlohmann::json identity = nlohmann::json::parse(run, nullptr, /*allow_exceptions=*/false);
  TESSERA_CHECK(identity.is_object(), "posthocSnapshotState: the run's identity must be a JSON object, got ", run);
  // The model, as the profiles hold it: every parameter's name and global shape.
  std::string shapes;
  for (const std::string& name : manager.paramNames()) {
    shapes += strCat(name, at::IntArrayRef(manager.spec(name).globalShape()), ";");
  }
  identity["parameters"] = checkpoint::checksumHex(checkpoint::checksum(shapes.data(), shapes.size()));
  return nlohmann::json{{kPosthocProfilesKey, profiles}, {kPosthocRunKey, identity}}.dump();
}

std::vector<PosthocSnapshot> listPosthocSnapshots(const std::string& dir) {
  const std::string root = snapshotsDir(dir);
  std::vector<PosthocSnapshot> out;
  std::map<std::string, std::pair<double, std::string>> firstSigma;  // profile -> (sigma_rel, file)
  std::string firstRun, firstWhere;
  for (const auto& ref : checkpoint::listCheckpoints(root)) {
    checkpoint::CheckpointReader reader(ref.dir);
    const std::string where = (fs::path(ref.dir) / "trainer_state.json").string();
    PosthocSnapshot s;
    s.step = reader.metadata().step;
    s.dir = ref.dir;
    const PosthocState state = parsePosthocState(reader.trainerState(), where);
    for (const auto& [name, value] : state.profiles) {
      // One value per profile over the run's snapshots.
      auto first = firstSigma.emplace(name, std::make_pair(value, where)).first;
      if (std::abs(first->second.first - value) > 1e-12 * value) {
        throw CheckpointError(strCat(where, ": profile '", name, "' has sigma_rel ", value, ", but ",
                                     first->second.second, " gives it ", first->second.first));
      }
      s.profiles.emplace_back(name, value);
    }
    // One run: a snapshot copied from another (another seed, model or config) is refused.
    if (out.empty()) {
      firstRun = state.run;
      firstWhere = where;
    } else if (state.run != firstRun) {
      throw CheckpointError(strCat(where, ": written by another run than ", firstWhere, " (run ", state.run, " vs ",
                                   firstRun, "): snapshots of different runs cannot be combined"));
    }
    out.push_back(std::move(s));
  }
  if (out.empty()) throw UsageError(strCat("no post-hoc EMA snapshots in ", root, " (is ema.posthoc.stds set?)"));
  return out;
}

void checkPosthocSigma(double sigmaRel) {
  if (!validPowerEmaStd(sigmaRel)) {
    throw UsageError(strCat("--posthoc-ema ", sigmaRel, ": sigma_rel must be in [", kMinPowerEmaStd, ", ",
                            kMaxPowerEmaStd, ")"));
  }
}

namespace {

// The sigma_rel checked, and the snapshots at or before the step to reconstruct at.
PosthocResult selectSnapshots(const std::string& dir, const PosthocOptions& options) {
  checkPosthocSigma(options.sigmaRel);
  const std::vector<PosthocSnapshot> all = listPosthocSnapshots(dir);
  PosthocResult result;
  result.step = options.atStep.value_or(all.back().step);
  if (result.step > all.back().step) {
    throw UsageError(strCat("--at-step ", result.step, ": past the last post-hoc snapshot (step ", all.back().step,
                            ") of ", dir, ": nothing saved covers the steps after it"));
  }
  for (const auto& s : all) {
    if (s.step <= result.step) result.used.push_back(s);
  }
  if (result.used.empty()) {
    throw UsageError(strCat("--at-step ", result.step, ": the first post-hoc snapshot is at step ", all.front().step));
  }
  return result;
}

// One stored profile of one snapshot.
struct StoredProfile {
  size_t snapshot;     // index into PosthocResult::used and PosthocSources::readers
  std::string prefix;  // "ema/<profile>/"
};

// What a reconstruction reads: one stored profile per (snapshot, profile), readers kept
// open for the streaming, and for each tensor its source in every stored profile.
struct PosthocSources {
  std::vector<std::unique_ptr<checkpoint::CheckpointReader>> readers;  // per snapshot
  std::vector<StoredProfile> stored;
  std::vector<PowerProfile> profiles;                // per stored profile
  std::vector<const checkpoint::TensorInfo*> names;  // the newest stored profile's tensors
  std::vector<checkpoint::SafetensorsEntry> entries; // their module names, dtypes, shapes: the output's
  std::vector<std::vector<const checkpoint::TensorInfo*>> sources;  // [tensor][stored]
};

// Opens every used snapshot and lists its stored profiles, oldest snapshot first.
PosthocSources openStoredProfiles(const std::vector<PosthocSnapshot>& used) {
  PosthocSources src;
  for (size_t i = 0; i < used.size(); ++i) {
    src.readers.push_back(std::make_unique<checkpoint::CheckpointReader>(used[i].dir));
    for (const auto& [name, sigma] : used[i].profiles) {
      src.stored.push_back({i, dtensor::statePrefix(dtensor::kEmaKey) + name + "/"});
      src.profiles.push_back({used[i].step, powerEmaExponent(sigma)});
    }
  }
  return src;
}

// The tensors: those of the newest stored profile (the newest snapshot's last), by module
// name; every stored profile must hold each with the same dtype and shape.
void findTensors(const std::vector<PosthocSnapshot>& used, PosthocSources& src) {
  const StoredProfile& newest = src.stored.back();
  const checkpoint::CheckpointMetadata& md = src.readers[newest.snapshot]->metadata();
  for (const auto& t : md.tensors) {
    if (t.name.compare(0, newest.prefix.size(), newest.prefix) != 0) continue;
    src.names.push_back(&t);
    src.entries.push_back({t.name.substr(newest.prefix.size()), t.dtype, t.shape});
  }
  if (src.entries.empty()) {
    throw CheckpointError(strCat(used[newest.snapshot].dir, ": no tensors under '", newest.prefix, "'"));
  }
  src.sources.resize(src.names.size());
  for (size_t k = 0; k < src.names.size(); ++k) {
    const checkpoint::TensorInfo& want = *src.names[k];
    for (const auto& s : src.stored) {
      const checkpoint::TensorInfo& t = src.readers[s.snapshot]->tensor(s.prefix + src.entries[k].name);
      if (t.dtype != want.dtype || t.shape != want.shape) {
        throw CheckpointError(strCat(used[s.snapshot].dir, ": tensor '", t.name, "' is ",
                                     checkpoint::dtypeName(t.dtype), " ", at::IntArrayRef(t.shape), ", but '",
                                     want.name, "' in ", used[newest.snapshot].dir, " is ",
                                     checkpoint::dtypeName(want.dtype), " ", at::IntArrayRef(want.shape)));
      }
      src.sources[k].push_back(&t);
    }
  }
}

// One block buffer, one double accumulator and one output buffer for the whole run,
// grown to the largest block: memory does not depend on the model or snapshot count.
struct BlockBuffers {
  at::Tensor blockBytes, sumBuffer, outBytes;

  // The first `numel` elements of `buffer` as `dtype`, growing it if it is smaller.
  static at::Tensor take(at::Tensor& buffer, int64_t numel, at::ScalarType dtype) {
    const int64_t bytes = numel * static_cast<int64_t>(at::elementSize(dtype));
    if (!buffer.defined() || buffer.numel() < bytes) buffer = at::empty({bytes}, at::kByte);
    return buffer.narrow(0, 0, bytes).view(dtype);
  }
};

// Writes tensor k one block of rows at a time: a floating one as the weighted sum of its
// stored profiles (in double, saved in its dtype), an integer one from the newest.
void writeCombinedTensor(PosthocSources& src, size_t k, const std::vector<double>& weights, bool verify,
                         BlockBuffers& buffers, checkpoint::SafetensorsWriter& writer) {
  const checkpoint::TensorInfo& t = *src.names[k];
  const size_t newest = src.stored.back().snapshot;
  const int64_t rows = t.rows(), rowElems = t.rowElements();
  const int64_t blockRows = std::max<int64_t>(1, kBlockBytes / std::max<int64_t>(1, t.rowBytes()));
  const bool floating = at::isFloatingType(t.dtype);
  for (int64_t rb = 0; rb < rows && rowElems > 0; rb += blockRows) {
    const int64_t re = std::min(rows, rb + blockRows);
    const int64_t numel = (re - rb) * rowElems;
    at::Tensor block = BlockBuffers::take(buffers.blockBytes, numel, t.dtype);
    if (!floating) {
      // Integer buffers (e.g. num_batches_tracked) are copied, not averaged: the newest.
      src.readers[newest]->readRows(*src.sources[k].back(), rb, re, block.data_ptr(), verify);
      writer.write(block.data_ptr(), block.numel() * static_cast<int64_t>(block.element_size()));
      continue;
    }
    at::Tensor sum = BlockBuffers::take(buffers.sumBuffer, numel, at::kDouble).zero_();
    for (size_t i = 0; i < src.stored.size(); ++i) {
      src.readers[src.stored[i].snapshot]->readRows(*src.sources[k][i], rb, re, block.data_ptr(), verify);
      sum.add_(block, weights[i]);  // promoted to double in place
    }
    at::Tensor out = BlockBuffers::take(buffers.outBytes, numel, t.dtype);
    out.copy_(sum);
    // A NaN export must not look like a result: non-finite snapshots, or weights the
    // tensor's values overflow with (in its dtype).
    TESSERA_CHECK(out.isfinite().all().item<bool>(), "post-hoc EMA: tensor '", t.name, "' rows [", rb, ", ", re,
                  ") are not finite after combining ", src.stored.size(), " stored profiles (a snapshot holding NaN or "
                  "Inf, or values the weights overflow in ", checkpoint::dtypeName(t.dtype), ")");
    writer.write(out.data_ptr(), out.numel() * static_cast<int64_t>(out.element_size()));
  }
}

}  // namespace

PosthocResult reconstructPosthocEma(const std::string& dir, const std::string& outPath, const PosthocOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  PosthocResult result = selectSnapshots(dir, options);
  PosthocSources src = openStoredProfiles(result.used);
  try {
    result.weights = posthocEmaWeights(src.profiles, {result.step, powerEmaExponent(options.sigmaRel)});
  } catch (const Error& e) {  // what was asked for cannot be made from what was saved
    throw UsageError(strCat("--posthoc-ema ", options.sigmaRel, " at step ", result.step, ": ", e.what()));
  }
  findTensors(result.used, src);

  std::map<std::string, std::string> metadata{
      {"tessera_posthoc_sigma_rel", strCat(options.sigmaRel)},
      {"tessera_posthoc_step", strCat(result.step)},
      {"tessera_posthoc_snapshots", strCat(result.used.size())}};
  metadata.insert(options.metadata.begin(), options.metadata.end());
  checkpoint::SafetensorsWriter writer(outPath, src.entries, metadata);
  BlockBuffers buffers;
  for (size_t k = 0; k < src.names.size(); ++k) {
    writeCombinedTensor(src, k, result.weights, options.verify, buffers, writer);
    const checkpoint::TensorInfo& t = *src.names[k];
    result.bytes += t.numel() * static_cast<int64_t>(at::elementSize(t.dtype));
    ++result.tensors;
  }
  writer.finish();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace tessera::ema
