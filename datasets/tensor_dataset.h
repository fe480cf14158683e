// A dataset of tensors from a safetensors file: `inputs` [N, features...] (floating point) and
// optionally `targets`: class ids [N] (integers; the loss is cross-entropy) or values
// [N, ...] (floating point; mean-squared error). Sample i is row i of each; the last `eval_fraction` of
// the rows is held out. With data.shuffle false the sampler reads the rows in file order.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "datasets/dataset.h"

namespace tessera::datasets {

class TensorDataset : public Dataset {
 public:
  // Throws tessera::Error naming the file and the tensor when the file is unreadable or
  // malformed, `inputs` is missing, not floating point, 1-D or empty, `targets` has another
  // number of rows, no values, or a class id below 0 or of 2^20 and more (naming the row),
  // a value is not finite (naming the row), the file holds another tensor, or either split
  // is empty.
  TensorDataset(const std::string& path, double evalFraction);

  int64_t trainSamples() const override { return trainRows_; }
  int64_t evalSamples() const override { return inputs_.size(0) - trainRows_; }
  Batch trainBatch(const std::vector<int64_t>& indices) const override;
  Batch evalBatch(int64_t first, int64_t n) const override;
  DataSpec spec() const override;
  std::string describe() const override;

 private:
  Batch rows(const at::Tensor& index) const;
  std::string path_;
  at::Tensor inputs_;   // float32
  at::Tensor targets_;  // int64 or float32; undefined without targets
  int64_t classes_ = 0;
  int64_t trainRows_ = 0;
};

}  // namespace tessera::datasets
