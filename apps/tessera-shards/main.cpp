// tessera-shards: writes image data as WebDataset tar shards with a manifest, for
// data.kind webdataset (docs/data.md).
//   tessera-shards --kind idx --path train-images-idx3-ubyte.gz --labels train-labels-idx1-ubyte.gz
//                  [--eval-path t10k-images-idx3-ubyte.gz --eval-labels t10k-labels-idx1-ubyte.gz]
//                  --out DIR [--samples-per-shard 5000]
//   tessera-shards --kind image_folder --path FOLDER [--eval-path FOLDER] --out DIR
// Writes DIR/train/train-000000.tar ... and DIR/eval/eval-000000.tar ..., each directory
// with its manifest.json. Exit status: 0 ok, 2 bad arguments, 1 failure.

#include <iostream>

#include "common/app_main.h"
#include "common/command_line.h"
#include "common/errors.h"
#include "datasets/data_options.h"
#include "datasets/shard_writer.h"

int main(int argc, char** argv) {
  return tessera::runMain("tessera-shards", [&]() -> int {
    CLI::App app{"Tessera: write image data as WebDataset tar shards (data.kind webdataset)"};
    tessera::datasets::DataOptions data;
    std::string out;
    int64_t perShard = 5000;
    app.add_option("--kind", data.kind, "What --path holds: idx (MNIST-format images) or image_folder")
        ->required()
        ->check(CLI::IsMember({"idx", "image_folder"}));
    app.add_option("--path", data.path, "The train images: an IDX images file, or a folder of class folders")
        ->required();
    app.add_option("--labels", data.labels, "idx: the labels file of --path");
    app.add_option("--eval-path", data.eval_path, "The held-out images (the test split), written to DIR/eval");
    app.add_option("--eval-labels", data.eval_labels, "idx: the labels file of --eval-path");
    app.add_option("--out", out, "Directory to write train/ and eval/ into")->required();
    app.add_option("--samples-per-shard", perShard, "Samples in each shard (the last may hold fewer)")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
    if (const auto done = tessera::parseCommandLine(app, argc, argv)) return *done;
    if (data.kind == "idx" && data.labels.empty()) throw tessera::UsageError("--kind idx needs --labels");
    if (data.kind == "idx" && !data.eval_path.empty() && data.eval_labels.empty()) {
      throw tessera::UsageError("--eval-path of --kind idx needs --eval-labels");
    }
    const auto summary = tessera::datasets::writeImageShards(data, out, perShard);
    const auto report = [](const std::string& dir, const tessera::datasets::ShardManifest& m) {
      int64_t samples = 0, bytes = 0;
      for (const auto& s : m.shards) {
        samples += s.samples;
        bytes += s.bytes;
      }
      std::cout << dir << ": " << m.shards.size() << " shards, " << samples << " samples, " << bytes << " bytes, "
                << m.classes << " classes\n";
    };
    report(summary.trainDirectory, summary.train);
    if (!summary.evalDirectory.empty()) report(summary.evalDirectory, summary.eval);
    return 0;
  });
}
