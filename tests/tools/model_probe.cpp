// tessera-model-probe (a test tool): loads an export through its metadata, runs the model
// on fixed inputs and writes inputs and outputs to a safetensors file, which
// python/test_tessera_models.py feeds to the plain-PyTorch model to compare.
//   tessera-model-probe --weights EXPORT --out PROBE.safetensors [--batch 3] [--seed 0]
// Written: token models `tokens` and `out` (ContextMlp: next-token logits [B, vocab];
// Gpt: every position's [B, T, vocab]); FeatureMlp and ConvNet `x`, `out` and `features_out` (the
// head's input); denoisers `x`, `t`, `y` (labels, "no class" included) and `out` (noise).
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include "checkpoint/safetensors.h"
#include "common/app_main.h"
#include "common/command_line.h"
#include "models/diffusion.h"
#include "models/gpt.h"
#include "models/train_model.h"
#include "trainer/model_loading.h"

int main(int argc, char** argv) {
  return tessera::runMain("tessera-model-probe", [&]() -> int {
    CLI::App app{"Tessera test tool: run an export's model on fixed inputs"};
    std::string weights, out;
    int64_t batch = 3;
    uint64_t seed = 0;
    app.add_option("--weights", weights, "An export")->required();
    app.add_option("--out", out, "The probe file to write")->required();
    app.add_option("--batch", batch, "Inputs")->check(CLI::Range(1, 64));
    app.add_option("--seed", seed, "Seed of the inputs");
    if (const auto done = tessera::parseCommandLine(app, argc, argv)) return *done;

    using namespace tessera::trainer;
    using namespace tessera::datasets;
    using namespace tessera::models;
    c10::NoGradGuard noGrad;
    LoadedModel loaded = loadExportedModel(weights);
    const DataSpec& data = loaded.description.data;
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    std::vector<int64_t> shape{batch};
    shape.insert(shape.end(), data.inputShape.begin(), data.inputShape.end());
    std::map<std::string, at::Tensor> probe;
    if (auto* denoiser = dynamic_cast<Denoiser*>(loaded.model.get())) {
      const at::Tensor x = at::randn(shape, gen, at::kFloat);
      const at::Tensor t = at::randint(denoiser->schedule().timesteps, {batch}, gen, at::kLong);
      const at::Tensor y = at::randint(denoiser->classes() + 1, {batch}, gen, at::kLong);
      probe = {{"x", x}, {"t", t}, {"y", y}, {"out", denoiser->predict(x, t, y)}};
    } else if (auto* gpt = dynamic_cast<Gpt*>(loaded.model.get())) {
      const at::Tensor tokens = at::randint(loaded.description.model.vocab_size, shape, gen, at::kLong);
      probe = {{"tokens", tokens}, {"out", gpt->forward(tokens)}};
    } else if (auto* next = dynamic_cast<NextTokenModel*>(loaded.model.get())) {
      const at::Tensor tokens = at::randint(loaded.description.model.vocab_size, shape, gen, at::kLong);
      probe = {{"tokens", tokens}, {"out", next->nextTokenLogits(tokens)}};
    } else if (auto* mlp = dynamic_cast<FeatureModel*>(loaded.model.get())) {
      const at::Tensor x = at::randn(shape, gen, at::kFloat);
      probe = {{"x", x}, {"out", mlp->forward(x)}, {"features_out", mlp->features(x)}};
    } else {
      throw tessera::Error("tessera-model-probe: no probe for arch " + loaded.description.model.arch);
    }
    tessera::checkpoint::saveSafetensors(out, probe);
    return 0;
  });
}
