// model.arch convnet: a small convolutional image classifier (the second judge's); its
// code is convnet.cpp.
#include "common/errors.h"
#include "datasets/data_options.h"
#include "datasets/dataset.h"
#include "models/architecture.h"
#include "models/model_options.h"

namespace tessera::models {

std::shared_ptr<TrainModel> makeConvNet(const ModelOptions& options, const datasets::DataSpec& data, c10::Device device);

namespace {

std::vector<KeyProblem> checkConvNet(const ModelOptions& m, const ArchitectureContext& context) {
  std::vector<KeyProblem> problems;
  if (!datasets::isImageKind(context.dataKind)) {
    problems.push_back({"arch", strCat("convnet classifies images: data.kind idx, image_folder or webdataset, not ",
                                       context.dataKind)});
  }
  if (m.hidden.size() < 2) {
    problems.push_back({"hidden", strCat("convnet needs each stage's channels and then the feature width (at least two "
                                         "entries), got ", m.hidden.size())});
  }
  return problems;
}

std::string convNetFileProblem(const ModelOptions& options, const datasets::DataSpec&, const FileShapes& file) {
  for (int64_t width : options.hidden) {
    if (width > file.largestDim) {
      return strCat("has a width ", width, ", wider than any tensor of the file (largest dimension ", file.largestDim, ")");
    }
  }
  return "";
}

}  // namespace

const ArchitectureSpec& convNetArchitecture() {
  static const ArchitectureSpec spec{
      "convnet",
      "a small convolutional classifier of images (model.hidden: each 3x3 stage's channels, then the feature width)",
      "ConvNet",
      /*denoiser=*/false,
      /*predictsEveryPosition=*/false,
      {"hidden"},
      checkConvNet,
      /*resolve=*/nullptr,
      convNetFileProblem,
      /*planned=*/nullptr,
      TESSERA_MODEL_FACTORY(makeConvNet)};
  return spec;
}

}  // namespace tessera::models
