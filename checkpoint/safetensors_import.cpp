// Strict import of safetensors sets into shards (see safetensors.h). Separate from
// safetensors.cpp so the format code builds without the distributed stack (the fuzz
// targets link only the readers).
#include <algorithm>

#include "checkpoint/format.h"
#include "checkpoint/safetensors.h"
#include "common/errors.h"
#include "distributed/communicator.h"

namespace tessera::checkpoint {

std::string MatchReport::str() const {
  std::string out;
  auto list = [&out](const char* what, const std::vector<std::string>& names) {
    if (names.empty()) return;
    out += strCat(out.empty() ? "" : "\n", what, " (", names.size(), "):");
    for (const auto& n : names) out += "\n  " + n;
  };
  list("missing", missing);
  list("unexpected", unexpected);
  list("shape mismatch", mismatched);
  return out;
}

MatchReport matchTensors(const std::map<std::string, std::vector<int64_t>>& found,
                         const std::map<std::string, std::vector<int64_t>>& expected) {
  MatchReport r;
  for (const auto& [name, shape] : expected) {
    auto it = found.find(name);
    if (it == found.end()) {
      r.missing.push_back(name);
    } else if (it->second != shape) {
      r.mismatched.push_back(strCat(name, ": file has ", at::IntArrayRef(it->second), ", expected ", at::IntArrayRef(shape)));
    }
  }
  for (const auto& [name, shape] : found) {
    if (!expected.count(name)) r.unexpected.push_back(name);
  }
  return r;
}

namespace {

void importOnThisRank(const std::string& path, const std::vector<StateEntry>& allEntries, const ImportOptions& options) {
  const SafetensorsSet set(path);
  std::map<std::string, std::vector<int64_t>> found, expected;
  for (const auto& [name, located] : set.byName()) found[name] = located.entry->shape;
  std::vector<StateEntry> entries;
  for (const auto& e : allEntries) {
    const std::string fileName = e.name.substr(std::min(e.name.size(), options.stripPrefix.size()));
    const bool optional = std::any_of(options.mayBeMissing.begin(), options.mayBeMissing.end(),
                                      [&](const std::string& p) { return fileName.compare(0, p.size(), p) == 0; });
    if (!optional || found.count(fileName)) entries.push_back(e);
  }
  std::vector<std::string> fileNames;
  for (const auto& e : entries) {
    checkEntry(e, "importSafetensors");
    TESSERA_CHECK(e.name.compare(0, options.stripPrefix.size(), options.stripPrefix) == 0, "importSafetensors: entry '",
                  e.name, "' does not start with the prefix '", options.stripPrefix, "'");
    fileNames.push_back(e.name.substr(options.stripPrefix.size()));
    expected[fileNames.back()] = e.spec.globalShape();
  }
  const MatchReport report = matchTensors(found, expected);
  if (!report.ok(options.strict)) {
    throw CheckpointError(strCat("importSafetensors: ", path, " does not match the model:\n", report.str()));
  }
  std::vector<std::string> dtypeErrors;
  for (size_t i = 0; i < entries.size(); ++i) {
    const SafetensorsEntry& se = *set.byName().at(fileNames[i]).entry;
    if (at::isFloatingType(entries[i].spec.dtype()) && !at::isFloatingType(se.dtype)) {
      // Integer or bool data is no weight: converting it would produce plausible garbage.
      dtypeErrors.push_back(strCat(fileNames[i], ": file has ", dtypeName(se.dtype), ", a floating-point tensor is needed"));
    } else if (se.dtype != entries[i].spec.dtype() && !options.allowCast) {
      dtypeErrors.push_back(strCat(fileNames[i], ": file has ", dtypeName(se.dtype), ", expected ",
                                   dtypeName(entries[i].spec.dtype())));
    }
  }
  if (!dtypeErrors.empty()) {
    std::string msg;
    for (const auto& d : dtypeErrors) msg += "\n  " + d;
    throw CheckpointError(strCat("importSafetensors: ", path, ": dtype mismatch (", dtypeErrors.size(), "):", msg));
  }
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    const auto& [reader, se] = set.byName().at(fileNames[i]);
    const bool replicated = e.spec.placement() == dtensor::Placement::kReplicate;
    auto [rb, re] = e.spec.localRowRange();
    const int64_t bufferRows = replicated ? e.spec.globalRows() : e.spec.chunkRows();
    at::Tensor rows = at::empty({re - rb, e.spec.rowNumel()}, at::TensorOptions().dtype(se->dtype));
    reader->readRows(*se, rb, re, rows.data_ptr());
    if (rows.is_floating_point() && !at::isfinite(rows).all().item<bool>()) {
      throw CheckpointError(strCat("importSafetensors: ", path, ": tensor '", fileNames[i],
                                   "' holds NaN or Inf (in rows [", rb, ", ", re, "))"));
    }
    at::Tensor buf = at::zeros({bufferRows, e.spec.rowNumel()}, at::TensorOptions().dtype(e.spec.dtype()));
    if (re > rb) buf.narrow(0, 0, re - rb).copy_(rows);
    e.local.copy_(buf.view(e.local.sizes()));
  }
}

}  // namespace

void importSafetensors(const std::string& path, const std::vector<StateEntry>& entries, const ImportOptions& options) {
  distributed::runOnEveryRank(options.comm, strCat("importSafetensors: ", path), [&] { importOnThisRank(path, entries, options); });
}

}  // namespace tessera::checkpoint
