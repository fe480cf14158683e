// tessera-ckpt: inspects and verifies sharded checkpoints offline.
//   tessera-ckpt info DIR     step, world size, strategy, models and EMAs, tensors and sizes
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

namespace ckpt = tessera::checkpoint;
namespace dtensor = tessera::dtensor;

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

// The models and EMAs a checkpoint holds, from its tensor names (the trainer's layout:
// <model>/..., optim/[<model>/]..., ema/<ema>/...; the single-model form's model is
// "model" with its optimizer state directly under optim/).
void printParts(const ckpt::CheckpointSummary& s) {
  struct Part {
    int64_t tensors = 0, bytes = 0, optimizerTensors = 0;
  };
  std::map<std::string, Part> models, emas;
  auto component = [](const std::string& name, size_t index) {
    size_t begin = 0;
    for (size_t i = 0; i < index; ++i) begin = name.find('/', begin) + 1;
    return name.substr(begin, name.find('/', begin) - begin);
  };
  for (const auto& t : s.tensors) {
    const std::string head = component(t.name, 0);
    if (t.name.find('/') == std::string::npos) continue;
    if (head == dtensor::kEmaKey) {
      if (t.name.find('/', head.size() + 1) == std::string::npos) continue;  // an EMA's update count
      Part& e = emas[component(t.name, 1)];
      ++e.tensors;
      e.bytes += t.bytes();
    } else if (head != dtensor::kOptimizerKey) {
      Part& m = models[head];
      ++m.tensors;
      m.bytes += t.bytes();
    }
  }
  for (const auto& t : s.tensors) {
    if (component(t.name, 0) != dtensor::kOptimizerKey) continue;
    const std::string owner = component(t.name, 1);
    auto it = models.find(owner);
    if (it != models.end() && owner != dtensor::kModelKey) {
      ++it->second.optimizerTensors;
    } else if (models.count(dtensor::kModelKey)) {
      ++models[dtensor::kModelKey].optimizerTensors;  // the single-model form: optim/<state>/<param>
    }
  }
  for (const auto& [name, m] : models) {
    std::cout << "model        " << name << "  " << m.tensors << " tensors, " << human(m.bytes) << "; "
              << (m.optimizerTensors > 0 ? tessera::strCat("optimizer state ", m.optimizerTensors, " tensors")
                                         : std::string("frozen (no optimizer state)"))
              << "\n";
  }
  for (const auto& [name, e] : emas) {
    std::string also;
    for (const auto& [alias, prefix] : s.aliases) {
      const bool same = prefix == dtensor::statePrefix(dtensor::kEmaKey) + name + "/";
      if (same && alias != name) also += (also.empty() ? "" : ", ") + alias;
    }
    std::cout << "ema          " << name << "  " << e.tensors << " tensors, " << human(e.bytes)
              << (also.empty() ? "" : "; also exported as " + also) << "\n";
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
      std::cout << "checkpoint   " << s.dir << "\n"
                << "step         " << s.step << "\n"
                << "world size   " << s.worldSize << "\n"
                << "strategy     " << (s.strategy.empty() ? "-" : s.strategy) << "\n"
                << "tensors      " << s.tensors.size() << " (" << human(s.tensorBytes) << "; files "
                << human(s.fileBytes) << ")\n";
      printParts(s);
      for (const auto& [alias, prefix] : s.aliases) std::cout << "alias        " << alias << " -> " << prefix << "\n";
      for (const auto& t : s.tensors) {
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
