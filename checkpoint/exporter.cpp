// Offline and online safetensors export (see exporter.h).
#include "checkpoint/exporter.h"

#include <cctype>
#include <memory>
#include <set>
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "checkpoint/format.h"
#include "checkpoint/json_internal.h"
#include "checkpoint/reader.h"
#include "checkpoint/safetensors.h"
#include "common/errors.h"
#include "common/logging.h"
#include "distributed/communicator.h"
#include "sharding/mixed_precision.h"

namespace tessera::checkpoint {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// One tensor to export: its name in the file, saved dtype, written dtype, shape.
struct Item {
  std::string fileName;
  std::string sourceName;
  at::ScalarType from = at::kFloat;
  at::ScalarType to = at::kFloat;
  std::vector<int64_t> shape;
  int64_t bytes() const {
    int64_t n = dtypeBytes(to);
    for (int64_t d : shape) n *= d;
    return n;
  }
};

at::ScalarType targetDtype(at::ScalarType from, const std::optional<at::ScalarType>& cast) {
  return cast && at::isFloatingType(from) ? *cast : from;
}

// Groups items into files and names them.
struct Plan {
  std::vector<std::vector<size_t>> shards;  // item indices per file
  std::vector<std::string> paths;
  std::string indexPath;
};

Plan planFiles(const std::vector<Item>& items, const std::string& out, const ExportOptions& options) {
  Plan p;
  if (options.maxShardBytes <= 0) {
    p.shards.emplace_back();
    for (size_t i = 0; i < items.size(); ++i) p.shards.back().push_back(i);
    p.paths.push_back(out);
    return p;
  }
  int64_t current = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (p.shards.empty() || (current > 0 && current + items[i].bytes() > options.maxShardBytes)) {
      p.shards.emplace_back();
      current = 0;
    }
    p.shards.back().push_back(i);
    current += items[i].bytes();
  }
  if (p.shards.empty()) p.shards.emplace_back();
  const size_t k = p.shards.size();
  for (size_t s = 0; s < k; ++s) {
    char name[64];
    std::snprintf(name, sizeof(name), "-%05zu-of-%05zu.safetensors", s + 1, k);
    p.paths.push_back((fs::path(out) / (k == 1 ? options.shardBaseName + ".safetensors" : options.shardBaseName + name)).string());
  }
  if (k > 1) p.indexPath = (fs::path(out) / (options.shardBaseName + ".safetensors.index.json")).string();
  return p;
}

void makeParent(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  if (!parent.empty()) fs::create_directories(parent);
}

void writeIndex(const Plan& plan, const std::vector<Item>& items, ExportResult& result) {
  if (plan.indexPath.empty()) return;
  detail::Json map = detail::Json::object();
  for (size_t s = 0; s < plan.shards.size(); ++s) {
    for (size_t i : plan.shards[s]) map[items[i].fileName] = fs::path(plan.paths[s]).filename().string();
  }
  detail::Json j{{"metadata", {{"total_size", result.totalBytes}}}, {"weight_map", map}};
  writeFileAtomic(plan.indexPath, j.dump(2) + "\n");
  result.indexFile = plan.indexPath;
}

std::vector<SafetensorsEntry> entriesOf(const std::vector<Item>& items, const std::vector<size_t>& which) {
  std::vector<SafetensorsEntry> out;
  for (size_t i : which) {
    SafetensorsEntry e;
    e.name = items[i].fileName;
    e.dtype = items[i].to;
    e.shape = items[i].shape;
    out.push_back(std::move(e));
  }
  return out;
}

// Writes `bytes` of dtype `from` as dtype `to`.
void writeCast(SafetensorsWriter& w, const void* data, int64_t bytes, at::ScalarType from, at::ScalarType to) {
  if (from == to) {
    w.write(data, bytes);
    return;
  }
  const int64_t n = bytes / dtypeBytes(from);
  at::Tensor src = at::from_blob(const_cast<void*>(data), {n}, at::TensorOptions().dtype(from));
  w.writeTensor(src.to(to));
}

std::map<std::string, std::string> fileMetadata(const ExportOptions& options, const std::string& prefix) {
  std::map<std::string, std::string> md = options.metadata;
  md["format"] = "pt";
  if (!md.count("tessera_prefix")) md["tessera_prefix"] = prefix;
  return md;
}

}  // namespace

std::string exportPrefix(const std::string& what, const std::map<std::string, std::string>& exportNames) {
  if (what.empty()) throw UsageError("export: say what to export (an export name, a component's key or a prefix)");
  if (what.back() == '/') return what;
  auto named = exportNames.find(what);
  if (named != exportNames.end()) return named->second;
  return what + "/";
}

std::string resolveExportPrefix(const CheckpointMetadata& md, const std::string& what) {
  return resolveExportPrefix(md, what, md.exportNames());
}

std::string resolveExportPrefix(const CheckpointMetadata& md, const std::string& what,
                                const std::map<std::string, std::string>& exportNames) {
  const std::string prefix = exportPrefix(what, exportNames);
  if (md.holdsPrefix(prefix)) return prefix;
  // List what would have worked: the export names and the keys of components that are
  // not split into parts (a part has an export name), or (a checkpoint that records
  // neither) the first components of the tensor names.
  std::set<std::string> options;
  for (const auto& [name, p] : exportNames) {
    if (md.holdsPrefix(p)) options.insert(name);
  }
  for (const auto& c : md.components) {
    if (c.parts.empty() && md.holdsPrefix(c.prefix())) options.insert(c.key);
  }
  if (options.empty()) {
    for (const auto& t : md.tensors) {
      const auto slash = t.name.find('/');
      if (slash != std::string::npos) options.insert(t.name.substr(0, slash));
    }
  }
  std::string list;
  for (const auto& o : options) list += (list.empty() ? "" : ", ") + o;
  throw CheckpointError(strCat("export: no tensor named '", prefix, "...' in the checkpoint (for '", what,
                               "'); available: ", list.empty() ? "none" : list));
}

ExportResult exportCheckpoint(const std::string& checkpointDir, const std::string& out, const ExportOptions& options) {
  const auto start = Clock::now();
  CheckpointReader reader(checkpointDir);
  const auto& md = reader.metadata();
  ExportResult result;
  result.prefix = resolveExportPrefix(md, options.what);
  std::vector<Item> items;
  for (const auto& t : md.tensors) {
    if (t.name.compare(0, result.prefix.size(), result.prefix) != 0) continue;
    Item it;
    it.fileName = t.name.substr(result.prefix.size());
    if (it.fileName.empty()) {
      throw CheckpointError(strCat("export: tensor '", t.name, "' has an empty name after stripping '", result.prefix, "'"));
    }
    it.sourceName = t.name;
    it.from = t.dtype;
    it.to = targetDtype(t.dtype, options.dtype);
    it.shape = t.shape;
    items.push_back(std::move(it));
  }
  const Plan plan = planFiles(items, out, options);
  auto metadata = fileMetadata(options, result.prefix);
  metadata["tessera_step"] = std::to_string(md.step);
  for (size_t s = 0; s < plan.shards.size(); ++s) {
    makeParent(plan.paths[s]);
    SafetensorsWriter writer(plan.paths[s], entriesOf(items, plan.shards[s]), metadata);
    for (size_t i : plan.shards[s]) {
      const Item& it = items[i];
      reader.streamTensor(
          reader.tensor(it.sourceName),
          [&](const void* data, int64_t bytes) { writeCast(writer, data, bytes, it.from, it.to); }, options.verify);
      result.totalBytes += it.bytes();
      result.largestTensorBytes = std::max(result.largestTensorBytes, it.bytes());
      ++result.tensors;
    }
    writer.finish();
    result.files.push_back(plan.paths[s]);
  }
  writeIndex(plan, items, result);
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

namespace {

// The entries under `prefix`, as the items of the files (names stripped of the prefix).
struct Selection {
  std::vector<Item> items;
  std::vector<const StateEntry*> sources;  // the entry of each item
};

Selection selectEntries(const std::vector<StateEntry>& entries, const std::string& prefix,
                        const std::map<std::string, std::string>& exportNames, const ExportOptions& options) {
  Selection out;
  for (const auto& e : entries) {
    if (e.name.compare(0, prefix.size(), prefix) != 0) continue;
    checkEntry(e, "exportOnline");
    Item it;
    it.fileName = e.name.substr(prefix.size());
    TESSERA_CHECK(!it.fileName.empty(), "exportOnline: entry '", e.name, "' is empty after stripping '", prefix, "'");
    it.sourceName = e.name;
    it.from = e.spec.dtype();
    it.to = targetDtype(it.from, options.dtype);
    it.shape = e.spec.globalShape();
    out.items.push_back(std::move(it));
    out.sources.push_back(&e);
  }
  if (out.items.empty()) {
    std::string known;
    for (const auto& [name, p] : exportNames) known += (known.empty() ? "" : ", ") + name;
    throw Error(strCat("exportOnline: nothing to export as '", options.what, "' (no tensor under '", prefix,
                       "'); it can export: ", known.empty() ? "nothing" : known, ", or a prefix ending in '/'"));
  }
  return out;
}

// Entry `e` whole on rank 0 (undefined elsewhere): gathered to it when sharded.
// Collective over `comm` for a sharded entry.
at::Tensor fullOnRankZero(const StateEntry& e, const Item& it, distributed::Communicator* comm, int rank, int world) {
  if (e.spec.placement() == dtensor::Placement::kReplicate) {
    return rank == 0 ? e.local.cpu().contiguous().view(it.shape) : at::Tensor();
  }
  at::Tensor local = e.local.cpu().contiguous().view({-1});
  at::Tensor gathered;
  if (rank == 0) gathered = at::empty({local.numel() * world}, local.options());
  if (comm && world > 1) {
    comm->gatherToRoot(gathered, local, 0);
  } else {
    gathered = local;
  }
  return rank == 0 ? gathered.narrow(0, 0, e.spec.globalNumel()).view(it.shape) : at::Tensor();
}

// Runs `fn` on rank 0, keeping the first error in `error` (the other ranks are in the
// same collectives: rank 0 carries on gathering and the error is raised at the end).
template <typename Fn>
void onRankZero(int rank, std::string& error, Fn fn) {
  if (rank != 0) return;
  try {
    fn();
  } catch (const std::exception& e) {
    if (error.empty()) error = e.what();
  }
}

// Rank 0's error (or none), raised on every rank.
void raiseEverywhere(const std::string& error, distributed::Communicator* comm, int rank, int world) {
  if (comm && world > 1) {
    at::Tensor flag = at::tensor({error.empty() ? int64_t{0} : int64_t{1}}, at::kLong);
    comm->broadcast(flag, 0);
    if (rank != 0 && flag.item<int64_t>() != 0) throw Error("exportOnline: rank 0 failed to write the export (see its log)");
  }
  if (!error.empty()) throw Error(strCat("exportOnline: ", error));
}

}  // namespace

ExportResult exportOnline(const std::vector<StateEntry>& entries, const std::map<std::string, std::string>& exportNames,
                          distributed::Communicator* comm, const std::string& out, const ExportOptions& options) {
  const auto start = Clock::now();
  const int rank = comm ? comm->rank() : 0;
  const int world = comm ? comm->worldSize() : 1;
  const std::string prefix = exportPrefix(options.what, exportNames);
  ExportResult result;
  result.prefix = prefix;
  const Selection selected = selectEntries(entries, prefix, exportNames, options);
  const std::vector<Item>& items = selected.items;
  const Plan plan = planFiles(items, out, options);
  std::string error;
  for (size_t s = 0; s < plan.shards.size(); ++s) {
    std::unique_ptr<SafetensorsWriter> writer;
    onRankZero(rank, error, [&] {
      makeParent(plan.paths[s]);
      writer = std::make_unique<SafetensorsWriter>(plan.paths[s], entriesOf(items, plan.shards[s]),
                                                   fileMetadata(options, prefix));
    });
    for (size_t i : plan.shards[s]) {
      const at::Tensor full = fullOnRankZero(*selected.sources[i], items[i], comm, rank, world);
      if (writer && error.empty()) onRankZero(rank, error, [&] { writer->writeTensor(full.to(items[i].to).contiguous()); });
      result.totalBytes += items[i].bytes();
      result.largestTensorBytes = std::max(result.largestTensorBytes, items[i].bytes());
      ++result.tensors;
    }
    if (writer && error.empty()) {
      onRankZero(rank, error, [&] {
        writer->finish();
        result.files.push_back(plan.paths[s]);
      });
    }
  }
  if (error.empty()) onRankZero(rank, error, [&] { writeIndex(plan, items, result); });
  raiseEverywhere(error, comm, rank, world);
  if (rank != 0) {
    result.files = plan.paths;
    result.indexFile = plan.indexPath;
  }
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  TLOG_INFO0("export: wrote " << result.tensors << " tensors (" << result.totalBytes << " bytes) under '" << prefix
                              << "' to " << out << " in " << result.seconds << " s");
  return result;
}

int64_t parseByteSize(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  std::string number = text.substr(0, i), unit = text.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.erase(unit.begin());
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double value = 0;
  try {
    size_t used = 0;
    value = std::stod(number, &used);
    if (used != number.size()) throw std::invalid_argument("trailing");
  } catch (const std::exception&) {
    throw UsageError(strCat("size '", text, "' is not a number with an optional unit (e.g. 2GB, 500MiB)"));
  }
  double scale;
  if (unit.empty() || unit == "B") {
    scale = 1;
  } else if (unit == "KB") {
    scale = 1e3;
  } else if (unit == "MB") {
    scale = 1e6;
  } else if (unit == "GB") {
    scale = 1e9;
  } else if (unit == "TB") {
    scale = 1e12;
  } else if (unit == "KIB") {
    scale = 1024.0;
  } else if (unit == "MIB") {
    scale = 1024.0 * 1024;
  } else if (unit == "GIB") {
    scale = 1024.0 * 1024 * 1024;
  } else {
    throw UsageError(strCat("size '", text, "': unknown unit '", unit, "' (B, KB, MB, GB, TB, KiB, MiB, GiB)"));
  }
  const double bytes = value * scale;
  if (!(bytes >= 1) || bytes > 9e18) throw UsageError(strCat("size '", text, "' is out of range"));
  return static_cast<int64_t>(bytes);
}

at::ScalarType parseExportDtype(const std::string& text) {
  try {
    return sharding::parseFloatDtype(text, "--dtype");
  } catch (const ConfigError& e) {
    throw UsageError(e.what());  // a command-line argument, not a config key
  }
}

ExportResult exportOnline(const StateMap& states, distributed::Communicator* comm, const std::string& out,
                          const ExportOptions& options) {
  return exportOnline(collectEntries(states), collectExportNames(states), comm, out, options);
}

}  // namespace tessera::checkpoint
