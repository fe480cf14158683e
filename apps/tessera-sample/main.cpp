// tessera-sample: draws samples from a trained denoiser (diffusion, dit) and writes them as
// a PNG grid (one row per class) and/or a safetensors file.
//   tessera-sample --weights EXPORT | --checkpoint DIR --what NAME
//                  [--classes 0,3,7|all] [--per-class N] [--sampler ddim|ddpm]
//                  [--steps K | --timesteps T0,T1,...]
//                  [--cfg SCALE] [--cfg-interval FIRST,LAST] [--seed S] [--noise FILE] [--out GRID.png] [--out-tensors FILE]
//                  [--judge CLASSIFIER [--judge ANOTHER]]
// The export's metadata says which model it is (no config needed) and, for a distilled
// few-step generator, the timesteps it samples at (model.sample_timesteps: the default
// when neither --steps nor --timesteps is given). --noise gives the
// exact starting noise (`noise` [N, ...] float32, optional `labels` [N] int64), so that a
// sample can be reproduced elsewhere (python/tessera_models.py). Under tessera-run the
// samples are split over the ranks and gathered; rank 0 writes. Exit status: 0 ok,
// 2 bad arguments or input, 1 other failures.

#include <cmath>
#include <filesystem>
#include <iostream>
#include <optional>
#include <vector>
#include <sstream>

#include "checkpoint/reader.h"
#include "checkpoint/safetensors.h"
#include "common/app_main.h"
#include "common/command_line.h"
#include "common/errors.h"
#include "common/signal_thread.h"
#include "distributed/communicator.h"
#include "distributed/rank_env.h"
#include "distributed/runtime.h"
#include "datasets/dataset.h"
#include "trainer/judge.h"
#include "trainer/model_loading.h"
#include "models/sampling.h"

namespace fs = std::filesystem;
using tessera::UsageError;

namespace {

struct SampleArgs {
  std::string weights, checkpoint, what = "generator_ema", classes = "all", noise, out, outTensors;
  std::vector<std::string> judges;  // --judge, each
  int64_t perClass = 8;
  tessera::models::SampleRequest request;
};

// "all" or a comma-separated list of class ids below `classes`.
std::vector<int64_t> parseClasses(const std::string& text, int64_t classes) {
  std::vector<int64_t> out;
  if (text == "all") {
    for (int64_t c = 0; c < classes; ++c) out.push_back(c);
    return out;
  }
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    int64_t c = -1;
    try {
      c = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || c < 0 || c >= classes) {
      throw UsageError(tessera::strCat("--classes: '", item, "' is not a class of this model (0 to ", classes - 1, ")"));
    }
    out.push_back(c);
  }
  if (out.empty()) throw UsageError("--classes: empty list");
  return out;
}

// The noise and labels to start from: the --noise file's, or drawn from --seed.
void startingPoint(const SampleArgs& args, tessera::models::Denoiser& model, tessera::models::SampleRequest& request) {
  if (!args.noise.empty()) {
    auto tensors = tessera::checkpoint::loadSafetensors(args.noise);
    auto it = tensors.find("noise");
    if (it == tensors.end()) throw UsageError(tessera::strCat("--noise ", args.noise, ": no tensor 'noise'"));
    if (it->second.scalar_type() != at::kFloat) {
      throw UsageError(tessera::strCat("--noise ", args.noise, ": 'noise' is ", it->second.scalar_type(), ", not float32"));
    }
    request.noise = it->second;
    // Starting noise is standard normal: NaN, Inf or values far outside it only draw
    // garbage (a sample of 1e30 noise is no sample).
    const at::Tensor& noise = request.noise;
    if (noise.numel() == 0) throw UsageError(tessera::strCat("--noise ", args.noise, ": 'noise' is empty"));
    if (!at::isfinite(noise).all().item<bool>()) {
      throw UsageError(tessera::strCat("--noise ", args.noise, ": 'noise' holds NaN or Inf"));
    }
    constexpr double kMaxNoise = 100.0;  // a standard normal value beyond this has probability ~0
    const double largest = noise.abs().max().item<double>();
    if (largest > kMaxNoise) {
      throw UsageError(tessera::strCat("--noise ", args.noise, ": 'noise' holds ", largest,
                                       ", not standard normal noise (|values| above ", kMaxNoise, ")"));
    }
    auto labels = tensors.find("labels");
    if (labels != tensors.end()) {
      const at::Tensor& l = labels->second;
      if (l.scalar_type() != at::kLong) throw UsageError(tessera::strCat("--noise ", args.noise, ": 'labels' must be int64"));
      if (l.dim() != 1 || l.size(0) != noise.size(0)) {
        throw UsageError(tessera::strCat("--noise ", args.noise, ": 'labels' ", l.sizes(), " must be [", noise.size(0),
                                         "], one per noise row"));
      }
      if (model.classes() == 0) throw UsageError(tessera::strCat("--noise ", args.noise, ": 'labels' for an unconditional model"));
      const int64_t lo = l.min().item<int64_t>(), hi = l.max().item<int64_t>();
      if (lo < 0 || hi > model.classes()) {
        throw UsageError(tessera::strCat("--noise ", args.noise, ": 'labels' in [", lo, ", ", hi, "], the model knows ",
                                         model.classes(), " classes (label ", model.classes(), ": no class)"));
      }
      request.labels = l;
    }
    return;
  }
  if (model.classes() > 0) {
    request.labels = tessera::models::classRows(parseClasses(args.classes, model.classes()), args.perClass);
  } else if (args.classes != "all") {
    throw UsageError("--classes: this model is unconditional (it was trained without labels)");
  }
  const int64_t n = model.classes() > 0 ? request.labels.size(0) : args.perClass;
  request.noise = tessera::models::samplingNoise(model.sampleShape(), n, static_cast<uint64_t>(request.seed));
}

void checkOutputPath(const std::string& path, const std::string& option, const std::string& suffix,
                     const std::vector<std::string>& inputs) {
  if (path.empty()) return;
  if (fs::path(path).extension() != suffix) throw UsageError(tessera::strCat(option, " ", path, ": must end in ", suffix));
  tessera::checkpoint::checkOutputOutsideState(path, option, inputs);
  std::error_code ec;
  const fs::path parent = fs::absolute(path).parent_path();
  if (!fs::is_directory(parent, ec)) throw UsageError(tessera::strCat(option, " ", path, ": no directory ", parent.string()));
}

}  // namespace

int main(int argc, char** argv) {
  return tessera::runMain("tessera-sample", [&]() -> int {
    tessera::routeSignalsToOwnThread();  // before any thread starts: no handler runs inside a oneDNN product
    CLI::App app{"Tessera: sample a trained denoiser into a PNG grid and/or a safetensors file"};
    SampleArgs args;
    auto* weights = app.add_option("--weights", args.weights, "An export (.safetensors or a sharded export's index)");
    auto* checkpoint = app.add_option("--checkpoint", args.checkpoint,
                                      "A checkpoint step directory, or a run's checkpoints directory (its newest)");
    app.add_option("--what", args.what, "With --checkpoint: generator_ema, model, an EMA or alias name")->needs(checkpoint);
    weights->excludes(checkpoint);
    auto* classes = app.add_option("--classes", args.classes, "Class ids, e.g. 0,3,7, or all (one grid row each)");
    app.add_option("--per-class", args.perClass, "Samples per class (unconditional: samples)")->check(CLI::Range(1, 4096));
    app.add_option("--sampler", args.request.sampler, "ddim (deterministic) or ddpm")->check(CLI::IsMember({"ddim", "ddpm"}));
    auto* steps = app.add_option("--steps", args.request.steps, "DDIM steps, evenly spaced (default 50, or the model's "
                                 "sample_timesteps)")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
    auto* timesteps = app.add_option("--timesteps", args.request.timesteps,
                                     "DDIM at these timesteps, decreasing, comma-separated (e.g. 999,749,499,249)")
                          ->delimiter(',')
                          ->excludes(steps);
    app.add_option("--cfg", args.request.cfg, "Classifier-free guidance scale (1: none)")->check(CLI::Range(0.0, 100.0));
    std::vector<int64_t> cfgInterval;
    app.add_option("--cfg-interval", cfgInterval,
                   "FIRST,LAST: guide only at timesteps in [FIRST, LAST] (default: all; the noisiest steps' guidance "
                   "mostly costs diversity)")
        ->delimiter(',')
        ->expected(2);
    app.add_option("--seed", args.request.seed, "Seed of the starting noise (and DDPM's step noise)");
    auto* noise = app.add_option("--noise", args.noise, "Start from this noise: safetensors 'noise' [N, ...], 'labels' [N]");
    noise->excludes(classes);
    app.add_option("--out", args.out, "Write a PNG grid, one row per class");
    app.add_option("--out-tensors", args.outTensors, "Write 'samples' [N, ...] float32 and 'labels' [N] as safetensors");
    app.add_option("--judge", args.judges,
                   "A classifier export (model.arch mlp or convnet on the same images): print its accuracy on the "
                   "samples and the Frechet distance of its features to the held-out images'; give it again for "
                   "another judge (another architecture's features), reported after the first");
    if (const auto done = tessera::parseCommandLine(app, argc, argv)) return *done;
    // CLI11's Range lets NaN through (every comparison with it is false).
    if (!std::isfinite(args.request.cfg)) throw UsageError(tessera::strCat("--cfg: ", args.request.cfg, " is not a number"));
    if (timesteps->count() > 0 && args.request.timesteps.empty()) throw UsageError("--timesteps: no timesteps given");
    if (args.weights.empty() && args.checkpoint.empty()) throw UsageError("give --weights EXPORT or --checkpoint DIR");
    if (args.out.empty() && args.outTensors.empty() && args.judges.empty()) {
      throw UsageError("nothing to do: give --out, --out-tensors and/or --judge");
    }
    if (!args.out.empty() && !args.outTensors.empty() && fs::absolute(args.out) == fs::absolute(args.outTensors)) {
      throw UsageError("--out and --out-tensors name the same file");
    }
    std::vector<std::string> inputs{args.weights, args.noise, args.checkpoint};
    inputs.insert(inputs.end(), args.judges.begin(), args.judges.end());
    checkOutputPath(args.out, "--out", ".png", inputs);
    checkOutputPath(args.outTensors, "--out-tensors", ".safetensors", inputs);

    const auto env = tessera::distributed::RankEnv::fromEnvironment();
    std::shared_ptr<tessera::distributed::Runtime> runtime;
    tessera::distributed::Communicator* comm = nullptr;
    if (env.world_size > 1) {
      runtime = tessera::distributed::Runtime::init(env);
      comm = runtime->comm().get();
    }
    auto loaded = args.weights.empty() ? tessera::trainer::loadCheckpointModel(args.checkpoint, args.what)
                                       : tessera::trainer::loadExportedModel(args.weights);
    auto* model = dynamic_cast<tessera::models::Denoiser*>(loaded.model.get());
    if (model == nullptr) {
      throw UsageError(tessera::strCat("the model is a ", loaded.description.model.arch,
                                       ", not a denoiser (diffusion, dit): nothing to sample"));
    }
    startingPoint(args, *model, args.request);
    const std::string intervalProblem =
        tessera::models::guidanceIntervalProblem(cfgInterval, model->schedule().timesteps);
    if (!intervalProblem.empty()) throw UsageError("--cfg-interval: " + intervalProblem);
    args.request.cfgInterval = tessera::models::makeGuidanceInterval(cfgInterval);
    if (steps->count() > 0 && args.request.steps > model->schedule().timesteps) {
      throw UsageError(tessera::strCat("--steps: ", args.request.steps, " steps for ", model->schedule().timesteps,
                                       " timesteps (at most one step per timestep)"));
    }
    // A distilled generator samples at its own timesteps unless told otherwise. Either
    // list is checked here, where the error can name where it came from.
    if (timesteps->count() > 0) {
      tessera::models::checkTimesteps(model->schedule(), args.request.timesteps, "--timesteps");
    } else if (steps->count() == 0 && args.request.sampler == "ddim") {
      tessera::models::useOwnTimesteps(args.request, *model, loaded.description.model.sample_timesteps,
                                       (args.weights.empty() ? args.checkpoint : args.weights) + ": model.sample_timesteps");
    }
    // The judges load (and read their real images) before sampling: a bad classifier fails fast.
    std::vector<tessera::trainer::SampleJudge> judges;
    if (!args.judges.empty()) {
      tessera::distributed::runOnEveryRank(comm, "loading the judge", [&] {
        if (env.rank == 0) {
          for (const std::string& file : args.judges) judges.emplace_back(file);
        }
      });
    }
    const at::Tensor samples = tessera::models::drawSamples(*model, args.request, comm, at::kCPU);
    if (env.rank != 0) return 0;
    if (!args.outTensors.empty()) {
      std::map<std::string, at::Tensor> out{{"samples", samples}};
      if (args.request.labels.defined()) out["labels"] = args.request.labels;
      tessera::checkpoint::saveSafetensors(args.outTensors, out);
      std::cout << "samples: " << args.outTensors << "\n";
    }
    if (!args.out.empty()) {
      if (samples.dim() != 4) throw UsageError("--out: the samples are not images; use --out-tensors");
      const int64_t perRow = args.request.labels.defined() && args.noise.empty() ? args.perClass
                                                                                  : std::min<int64_t>(samples.size(0), 10);
      tessera::models::writeSampleGrid(args.out, samples, perRow);
      std::cout << "grid: " << fs::absolute(args.out).string() << "\n";
    }
    for (size_t i = 0; i < judges.size(); ++i) {
      // The first judge's lines as they always were; a further one's named by its number and file.
      const std::string name = i == 0 ? "judge" : tessera::strCat("judge ", i + 1, " (", args.judges[i], ")");
      const auto j = judges[i].judge(samples, args.request.labels);
      std::cout << name << ": accuracy " << j.accuracy << " (" << j.samples
                << " samples classified as the class asked for; on real images the classifier scores "
                << j.realAccuracy << ")\n"
                << name << ": Frechet distance " << j.frechet << " to " << j.realSource;
      if (j.realFrechet >= 0) std::cout << " (" << j.samples << " real images score " << j.realFrechet << ")";
      std::cout << "\n";
      std::cout << name << ": " << tessera::trainer::perClassText(j) << "\n";
    }
    return 0;
  });
}
