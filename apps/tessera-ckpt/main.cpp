// tessera-ckpt: inspects and verifies sharded checkpoints offline.
//   tessera-ckpt info DIR     step, world size, strategy, its components (kind, whose, export names), tensors
//   tessera-ckpt verify DIR   reads every byte and checks every checksum and file size
//   tessera-ckpt list DIR     the complete checkpoints of a run's checkpoints directory
// DIR is a step_N directory or a run's checkpoints directory (info/verify then use the
// newest complete checkpoint). Exit status: 0 ok, 1 corrupt or unreadable (the message
// names the file and tensor), 2 bad arguments.

#include <filesystem>
#include <iomanip>
#include <iostream>
#include <map>

#include "checkpoint/file_io.h"
#include "checkpoint/format.h"
#include "checkpoint/metadata.h"
#include "checkpoint/reader.h"
#include "checkpoint/state.h"
#include "common/app_main.h"
#include "common/command_line.h"
#include "common/errors.h"
#include "common/logging.h"
#include "checkpoint/formats_1_2.h"

namespace ckpt = tessera::checkpoint;

namespace {

std::string human(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  std::ostringstream s;
  s << std::fixed << std::setprecision(u == 0 ? 0 : 1) << v << " " << units[u];
  return s.str();
}

std::string resolveStepDir(const std::string& dir) {
  const std::string stepDir = ckpt::checkpointOrNewestIn(dir);
  if (stepDir.empty()) {
    // Not a UsageError: an incomplete step directory is exactly what verify must flag.
    throw ckpt::CheckpointError(tessera::strCat(dir, " is not a complete checkpoint (no metadata.json) and holds none"));
  }
  return stepDir;
}

// The components a checkpoint holds (its component table; for checkpoints older than the
// table, the trainer's layout), one line each: a component with named parts (an EMA's
// profiles) one line per part, each with its tensors and bytes, whose it is, and the
// other names it exports under.
void printComponents(const ckpt::CheckpointMetadata& md) {
  struct Count {
    int64_t tensors = 0, bytes = 0;
  };
  auto countUnder = [&md](const std::string& prefix) {
    Count n;
    for (const auto& t : md.tensors) {
      if (t.name.compare(0, prefix.size(), prefix) != 0) continue;
      ++n.tensors;
      n.bytes += t.bytes();
    }
    return n;
  };
  auto line = [&](const std::string& kind, const std::string& name, const std::string& prefix, const std::string& of,
                  const std::map<std::string, std::string>& exports) {
    const Count n = countUnder(prefix);
    std::string also;
    for (const auto& [alias, p] : exports) {
      if (p == prefix && alias != name) also += (also.empty() ? "" : ", ") + alias;
    }
    std::cout << std::left << std::setw(12) << kind << " " << name << "  " << n.tensors << " tensors, " << human(n.bytes)
              << (of.empty() ? "" : "; of " + of) << (also.empty() ? "" : "; also exported as " + also) << "\n";
  };
  for (const auto& c : tessera::checkpoint::checkpointComponents(md)) {
    if (c.parts.empty()) line(c.kind, c.key, c.prefix(), c.of, c.exports);
    for (const auto& [part, prefix] : c.parts) line(c.kind, part, prefix, c.of, c.exports);
  }
}

}  // namespace

int main(int argc, char** argv) {
  return tessera::runMain("tessera-ckpt", [&]() -> int {
    CLI::App app{"Tessera: inspect and verify sharded checkpoints"};
    app.require_subcommand(1);
    std::string dir;
    auto* info = app.add_subcommand("info", "Step, world size, strategy, tensors and sizes");
    info->add_option("DIR", dir, "Checkpoint step directory or a run's checkpoints directory")->required();
    auto* verify = app.add_subcommand("verify", "Check every checksum and file size");
    verify->add_option("DIR", dir, "Checkpoint step directory or a run's checkpoints directory")->required();
    auto* list = app.add_subcommand("list", "List the complete checkpoints of a checkpoints directory");
    list->add_option("DIR", dir, "A run's checkpoints directory")->required();
    if (const auto done = tessera::parseCommandLine(app, argc, argv)) return *done;
    tessera::log::LogOptions logOptions;
    logOptions.rank = -1;  // a single-process tool: no rank prefix
    logOptions.level = "warn";
    tessera::log::init(logOptions);

    if (list->parsed()) {
      if (!std::filesystem::is_directory(dir)) {
        throw tessera::UsageError(tessera::strCat("list: '", dir, "' is not a directory"));
      }
      const std::string latest = ckpt::readLatest(dir);
      for (const auto& c : ckpt::listCheckpoints(dir)) {
        // Listed only when its metadata.json parses as complete (its checksum included):
        // a damaged or edited one is named on stderr instead (verify reads the data too).
        try {
          ckpt::CheckpointReader reader(c.dir);
        } catch (const std::exception& e) {
          std::cerr << "tessera-ckpt: not listed: " << e.what() << "\n";
          continue;
        }
        const bool isLatest = std::filesystem::path(c.dir).filename() == latest;
        std::cout << c.dir << "  step " << c.step << (isLatest ? "  (latest)" : "") << "\n";
      }
      return 0;
    }
    const std::string stepDir = resolveStepDir(dir);
    if (info->parsed()) {
      const auto s = ckpt::summarizeCheckpoint(stepDir);
      const ckpt::CheckpointMetadata& md = s.metadata;
      std::cout << "checkpoint   " << s.dir << "\n"
                << "step         " << md.step << "\n"
                << "world size   " << md.worldSize << "\n"
                << "strategy     " << (md.strategy.empty() ? "-" : md.strategy) << "\n"
                << "tensors      " << md.tensors.size() << " (" << human(s.tensorBytes) << "; files "
                << human(s.fileBytes) << ")\n";
      printComponents(md);
      for (const auto& [name, prefix] : tessera::checkpoint::checkpointExportNames(md)) {
        std::cout << "export name  " << name << " -> " << prefix << "\n";
      }
      for (const auto& t : md.tensors) {
        std::cout << "  " << t.name << "  " << ckpt::dtypeName(t.dtype) << " " << at::IntArrayRef(t.shape) << "  "
                  << (t.placement == tessera::dtensor::Placement::kShard0 ? "shard0" : "replicate") << "  "
                  << t.chunks.size() << " chunk" << (t.chunks.size() == 1 ? "" : "s") << "  " << human(t.bytes())
                  << "\n";
      }
      return 0;
    }
    ckpt::CheckpointReader reader(stepDir);
    reader.verifyAll();
    std::cout << "OK " << stepDir << ": " << reader.metadata().tensors.size() << " tensors, "
              << human(reader.bytesRead()) << " verified\n";
    return 0;
  });
}
