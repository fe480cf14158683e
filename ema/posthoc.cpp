// Post-hoc EMA snapshots and reconstruction (see posthoc.h).
#include "ema/posthoc.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <memory>

#include "checkpoint/reader.h"
#include "checkpoint/safetensors.h"
#include "common/errors.h"
#include "ema/ema_manager.h"
#include "ema/power_ema.h"

namespace tessera::ema {

namespace fs = std::filesystem;
using checkpoint::CheckpointError;

namespace {

constexpr const char* kProfilesKey = "posthoc_profiles";
// Rows combined at a time: about this many bytes of each snapshot's tensor.
constexpr int64_t kBlockBytes = int64_t{4} << 20;

std::string snapshotsDir(const std::string& dir) {
  const fs::path posthoc = fs::path(dir) / "posthoc";
  std::error_code ec;
  return fs::is_directory(posthoc, ec) ? posthoc.string() : dir;
}

}  // namespace

std::vector<sharding::StateEntry> posthocSnapshotEntries(ShardedModelEMAManager& manager) {
  std::vector<sharding::StateEntry> entries;
  for (size_t i = 0; i < manager.numProfiles(); ++i) {
    if (!manager.isPowerProfile(i)) continue;
    for (auto& e : manager.profileEntries(i, sharding::statePrefix(sharding::kEmaKey))) entries.push_back(std::move(e));
  }
  return entries;
}

std::string posthocSnapshotState(const ShardedModelEMAManager& manager) {
  nlohmann::json profiles = nlohmann::json::object();
  for (size_t i = 0; i < manager.numProfiles(); ++i) {
    if (manager.isPowerProfile(i)) profiles[manager.stateName(i)] = manager.powerStd(i);
  }
  return nlohmann::json{{kProfilesKey, profiles}}.dump();
}

std::vector<PosthocSnapshot> listPosthocSnapshots(const std::string& dir) {
  const std::string root = snapshotsDir(dir);
  std::vector<PosthocSnapshot> out;
  for (const auto& ref : checkpoint::listCheckpoints(root)) {
    checkpoint::CheckpointReader reader(ref.dir);
    const std::string where = (fs::path(ref.dir) / "trainer_state.json").string();
    PosthocSnapshot s;
    s.step = reader.metadata().step;
    s.dir = ref.dir;
    const nlohmann::json state = nlohmann::json::parse(reader.trainerState(), nullptr, /*allow_exceptions=*/false);
    if (!state.is_object() || !state.contains(kProfilesKey) || !state[kProfilesKey].is_object() ||
        state[kProfilesKey].empty()) {
      throw CheckpointError(strCat(where, ": not a post-hoc EMA snapshot (no '", kProfilesKey, "' object)"));
    }
    for (const auto& [name, sigma] : state[kProfilesKey].items()) {
      if (!sigma.is_number() || !(sigma.get<double>() > 0 && sigma.get<double>() < kMaxPowerEmaStd)) {
        throw CheckpointError(strCat(where, ": profile '", name, "' has sigma_rel ", sigma.dump(), ", not a number in (0, ",
                                     kMaxPowerEmaStd, ")"));
      }
      s.profiles.emplace_back(name, sigma.get<double>());
    }
    out.push_back(std::move(s));
  }
  if (out.empty()) throw UsageError(strCat("no post-hoc EMA snapshots in ", root, " (is ema.posthoc.stds set?)"));
  return out;
}

PosthocResult reconstructPosthocEma(const std::string& dir, const std::string& outPath, const PosthocOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  if (!(options.sigmaRel > 0 && options.sigmaRel < kMaxPowerEmaStd)) {
    throw UsageError(strCat("--posthoc-ema ", options.sigmaRel, ": sigma_rel must be in (0, ", kMaxPowerEmaStd, ")"));
  }
  const std::vector<PosthocSnapshot> all = listPosthocSnapshots(dir);
  PosthocResult result;
  result.step = options.atStep.value_or(all.back().step);
  for (const auto& s : all) {
    if (s.step <= result.step) result.used.push_back(s);
  }
  if (result.used.empty()) {
    throw UsageError(strCat("--at-step ", result.step, ": the first post-hoc snapshot is at step ", all.front().step));
  }

  // One stored profile per (snapshot, profile); readers kept open for the streaming.
  struct Stored {
    size_t snapshot;
    std::string prefix;  // "ema/<profile>/"
  };
  std::vector<Stored> stored;
  std::vector<PowerProfile> profiles;
  std::vector<std::unique_ptr<checkpoint::CheckpointReader>> readers;
  for (size_t i = 0; i < result.used.size(); ++i) {
    readers.push_back(std::make_unique<checkpoint::CheckpointReader>(result.used[i].dir));
    for (const auto& [name, sigma] : result.used[i].profiles) {
      stored.push_back({i, sharding::statePrefix(sharding::kEmaKey) + name + "/"});
      profiles.push_back({result.used[i].step, powerEmaExponent(sigma)});
    }
  }
  result.weights = posthocEmaWeights(profiles, {result.step, powerEmaExponent(options.sigmaRel)});

  // The tensors: those of the newest snapshot's first profile, by module name; every
  // stored profile must hold each with the same dtype and shape.
  const Stored& newest = stored.back();
  const checkpoint::CheckpointMetadata& md = readers[newest.snapshot]->metadata();
  std::vector<const checkpoint::TensorInfo*> names;
  std::vector<checkpoint::SafetensorsEntry> entries;
  for (const auto& t : md.tensors) {
    if (t.name.compare(0, newest.prefix.size(), newest.prefix) != 0) continue;
    names.push_back(&t);
    entries.push_back({t.name.substr(newest.prefix.size()), t.dtype, t.shape});
  }
  if (entries.empty()) {
    throw CheckpointError(strCat(result.used[newest.snapshot].dir, ": no tensors under '", newest.prefix, "'"));
  }
  std::vector<std::vector<const checkpoint::TensorInfo*>> sources(names.size());  // [tensor][stored]
  for (size_t k = 0; k < names.size(); ++k) {
    for (const auto& s : stored) {
      const checkpoint::TensorInfo& t = readers[s.snapshot]->tensor(s.prefix + entries[k].name);
      if (t.dtype != names[k]->dtype || t.shape != names[k]->shape) {
        throw CheckpointError(strCat(result.used[s.snapshot].dir, ": tensor '", t.name, "' is ",
                                     checkpoint::dtypeName(t.dtype), " ", at::IntArrayRef(t.shape), ", but '",
                                     names[k]->name, "' in ", result.used[newest.snapshot].dir, " is ",
                                     checkpoint::dtypeName(names[k]->dtype), " ", at::IntArrayRef(names[k]->shape)));
      }
      sources[k].push_back(&t);
    }
  }

  std::map<std::string, std::string> metadata{
      {"tessera_posthoc_sigma_rel", strCat(options.sigmaRel)},
      {"tessera_posthoc_step", strCat(result.step)},
      {"tessera_posthoc_snapshots", strCat(result.used.size())}};
  checkpoint::SafetensorsWriter writer(outPath, entries, metadata);
  // One block buffer, one double accumulator and one output buffer for the whole run,
  // grown to the largest block: memory does not depend on the model or snapshot count.
  at::Tensor blockBytes, sumBuffer, outBytes;
  auto take = [](at::Tensor& buffer, int64_t numel, at::ScalarType dtype) {
    const int64_t bytes = numel * static_cast<int64_t>(at::elementSize(dtype));
    if (!buffer.defined() || buffer.numel() < bytes) buffer = at::empty({bytes}, at::kByte);
    return buffer.narrow(0, 0, bytes).view(dtype);
  };
  for (size_t k = 0; k < names.size(); ++k) {
    const checkpoint::TensorInfo& t = *names[k];
    const int64_t rows = t.rows(), rowElems = t.rowElements();
    const int64_t blockRows = std::max<int64_t>(1, kBlockBytes / std::max<int64_t>(1, t.rowBytes()));
    const bool floating = at::isFloatingType(t.dtype);
    for (int64_t rb = 0; rb < rows && rowElems > 0; rb += blockRows) {
      const int64_t re = std::min(rows, rb + blockRows);
      const int64_t numel = (re - rb) * rowElems;
      at::Tensor block = take(blockBytes, numel, t.dtype);
      if (!floating) {
        // Integer buffers (e.g. num_batches_tracked) are copied, not averaged: the newest.
        readers[newest.snapshot]->readRows(*sources[k].back(), rb, re, block.data_ptr(), options.verify);
        writer.write(block.data_ptr(), block.numel() * static_cast<int64_t>(block.element_size()));
        continue;
      }
      at::Tensor sum = take(sumBuffer, numel, at::kDouble).zero_();
      for (size_t i = 0; i < stored.size(); ++i) {
        readers[stored[i].snapshot]->readRows(*sources[k][i], rb, re, block.data_ptr(), options.verify);
        sum.add_(block, result.weights[i]);  // promoted to double in place
      }
      at::Tensor out = take(outBytes, numel, t.dtype);
      out.copy_(sum);
      writer.write(out.data_ptr(), out.numel() * static_cast<int64_t>(out.element_size()));
    }
    result.bytes += t.numel() * static_cast<int64_t>(at::elementSize(t.dtype));
    ++result.tensors;
  }
  writer.finish();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace tessera::ema
