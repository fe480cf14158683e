// Helpers shared by the checkpoint suites: a temporary directory, a small model's worth
// of uneven tensors, building a rank's entries from full tensors, saving on N ranks
// (threads over gloo), and running a program capturing its output and exit status.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpointer.h"
#include "checkpoint/reader.h"
#include "checkpoint/state.h"
#include "tests/support/multi_rank.h"
#include "common/filesystem.h"

namespace tessera::checkpoint::testing {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    std::string templ = (fs::temp_directory_path() / "tessera_ckpt_XXXXXX").string();
    if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    removeTree(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return (fs::path(path_) / name).string(); }

 private:
  std::string path_;
};

struct GlobalTensor {
  std::string name;
  at::Tensor full;
  bool replicated = false;
};

// Uneven shapes: rows not divisible by 2/3/4, fewer rows than ranks, 0-d, empty, ints,
// bf16, a replicated double tensor.
inline std::vector<GlobalTensor> sampleModel(int64_t seed = 0) {
  auto gen = [seed](std::vector<int64_t> shape, int64_t salt) {
    const int64_t n = c10::multiply_integers(shape);
    return (at::arange(n, at::kDouble) * 0.37 + static_cast<double>(seed * 100 + salt)).sin().to(at::kFloat).view(shape);
  };
  std::vector<GlobalTensor> m;
  m.push_back({"model/layers.0.weight", gen({10, 3}, 1)});
  m.push_back({"model/layers.0.bias", gen({2, 5}, 2)});
  m.push_back({"model/scale", gen({}, 3)});
  m.push_back({"model/empty", gen({0, 3}, 4)});
  m.push_back({"model/steps", (at::arange(7, at::kLong) * 1000003 + seed)});
  m.push_back({"model/half", gen({5, 4}, 5).to(at::kBFloat16)});
  m.push_back({"model/table", gen({3, 3}, 6).to(at::kDouble), /*replicated=*/true});
  m.push_back({"optim/exp_avg/layers.0.weight", gen({10, 3}, 7)});
  m.push_back({"optim/exp_avg_sq/layers.0.weight", gen({10, 3}, 8).abs()});
  m.push_back({"ema/generator_ema/layers.0.weight", gen({10, 3}, 9)});
  m.push_back({"ema/generator_ema/layers.0.bias", gen({2, 5}, 10)});
  m.push_back({"ema/generator_ema/scale", gen({}, 11)});
  m.push_back({"ema/generator_ema/steps", (at::arange(7, at::kLong) * 7 + seed)});
  return m;
}

inline dtensor::ShardSpec specFor(const GlobalTensor& g, int world, int rank, bool forceReplicate = false) {
  return dtensor::ShardSpec(g.full.sizes().vec(), g.full.scalar_type(), world, rank,
                             g.replicated || forceReplicate ? dtensor::Placement::kReplicate
                                                            : dtensor::Placement::kShard0);
}

// This rank's entries holding the true values.
inline std::vector<StateEntry> entriesFor(const std::vector<GlobalTensor>& model, int world, int rank) {
  std::vector<StateEntry> out;
  for (const auto& g : model) {
    auto spec = specFor(g, world, rank);
    out.push_back({g.name, spec, spec.shardOf(g.full)});
  }
  return out;
}

// Destination entries filled with junk (so a load that misses bytes, or padding left
// unzeroed, shows up).
inline std::vector<StateEntry> junkEntriesFor(const std::vector<GlobalTensor>& model, int world, int rank,
                                              bool allReplicated = false) {
  std::vector<StateEntry> out;
  for (const auto& g : model) {
    auto spec = specFor(g, world, rank, allReplicated);
    at::Tensor local = at::empty(spec.localShape(), g.full.options());
    local.fill_(g.full.is_floating_point() ? 777.0 : 777);
    out.push_back({g.name, spec, local});
  }
  return out;
}

// The component table a run would record for the layout of `model`'s names: "<key>/..."
// components ("ema/<profile>/..." a part of "ema" each, exported by the profile's name).
inline std::vector<ComponentRecord> componentsFor(const std::vector<GlobalTensor>& model) {
  std::map<std::string, ComponentRecord> byKey;
  for (const auto& g : model) {
    const auto slash = g.name.find('/');
    if (slash == std::string::npos) continue;
    ComponentRecord& c = byKey[g.name.substr(0, slash)];
    c.key = g.name.substr(0, slash);
    c.kind = c.key;
    const auto second = g.name.find('/', slash + 1);
    if (c.key == "ema" && second != std::string::npos) {
      const std::string profile = g.name.substr(slash + 1, second - slash - 1);
      c.parts[profile] = c.exports[profile] = g.name.substr(0, second + 1);
    }
  }
  std::vector<ComponentRecord> out;
  for (auto& [key, c] : byKey) out.push_back(std::move(c));
  return out;
}

// Saves `model` as `step` on `world` ranks (threads over gloo).
inline void saveOnRanks(int world, const std::string& dir, const std::vector<GlobalTensor>& model, int64_t step,
                        CheckpointOptions options = {}) {
  test::runOnRanks(world, [&](test::RankContext& ctx) {
    Checkpointer ckpt(dir, ctx.comm(), options);
    SaveRequest req;
    req.step = step;
    req.strategy = "zero3";
    req.entries = entriesFor(model, ctx.world, ctx.rank);
    req.components = componentsFor(model);
    req.trainerState = strCat("{\"step\": ", step, ", \"world_size\": ", ctx.world, "}");
    req.rankState = strCat("{\"rng\": ", 1000 + ctx.rank, "}");
    ckpt.save(req);
    ckpt.finish();
  });
}

// Single-process save (no communicator).
inline SaveStats saveSingle(const std::string& dir, const std::vector<GlobalTensor>& model, int64_t step,
                            CheckpointOptions options = {}) {
  Checkpointer ckpt(dir, nullptr, options);
  SaveRequest req;
  req.step = step;
  req.strategy = "no_shard";
  req.entries = entriesFor(model, 1, 0);
  req.components = componentsFor(model);
  req.trainerState = strCat("{\"step\": ", step, "}");
  auto stats = ckpt.save(req);
  ckpt.finish();
  return stats;
}

inline bool bitwiseEqual(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  if (a.numel() == 0) return true;
  return a.reshape({-1}).contiguous().view(at::kByte).equal(b.reshape({-1}).contiguous().view(at::kByte));
}

struct ProcessResult {
  int status = -1;  // exit status, or -1 when killed
  std::string output;
};

// Runs a shell command, capturing stdout + stderr.
inline ProcessResult runCommand(const std::string& command) {
  ProcessResult r;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) r.output.append(buf, n);
  const int status = ::pclose(pipe);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

inline std::string readText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

inline void writeText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

}  // namespace tessera::checkpoint::testing
