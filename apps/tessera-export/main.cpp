// tessera-export: writes consolidated safetensors from a sharded checkpoint, offline
// (no distributed job; any saved world size), streaming one block at a time.
//   tessera-export CKPT_DIR --what generator_ema|generator_ema_0.999|model --out FILE_OR_DIR
//                  [--dtype fp32|bf16|fp16] [--max-shard-size 2GB] [--no-verify]
// CKPT_DIR is a step_N directory, or a run's checkpoints directory (its newest complete
// checkpoint is used). Exit status: 0 ok, 2 bad arguments, 1 failure (corruption, I/O).

#include <filesystem>
#include <iostream>

#include "checkpoint/exporter.h"
#include "checkpoint/file_io.h"
#include "checkpoint/format.h"
#include "checkpoint/metadata.h"
#include "checkpoint/reader.h"
#include "common/app_main.h"
#include "common/command_line.h"
#include "common/errors.h"
#include "common/logging.h"

namespace ckpt = tessera::checkpoint;

int main(int argc, char** argv) {
  return tessera::runMain("tessera-export", [&]() -> int {
    CLI::App app{"Tessera: export consolidated safetensors from a sharded checkpoint"};
    std::string dir, out, dtype, maxShard;
    bool noVerify = false;
    ckpt::ExportOptions options;
    app.add_option("CKPT_DIR", dir, "Checkpoint step directory, or a run's checkpoints directory")->required();
    app.add_option("--what", options.what, "generator_ema | generator_ema_<decay> | model | a prefix ending in '/'")
        ->required();
    app.add_option("--out", out, "Output .safetensors file (a directory with --max-shard-size)")->required();
    app.add_option("--dtype", dtype, "Cast floating-point tensors: fp32 | bf16 | fp16");
    app.add_option("--max-shard-size", maxShard, "Split into files of at most this size, e.g. 2GB, 500MiB");
    app.add_flag("--no-verify", noVerify, "Skip checksum verification");
    if (const auto done = tessera::parseCommandLine(app, argc, argv)) return *done;
    tessera::log::LogOptions logOptions;
    logOptions.rank = -1;  // a single-process tool: no rank prefix
    logOptions.level = "warn";
    tessera::log::init(logOptions);
    if (!dtype.empty()) options.dtype = ckpt::parseExportDtype(dtype);
    if (!maxShard.empty()) options.maxShardBytes = ckpt::parseByteSize(maxShard);
    options.verify = !noVerify;

    std::string stepDir = dir;
    if (!ckpt::pathExists((std::filesystem::path(dir) / ckpt::kMetadataFile).string())) {
      const auto all = ckpt::listCheckpoints(dir);
      if (all.empty()) {
        throw tessera::UsageError(tessera::strCat(dir, " is neither a complete checkpoint (no metadata.json) nor a ",
                                                  "directory holding one"));
      }
      stepDir = all.back().dir;
      std::cerr << "tessera-export: using the newest complete checkpoint " << stepDir << "\n";
    }
    const auto result = ckpt::exportCheckpoint(stepDir, out, options);
    std::cout << "exported " << result.tensors << " tensors under '" << result.prefix << "' (" << result.totalBytes
              << " bytes) from " << stepDir << " in " << result.seconds << " s\n";
    for (const auto& f : result.files) std::cout << "  " << f << "\n";
    if (!result.indexFile.empty()) std::cout << "  " << result.indexFile << "\n";
    return 0;
  });
}
