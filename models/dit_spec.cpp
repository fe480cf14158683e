// model.arch dit: the class-conditional diffusion transformer of Peebles & Xie over images
// (its code is dit.cpp): its keys, their checks, its classes from the data, and the
// position table its metadata implies.
#include <algorithm>

#include "common/errors.h"
#include "common/limits.h"
#include "datasets/data_options.h"
#include "datasets/dataset.h"
#include "models/architecture.h"
#include "models/model_options.h"

namespace tessera::models {

std::shared_ptr<TrainModel> makeDit(const ModelOptions& options, const datasets::DataSpec& data, c10::Device device);

namespace {

std::vector<KeyProblem> checkDit(const ModelOptions& m, const ArchitectureContext& context) {
  const std::string& p = context.keyPrefix;
  std::vector<KeyProblem> problems;
  if (m.embed_dim % m.heads != 0) {
    problems.push_back({"heads", strCat(m.heads, " does not divide ", p, "embed_dim (", m.embed_dim, ")")});
  }
  if (!datasets::isImageKind(context.dataKind)) {
    problems.push_back({"arch", strCat("dit needs images: data.kind idx, image_folder or webdataset, not ", context.dataKind)});
  }
  if (m.embed_dim % 4 != 0) {
    problems.push_back({"embed_dim", strCat(m.embed_dim, ": dit's 2-D sin-cos position embedding needs a multiple of 4")});
  }
  if (m.patch_overlap < 0 || 2 * m.patch_overlap > m.patch_size) {
    problems.push_back({"patch_overlap", strCat(m.patch_overlap, " must be between 0 and half of ", p, "patch_size (",
                                                m.patch_size, "): a window reaches at most the middle of its neighbour")});
  }
  checkDenoiserOptions(m, context, problems);
  return problems;
}

void resolveDit(ModelOptions& options, const datasets::DataSpec& data) {
  options.classes = conditioningClasses(options, data);
}

// The blocks, the width, and the position table (patches x embed_dim, built at once) must
// be ones the file's tensors could hold.
std::string ditFileProblem(const ModelOptions& m, const datasets::DataSpec& data, const FileShapes& file) {
  if (m.layers > file.tensors) return strCat("says layers ", m.layers, ", but the file holds only ", file.tensors, " tensors");
  if (m.embed_dim > file.largestDim) {
    return strCat("says embed_dim ", m.embed_dim, ", wider than any tensor of the file (largest dimension ",
                  file.largestDim, ")");
  }
  const std::vector<int64_t>& in = data.inputShape;
  if (in.size() == 3 && m.patch_size > 0) {
    const int64_t grid = in[1] / m.patch_size;
    const int64_t table = boundedProduct(boundedProduct(grid, grid, kMaxCounter), m.embed_dim, kMaxCounter);
    if (table < 0 || table > file.elements) {
      return strCat("says ", grid, " x ", grid, " patches of width ", m.embed_dim, " (data.input_shape [", in[0], ", ",
                    in[1], ", ", in[2], "], model.patch_size ", m.patch_size, "), more than the ", file.elements,
                    " values the file holds");
    }
  }
  return "";
}

// The attention scores of a micro-batch (one block's, each head's tokens x tokens), the
// position table, and the label table: what grows with the image size and the classes.
std::vector<PlannedTensor> ditPlanned(const ModelOptions& m, const datasets::DataSpec& data, int64_t microBatch) {
  const std::vector<int64_t>& in = data.inputShape;
  if (in.size() != 3 || m.patch_size <= 0) return {};
  const double tokens = static_cast<double>(in[1] / m.patch_size) * static_cast<double>(in[2] / m.patch_size);
  const double width = static_cast<double>(m.embed_dim);
  const double classes = static_cast<double>(std::max<int64_t>(m.classes, data.classes)) + 1;
  return {{"the attention scores of a micro-batch", static_cast<double>(microBatch) * static_cast<double>(m.heads) *
                                                         tokens * tokens * 4.0,
           "data.image_size, model.patch_size, model.heads, data.micro_batch"},
          {"the position table", tokens * width * 4.0, "data.image_size, model.patch_size, model.embed_dim"},
          {"the class table with its gradient and AdamW's moments", classes * width * 16.0,
           "the data's classes (model.classes), model.embed_dim"}};
}

std::vector<std::string> ditKeys() {
  std::vector<std::string> keys = {"embed_dim",   "layers",        "heads",   "patch_size",   "mlp_ratio",
                                   "final_conv",  "patch_overlap", "classes", "class_dropout"};
  for (std::string& key : denoiserKeys()) keys.push_back(std::move(key));
  return keys;
}

}  // namespace

const ArchitectureSpec& ditArchitecture() {
  static const ArchitectureSpec spec{"dit",
                                     "a class-conditional diffusion transformer over images (Peebles & Xie)",
                                     "DiT",
                                     /*denoiser=*/true,
                                     /*predictsEveryPosition=*/false,
                                     ditKeys(),
                                     checkDit,
                                     resolveDit,
                                     ditFileProblem,
                                     ditPlanned,
                                     TESSERA_MODEL_FACTORY(makeDit)};
  return spec;
}

}  // namespace tessera::models
