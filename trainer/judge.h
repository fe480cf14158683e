// Sample quality as a classifier trained on the same data sees it: the accuracy of its
// prediction against the class each sample was asked for, and the Frechet distance
// between its penultimate features of the samples and of held-out real images (FID's
// formula with this classifier in place of Inception, which fits 28x28 gray images).
// The classifier is an export of `model.arch: mlp` or `convnet` trained on the images (its
// metadata names the data it was trained on, whose held-out split gives the real images).
// Two judges of different architectures (configs/fashion_classifier.yaml and
// fashion_convnet.yaml) report both: a generator whose error pleases one judge's features
// shows in the other's.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "trainer/model_loading.h"

namespace tessera::models {
class FeatureModel;
}  // namespace tessera::models

namespace tessera::trainer {

// One class's share of a judgement: a class the model draws badly hides in the mean.
struct ClassScore {
  int64_t label = 0;
  int64_t samples = 0;       // samples asked for this class
  double accuracy = 0;       // the fraction of them classified as it
  double realAccuracy = -1;  // the classifier on the held-out real images of it (-1: none held out)
};

struct Judgement {
  double accuracy = 0;      // fraction of samples classified as their label
  double frechet = 0;       // between sample and real-image features
  int64_t samples = 0;
  int64_t realImages = 0;
  std::string realSource;   // where the real images came from
  // The scale to read them on: the classifier's accuracy on the real held-out images, and
  // the distance of as many real images as there are samples to the rest of them (what
  // perfect samples would score at this sample count; -1 when there are too few).
  double realAccuracy = 0;
  double realFrechet = -1;
  std::vector<ClassScore> perClass;  // each class asked for, in label order
};

// "per class asked for, accuracy (the classifier on real ones): 0 0.97 (0.86), 1 ...".
std::string perClassText(const Judgement& j);

// ||mu_a - mu_b||^2 + tr(S_a + S_b - 2 (S_a^1/2 S_b S_a^1/2)^1/2) of features [n, d] (n >= 2
// each), in double precision; the matrix square roots by symmetric eigendecomposition. NaN
// when a feature is not finite.
double frechetDistance(const at::Tensor& a, const at::Tensor& b);

class SampleJudge {
 public:
  // Loads the classifier export and the held-out images of the data its metadata names
  // (tessera::Error naming the file or the data that cannot be read).
  explicit SampleJudge(const std::string& classifierExport);
  // Samples [n, C, H, W] in [-1, 1] (the images' scale) asked for classes `labels` [n].
  Judgement judge(const at::Tensor& samples, const at::Tensor& labels) const;

 private:
  at::Tensor featuresOf(const at::Tensor& images) const;
  LoadedModel classifier_;
  models::FeatureModel* net_ = nullptr;  // the classifier's model
  at::Tensor realFeatures_;
  double realAccuracy_ = 0;
  std::vector<int64_t> realCount_, realCorrect_;  // per class, over the held-out images
  std::string realSource_;
};

}  // namespace tessera::trainer
