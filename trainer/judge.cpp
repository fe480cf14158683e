// Classifier accuracy and Frechet distance of samples (see judge.h).
#include "trainer/judge.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <iomanip>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "datasets/dataset.h"
#include "models/models.h"
#include "models/train_model.h"

namespace tessera::trainer {
namespace {

// The symmetric square root of a symmetric positive semi-definite matrix (negative
// eigenvalues from rounding clamped to 0).
at::Tensor sqrtSymmetric(const at::Tensor& m) {
  const auto [values, vectors] = at::linalg_eigh(m);
  return vectors.matmul(at::diag(values.clamp_min(0).sqrt())).matmul(vectors.t());
}

constexpr int64_t kBatch = 1000;

// How many of `targets` [n] each class holds, and how many of those `hit` [n] (bool) marks:
// two int64 tensors of at least `classes` entries (more where a target is above them).
std::pair<at::Tensor, at::Tensor> hitsPerClass(const at::Tensor& targets, const at::Tensor& hit, int64_t classes) {
  const at::Tensor t = targets.to(at::kLong);
  return {at::bincount(t, {}, classes), at::bincount(t, hit.to(at::kDouble), classes).to(at::kLong)};
}

}  // namespace

double frechetDistance(const at::Tensor& a, const at::Tensor& b) {
  TESSERA_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1) && a.size(0) >= 2 && b.size(0) >= 2,
                "Frechet distance: needs features [n >= 2, d] of the same width, got ", a.sizes(), " and ", b.sizes());
  const at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
  // Samples gone to NaN have NaN features, on which LAPACK's eigh may throw or return
  // anything: their distance is NaN (the post-hoc sweep never keeps it).
  if (!x.isfinite().all().item<bool>() || !y.isfinite().all().item<bool>()) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  const at::Tensor muX = x.mean(0), muY = y.mean(0);
  const at::Tensor covX = at::cov(x.t()), covY = at::cov(y.t());
  const at::Tensor rootX = sqrtSymmetric(covX);
  const at::Tensor cross = sqrtSymmetric(rootX.matmul(covY).matmul(rootX));
  return ((muX - muY).square().sum() + covX.trace() + covY.trace() - 2 * cross.trace()).item<double>();
}

SampleJudge::SampleJudge(const std::string& classifierExport) : classifier_(loadExportedModel(classifierExport)) {
  net_ = dynamic_cast<models::FeatureModel*>(classifier_.model.get());
  TESSERA_CHECK(net_ != nullptr && classifier_.description.data.classes > 0 && !classifier_.description.data.tokens,
                classifierExport, ": not a classifier of images (model.arch mlp or convnet trained on image data)");
  TESSERA_CHECK(classifier_.description.dataset.has_value(), classifierExport,
                ": its metadata does not name the data it was trained on (the real images to compare with)");
  const datasets::DataOptions& data = *classifier_.description.dataset;
  std::unique_ptr<datasets::Dataset> dataset;
  try {
    dataset = datasets::makeDataset(data, models::tokenWindows(classifier_.description.model));
  } catch (const std::exception& e) {
    throw Error(strCat(classifierExport, ": the data it was trained on cannot be read here: ", e.what()));
  }
  const int64_t n = dataset->evalSamples();
  TESSERA_CHECK(n >= 2, classifierExport, ": its data (", dataset->describe(), ") holds out ", n, " images");
  std::vector<at::Tensor> features;
  const int64_t classes = classifier_.description.data.classes;
  at::Tensor count = at::zeros({classes}, at::kLong), correct = at::zeros({classes}, at::kLong);
  for (int64_t begin = 0; begin < n; begin += kBatch) {
    const datasets::Batch batch = dataset->evalBatch(begin, std::min(kBatch, n - begin));
    features.push_back(featuresOf(batch.inputs));
    c10::NoGradGuard noGrad;
    const auto [inBatch, hitInBatch] =
        hitsPerClass(batch.targets, net_->forward(batch.inputs).argmax(1).eq(batch.targets.to(at::kLong)), classes);
    count += inBatch;
    correct += hitInBatch;
  }
  realFeatures_ = at::cat(features);
  realAccuracy_ = static_cast<double>(correct.sum().item<int64_t>()) / static_cast<double>(n);
  realCount_.assign(count.data_ptr<int64_t>(), count.data_ptr<int64_t>() + classes);
  realCorrect_.assign(correct.data_ptr<int64_t>(), correct.data_ptr<int64_t>() + classes);
  realSource_ = strCat("the ", n, " held-out images of ", data.eval_path.empty() ? data.path : data.eval_path);
}

at::Tensor SampleJudge::featuresOf(const at::Tensor& images) const {
  c10::NoGradGuard noGrad;
  return net_->features(images.to(at::kFloat)).to(at::kDouble);
}

Judgement SampleJudge::judge(const at::Tensor& samples, const at::Tensor& labels) const {
  const auto& shape = classifier_.description.data.inputShape;
  TESSERA_CHECK(samples.dim() == 1 + static_cast<int64_t>(shape.size()) && samples.sizes().slice(1).equals(shape),
                "judge: samples ", samples.sizes(), " are not the classifier's images [N, ", at::IntArrayRef(shape), "]");
  TESSERA_CHECK(labels.defined() && labels.dim() == 1 && labels.size(0) == samples.size(0),
                "judge: needs the class each sample was asked for (a class-conditional model)");
  c10::NoGradGuard noGrad;
  // Clamped to the pixel range, as the saved images a user would judge.
  const at::Tensor images = samples.to(at::kFloat).clamp(-1.0, 1.0);
  Judgement j;
  j.samples = samples.size(0);
  j.realImages = realFeatures_.size(0);
  j.realSource = realSource_;
  const at::Tensor asked = labels.to(at::kLong);
  // In batches, as the real images: the convnet's im2col columns of 10000 samples at once
  // would be gigabytes.
  std::vector<at::Tensor> predicted, features;
  for (int64_t begin = 0; begin < images.size(0); begin += kBatch) {
    const at::Tensor batch = images.slice(0, begin, std::min(begin + kBatch, images.size(0)));
    predicted.push_back(net_->forward(batch).argmax(1));
    features.push_back(featuresOf(batch));
  }
  const at::Tensor hit = at::cat(predicted).eq(asked);
  j.accuracy = hit.to(at::kDouble).mean().item<double>();
  const auto [count, correct] = hitsPerClass(asked, hit, static_cast<int64_t>(realCount_.size()));
  for (int64_t label = 0; label < count.size(0); ++label) {
    ClassScore c;
    c.label = label;
    c.samples = count[label].item<int64_t>();
    if (c.samples == 0) continue;  // not asked for
    c.accuracy = static_cast<double>(correct[label].item<int64_t>()) / static_cast<double>(c.samples);
    if (label < static_cast<int64_t>(realCount_.size()) && realCount_[label] > 0) {
      c.realAccuracy = static_cast<double>(realCorrect_[label]) / static_cast<double>(realCount_[label]);
    }
    j.perClass.push_back(c);
  }
  j.frechet = frechetDistance(at::cat(features), realFeatures_);
  j.realAccuracy = realAccuracy_;
  const int64_t n = samples.size(0);
  if (n >= 2 && realFeatures_.size(0) - n >= 2) {
    j.realFrechet = frechetDistance(realFeatures_.slice(0, 0, n), realFeatures_.slice(0, n));
  }
  return j;
}

std::string perClassText(const Judgement& j) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(2) << "per class asked for, accuracy (the classifier on real ones):";
  for (size_t i = 0; i < j.perClass.size(); ++i) {
    const ClassScore& c = j.perClass[i];
    out << (i ? ", " : " ") << c.label << " " << c.accuracy;
    if (c.realAccuracy >= 0) out << " (" << c.realAccuracy << ")";
  }
  return out.str();
}

}  // namespace tessera::trainer
