// WebDataset shards (issue 47): can one loader thread per rank keep a DiT step fed, and
// what does a 1,000,000-sample shard set cost in memory and at resume?
//   throughput: Fashion-MNIST's train split (Debian's dataset-fashion-mnist, which
//     scripts/setup.sh installs) written as shards by writeImageShards, then one rank's batch of a
//     step (global batch G over W ranks: G/W rows) read and decoded on one thread, against
//     the same rows from an image folder of PNG files (data.kind image_folder: the map-style
//     reader of encoded images) and against the step's need: a configs/fashion_dit.yaml DiT
//     forward + backward on those rows, on one thread, as each of W ranks computes.
//   scale: --samples tiny 8x8 samples written as shards of 10,000 (2 KiB each on disk:
//     tar's two 512-byte headers and blocks), then resident memory before and after opening
//     them and reading batches across the epoch, the time to rebuild the stream state for a
//     resume at the epoch's last position, and the map-style sampler's permutation of the
//     same count (what the map-style order holds in memory) as the baseline.
// Usage: bench_webdataset_bench [--global-batch 128] [--samples 1000000] [--reps 5]
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/app_main.h"
#include "common/errors.h"
#include "datasets/data_options.h"
#include "datasets/image_dataset.h"
#include "datasets/shard_manifest.h"
#include "datasets/shard_writer.h"
#include "datasets/tar_file.h"
#include "datasets/text_dataset.h"
#include "datasets/webdataset.h"
#include "imaging/image_io.h"
#include "models/dit.h"
#include "models/models.h"

namespace fs = std::filesystem;
using namespace tessera::datasets;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// This process's resident and peak resident memory, MiB (/proc/self/status).
std::pair<double, double> residentMiB() {
  std::ifstream status("/proc/self/status");
  std::string line;
  double rss = 0, hwm = 0;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) rss = std::stod(line.substr(6)) / 1024.0;
    if (line.rfind("VmHWM:", 0) == 0) hwm = std::stod(line.substr(6)) / 1024.0;
  }
  return {rss, hwm};
}

// Fashion-MNIST's train split: its IDX images and labels.
std::pair<std::string, std::string> fashionImages() {
  const std::string fashion = "/usr/share/datasets/fashion-mnist/";
  if (!fs::exists(fashion + "train-images-idx3-ubyte.gz")) {
    throw tessera::Error("no " + fashion + ": install dataset-fashion-mnist (apt) for the throughput part");
  }
  return {fashion + "train-images-idx3-ubyte.gz", fashion + "train-labels-idx1-ubyte.gz"};
}

// Seconds per call of `f`, the best of `reps`.
template <typename F>
double bestOf(int reps, F f) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now();
    f();
    best = std::min(best, now() - t0);
  }
  return best;
}

void throughput(const fs::path& dir, int64_t globalBatch, int reps) {
  const auto [images, labels] = fashionImages();
  DataOptions idx;
  idx.kind = "idx";
  idx.path = images;
  idx.labels = labels;
  const double w0 = now();
  writeImageShards(idx, (dir / "shards").string(), 5000);
  const double writeSeconds = now() - w0;
  DataOptions web;
  web.kind = "webdataset";
  web.path = (dir / "shards/train").string();
  const auto shards = makeDataset(web, {}, 1);
  // The same images as PNG files in class folders (data.kind image_folder).
  const at::Tensor pixels = readIdxImages(images), classes = readIdxLabels(labels);
  const int64_t folderImages = 8192;
  for (int64_t i = 0; i < folderImages; ++i) {
    const fs::path cls = dir / "folder" / ("c" + std::to_string(classes[i].item<int64_t>()));
    fs::create_directories(cls);
    tessera::imaging::writePng((cls / (std::to_string(i) + ".png")).string(), pixels[i]);
  }
  DataOptions folder;
  folder.kind = "image_folder";
  folder.path = (dir / "folder").string();
  folder.eval_fraction = 0;
  const auto files = makeDataset(folder, {});
  const DistributedSampler streamSampler(shards->trainSamples(), globalBatch, 1, SampleOrder::kStream);
  const DistributedSampler fileSampler(files->trainSamples(), globalBatch, 1, SampleOrder::kShuffled);

  tessera::models::ModelOptions model;  // configs/fashion_dit.yaml's
  model.arch = "dit";
  model.embed_dim = 128;
  model.layers = 6;
  model.heads = 4;
  model.patch_size = 4;
  model.mlp_ratio = 4.0;
  model.timesteps = 1000;
  const auto dit = std::make_shared<tessera::models::DiT>(model, shards->spec().inputShape, shards->spec().classes);
  tessera::models::initializeModel(*dit, 1);

  std::printf("Fashion-MNIST: %lld train images 28x28 written as %lld-sample shards in %.1f s; one thread each; "
              "global batch %lld; best of %d\n",
              static_cast<long long>(shards->trainSamples()), 5000LL,
              writeSeconds, static_cast<long long>(globalBatch), reps);
  std::printf("%6s %6s %14s %14s %14s %12s\n", "ranks", "rows", "shards img/s", "folder img/s", "step need img/s",
              "shards/need");
  for (int ranks : {1, 2, 8}) {
    const int64_t rows = globalBatch / ranks;
    int64_t step = 7;
    const double webSeconds = bestOf(reps, [&] { shards->trainBatch(streamSampler.indicesFor(step++, 0, ranks)); });
    const double fileSeconds = bestOf(reps, [&] { files->trainBatch(fileSampler.indicesFor(step++, 0, ranks)); });
    const Batch batch = shards->trainBatch(streamSampler.indicesFor(3, 0, ranks));
    Batch seeded = batch;
    seedNoise(seeded, 1, 3, streamSampler.indicesFor(3, 0, ranks));
    const double stepSeconds = bestOf(reps, [&] {
      dit->zero_grad();
      dit->losses(seeded).mean().backward();
    });
    std::printf("%6d %6lld %14.0f %14.0f %14.0f %11.1fx\n", ranks, static_cast<long long>(rows), rows / webSeconds,
                rows / fileSeconds, rows / stepSeconds, stepSeconds / webSeconds);
  }
}

void scale(const fs::path& dir, int64_t samples, int64_t globalBatch) {
  const fs::path shardDir = dir / "million";
  const auto [rss0, hwm0] = residentMiB();
  const double w0 = now();
  {
    ShardWriter writer(shardDir.string(), "s", 10000);
    std::string png;
    for (int64_t i = 0; i < samples; ++i) {
      if (i % 1000 == 0) png = tessera::imaging::encodePng(at::full({1, 8, 8}, i / 1000 % 256, at::kByte));
      writer.add(png, "png", i % 10);
    }
    writer.finish();
  }
  const double writeSeconds = now() - w0;
  int64_t bytes = 0;
  for (const auto& e : fs::directory_iterator(shardDir)) bytes += static_cast<int64_t>(fs::file_size(e.path()));
  const auto [rssWritten, hwmWritten] = residentMiB();
  DataOptions web;
  web.kind = "webdataset";
  web.path = shardDir.string();
  const double o0 = now();
  const auto data = makeDataset(web, {}, 1);
  const double openSeconds = now() - o0;
  const DistributedSampler sampler(data->trainSamples(), globalBatch, 1, SampleOrder::kStream);
  const int64_t stepsPerEpoch = data->trainSamples() / globalBatch;
  double readSeconds = 0;
  for (int64_t s = 0; s < 200; ++s) {
    const double t0 = now();
    data->trainBatch(sampler.indicesFor(s * (stepsPerEpoch / 200), 0, 1));
    readSeconds += now() - t0;
  }
  const auto [rssRead, hwmRead] = residentMiB();
  // A resume at the epoch's last step: a fresh order replays the whole epoch's draws.
  const double r0 = now();
  StreamOrder order(std::vector<int64_t>(static_cast<size_t>(samples / 10000), 10000), 1000, 1, true);
  order.at(samples - 1);
  const double replaySeconds = now() - r0;
  const double p0 = now();
  const DistributedSampler mapStyle(samples, globalBatch, 1, SampleOrder::kShuffled);
  mapStyle.indicesFor(0, 0, 1);  // builds the epoch's permutation
  const double permSeconds = now() - p0;
  const auto [rssPerm, hwmPerm] = residentMiB();
  std::printf("\n%lld samples in %lld shards of 10000 (%.2f GB on disk), written in %.1f s\n",
              static_cast<long long>(samples), static_cast<long long>(samples / 10000), bytes / 1e9, writeSeconds);
  std::printf("resident memory (MiB): %.1f before; %.1f after writing; %.1f after opening and reading 200 batches of "
              "%lld spread over the epoch (peak %.1f)\n",
              rss0, rssWritten, rssRead, static_cast<long long>(globalBatch), hwmRead);
  std::printf("open (manifest, no scan) %.3f s; a batch %.2f ms on average; stream state for a resume at the "
              "epoch's last position rebuilt in %.3f s\n",
              openSeconds, 1e3 * readSeconds / 200, replaySeconds);
  std::printf("baseline, the map-style sampler's permutation of %lld samples: %.1f MiB (%.3f s to build); "
              "resident after it %.1f MiB\n",
              static_cast<long long>(samples), samples * 8 / 1048576.0, permSeconds, rssPerm);
  (void)hwm0;
  (void)hwmWritten;
  (void)hwmPerm;
}

}  // namespace

int main(int argc, char** argv) {
  return tessera::runMain("bench_webdataset_bench", [&]() -> int {
    CLI::App app{"WebDataset shards: loader throughput against the step, memory at 1M samples"};
    int64_t globalBatch = 128, samples = 1000000;
    int reps = 5;
    app.add_option("--global-batch", globalBatch, "Samples per step over all ranks");
    app.add_option("--samples", samples, "Samples in the generated shard set (a multiple of 10000; 0: skip)");
    app.add_option("--reps", reps, "Repetitions; the best is kept");
    CLI11_PARSE(app, argc, argv);
    const fs::path dir = fs::temp_directory_path() / ("tessera_webdataset_bench_" + std::to_string(::getpid()));
    try {
      throughput(dir, globalBatch, reps);
      if (samples > 0) scale(dir, samples, globalBatch);
    } catch (...) {
      fs::remove_all(dir);
      throw;
    }
    fs::remove_all(dir);
    return 0;
  });
}
