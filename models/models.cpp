// Built-in models by architecture (see models.h).
#include "models/models.h"

#include "common/errors.h"
#include "dtensor/param_init.h"
#include "models/architecture.h"
#include "models/layers.h"

namespace tessera::models {

datasets::DataSpec tokenDataSpec(const ModelOptions& options) {
  return datasets::tokenWindowSpec(options.context, options.vocab_size, predictsEveryPosition(options));
}

bool predictsEveryPosition(const ModelOptions& options) { return architecture(options.arch).predictsEveryPosition; }

datasets::TokenWindows tokenWindows(const ModelOptions& options) {
  return {options.context, options.vocab_size, predictsEveryPosition(options)};
}

std::shared_ptr<TrainModel> makeModel(const ModelOptions& options, const datasets::DataSpec& data, at::Device device) {
  const ArchitectureSpec& spec = architecture(options.arch);
  TESSERA_CHECK(spec.make != nullptr, "makeModel: model.arch ", spec.name, " has no factory in this build");
  return spec.make(options, data, device);
}

void initializeModel(torch::nn::Module& model, uint64_t seed) {
  dtensor::materializeAll(model, layers::initializerOf(model, seed));
}

}  // namespace tessera::models
