// Data loading off the step's path (issue 32): whether a DiT step waits for its batch
// when the images are PNG files decoded on the fly (data.kind image_folder), the slowest
// input Tessera reads. Writes a folder of PNGs (Fashion-MNIST's first images when Debian's
// dataset-fashion-mnist is installed, random pixels otherwise), then over the same steps:
//   baseline: preparing each batch on the step's own thread (decode, gather, seed, flip),
//             then the step — what a loader without a thread costs per step;
//   loader:   BatchLoader, preparing step s+1 while step s computes — the time the step
//             still waits for its batch.
// The step is a DiT forward and backward (model.* as configs/dit_quick.yaml) on the batch.
// Usage: bench_data_loader_bench [--images 4096] [--batch 64] [--steps 30]
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <filesystem>

#include "common/app_main.h"
#include "imaging/image_io.h"
#include "datasets/batch_loader.h"
#include "models/dit.h"
#include "datasets/image_dataset.h"
#include "models/models.h"
#include "datasets/text_dataset.h"
#include "trainer/train_config.h"

namespace fs = std::filesystem;
using namespace tessera::trainer;
using namespace tessera::datasets;
using namespace tessera::models;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// `count` 28x28 gray PNGs in 10 class folders under `dir`.
void writeImageFolder(const fs::path& dir, int64_t count) {
  const std::string fashion = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz";
  at::Tensor images;
  at::Tensor labels;
  if (fs::exists(fashion)) {
    images = readIdxImages(fashion).slice(0, 0, count);
    labels = readIdxLabels("/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz").slice(0, 0, count);
  } else {
    images = at::randint(256, {count, 1, 28, 28}, at::kByte);
    labels = at::arange(count, at::kLong).remainder(10);
  }
  for (int64_t i = 0; i < images.size(0); ++i) {
    const fs::path classDir = dir / ("class_" + std::to_string(labels[i].item<int64_t>()));
    fs::create_directories(classDir);
    tessera::imaging::writePng((classDir / (std::to_string(i) + ".png")).string(), images[i]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  return tessera::runMain("bench_data_loader_bench", [&]() -> int {
    CLI::App app{"Does the DiT step wait for PNG decoding?"};
    int64_t images = 4096, batch = 64, steps = 30;
    app.add_option("--images", images, "PNG files to write and read");
    app.add_option("--batch", batch, "Samples per step");
    app.add_option("--steps", steps, "Steps measured per variant");
    CLI11_PARSE(app, argc, argv);

    const fs::path dir = fs::temp_directory_path() / ("tessera_loader_bench_" + std::to_string(::getpid()));
    writeImageFolder(dir, images);
    DataOptions data;
    data.kind = "image_folder";
    data.path = dir.string();
    data.eval_fraction = 0;
    data.hflip = true;
    const auto dataset = makeImageFolderDataset(data);
    const DistributedSampler sampler(dataset->trainSamples(), batch, 1, /*shuffle=*/true);

    ModelOptions model;
    model.arch = "dit";
    model.embed_dim = 64;
    model.layers = 4;
    model.heads = 4;
    model.patch_size = 4;
    const auto dit = std::make_shared<DiT>(model, dataset->spec().inputShape, dataset->spec().classes);
    initializeModel(*dit, 1);
    const auto step = [&](const Batch& b) {
      dit->zero_grad();
      dit->losses(b).mean().backward();
    };

    double prepare = 0, compute = 0;
    const double baselineStart = now();
    for (int64_t s = 0; s < steps; ++s) {
      const double t0 = now();
      Batch b = dataset->trainBatch(sampler.indicesFor(s, 0, 1));
      seedNoise(b, 1, s, sampler.indicesFor(s, 0, 1));
      flipHalfHorizontally(b);
      const double t1 = now();
      step(b);
      prepare += t1 - t0;
      compute += now() - t1;
    }
    const double baseline = now() - baselineStart;

    BatchLoader loader(*dataset, sampler, 0, 1, 1, /*hflip=*/true);
    loader.take(steps);  // the first batch has nothing to overlap with: not counted
    loader.takeWaitSeconds();
    const double loaderStart = now();
    for (int64_t s = steps + 1; s <= 2 * steps; ++s) step(loader.take(s).batch);
    const double withLoader = now() - loaderStart;
    const double waited = loader.takeWaitSeconds();

    std::printf("%lld PNG images 28x28, batch %lld, DiT (64 wide, 4 blocks) forward+backward, %lld steps each\n",
                static_cast<long long>(images), static_cast<long long>(batch), static_cast<long long>(steps));
    std::printf("baseline (decode on the step's thread): %.2f ms/step = %.2f ms preparing + %.2f ms computing\n",
                1e3 * baseline / steps, 1e3 * prepare / steps, 1e3 * compute / steps);
    std::printf("BatchLoader (prefetch thread):          %.2f ms/step, of which %.3f ms waiting for the batch "
                "(%.1f%% of the baseline's preparing)\n",
                1e3 * withLoader / steps, 1e3 * waited / steps, 100.0 * waited / std::max(prepare, 1e-12));
    fs::remove_all(dir);
    return 0;
  });
}
