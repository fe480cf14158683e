// WebDataset shards (issue 47): can one loader thread per rank keep a DiT step fed, and
// what does a 1,000,000-sample shard set cost in memory and at resume?
//   throughput: Fashion-MNIST's train split (Debian's dataset-fashion-mnist, which
//     scripts/setup.sh installs) written as shards by writeImageShards, then one rank's batch of a
//     step (global batch G over W ranks: G/W rows) read and decoded on one thread, against
//     the same rows from an image folder of PNG files (data.kind image_folder: the map-style
//     reader of encoded images) and against the step's need: a configs/fashion_dit.yaml DiT
//     forward + backward on those rows, on one thread, as each of W ranks computes.
//   scale (first, in a clean process): --samples tiny 8x8 samples written as shards of
//     10,000 (2 KiB each on disk: tar's two 512-byte headers and blocks), then resident
//     memory before and after opening them, resuming mid-epoch (the stream state rebuilt,
//     timed) and reading 200 batches, against the map-style sampler's permutation of the
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
  {
    // Warm-up on one shard: the decoders' and LibTorch's code and first allocations are
    // resident from here on, so that the figures below are the stream's own.
    DataOptions one;
    one.kind = "webdataset";
    one.path = (shardDir / "s-000000.tar").string();
    makeDataset(one, {}, 1)->trainBatch({0, 1, 2, 3});
  }
  const auto [rss0, hwm0] = residentMiB();
  DataOptions web;
  web.kind = "webdataset";
  web.path = shardDir.string();
  const double o0 = now();
  const auto data = makeDataset(web, {}, 1);
  const double openSeconds = now() - o0;
  const DistributedSampler sampler(data->trainSamples(), globalBatch, 1, SampleOrder::kStream);
  // A resume in the middle of the epoch: the first batch rebuilds the stream state (half an
  // epoch of draws) and indexes its shards (headers, checksum); then 200 steps in a row.
  const int64_t resumeStep = data->trainSamples() / globalBatch / 2;
  const double f0 = now();
  data->trainBatch(sampler.indicesFor(resumeStep, 0, 1));
  const double firstSeconds = now() - f0;
  const double s0 = now();
  for (int64_t s = 1; s <= 200; ++s) data->trainBatch(sampler.indicesFor(resumeStep + s, 0, 1));
  const double stepsSeconds = now() - s0;
  const auto [rssRead, hwmRead] = residentMiB();
  const auto [rssBeforePerm, hwmBeforePerm] = residentMiB();
  const double p0 = now();
  const DistributedSampler mapStyle(samples, globalBatch, 1, SampleOrder::kShuffled);
  mapStyle.indicesFor(0, 0, 1);  // builds (and keeps) the epoch's permutation
  const double permSeconds = now() - p0;
  const auto [rssPerm, hwmPerm] = residentMiB();
  std::printf("%lld samples in %lld shards of 10000 (%.2f GB on disk), written in %.1f s\n",
              static_cast<long long>(samples), static_cast<long long>(samples / 10000), bytes / 1e9, writeSeconds);
  std::printf("open (manifest, no scan): %.3f s; resident memory %.1f MiB before, %.1f MiB after opening, resuming at "
              "step %lld and reading 200 batches of %lld\n",
              openSeconds, rss0, rssRead, static_cast<long long>(resumeStep), static_cast<long long>(globalBatch));
  std::printf("resume: the first batch %.3f s (the stream state rebuilt from half an epoch of draws, its shards "
              "indexed and checksummed); then %.2f ms a batch (%.0f images/s, one thread)\n",
              firstSeconds, 1e3 * stepsSeconds / 200, 200.0 * globalBatch / stepsSeconds);
  std::printf("baseline, the map-style sampler's permutation of the same %lld samples: +%.1f MiB resident (%.3f s to "
              "build)\n\n",
              static_cast<long long>(samples), rssPerm - rssBeforePerm, permSeconds);
  (void)hwm0;
  (void)hwmRead;
  (void)hwmBeforePerm;
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
      if (samples > 0) scale(dir, samples, globalBatch);  // first: its memory figures start from a clean process
      throughput(dir, globalBatch, reps);
    } catch (...) {
      fs::remove_all(dir);
      throw;
    }
    fs::remove_all(dir);
    return 0;
  });
}
