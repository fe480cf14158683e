// model.arch mlp: an MLP over token windows (ContextMlp) or over tensors and images
// (FeatureMlp, e.g. the judge's classifier); its code is mlp.cpp.
#include "common/errors.h"
#include "datasets/dataset.h"
#include "models/architecture.h"
#include "models/model_options.h"

namespace tessera::models {

std::shared_ptr<TrainModel> makeMlp(const ModelOptions& options, const datasets::DataSpec& data, c10::Device device);

namespace {

std::string mlpFileProblem(const ModelOptions& options, const datasets::DataSpec&, const FileShapes& file) {
  for (int64_t width : options.hidden) {
    if (width > file.largestDim) {
      return strCat("has a hidden width ", width, ", wider than any tensor of the file (largest dimension ",
                    file.largestDim, ")");
    }
  }
  return "";
}

}  // namespace

const ArchitectureSpec& mlpArchitecture() {
  static const ArchitectureSpec spec{
      "mlp",
      "an MLP over token windows (data.kind text or tokens) or tensors and images (a classifier or regressor)",
      "ContextMlp (token data) / FeatureMlp",
      /*denoiser=*/false,
      /*predictsEveryPosition=*/false,
      {"vocab_size", "context", "embed_dim", "hidden", "activation"},
      /*check=*/nullptr,
      /*resolve=*/nullptr,
      mlpFileProblem,
      /*planned=*/nullptr,
      TESSERA_MODEL_FACTORY(makeMlp)};
  return spec;
}

}  // namespace tessera::models
