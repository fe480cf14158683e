// The safetensors tensor dataset (see tensor_dataset.h).
#include "datasets/tensor_dataset.h"

#include <sstream>

#include "checkpoint/safetensors.h"
#include "common/errors.h"

namespace tessera::datasets {
namespace {

std::string shapeStr(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

// The first row of `t` (rows of at least one element) holding a NaN or an infinity, or -1.
int64_t firstNonFiniteRow(const at::Tensor& t) {
  const at::Tensor bad = t.isfinite().logical_not().reshape({t.size(0), t.numel() / t.size(0)}).any(1);
  const at::Tensor rows = bad.nonzero();
  return rows.numel() == 0 ? -1 : rows[0][0].item<int64_t>();
}

}  // namespace

TensorDataset::TensorDataset(const std::string& path, double evalFraction) : path_(path) {
  std::map<std::string, at::Tensor> tensors = checkpoint::loadSafetensors(path);  // names the file on errors
  for (const auto& [name, t] : tensors) {
    TESSERA_CHECK(name == "inputs" || name == "targets", "dataset '", path, "': unexpected tensor '", name,
                  "' (a tensor dataset holds 'inputs' and optionally 'targets')");
  }
  auto in = tensors.find("inputs");
  TESSERA_CHECK(in != tensors.end(), "dataset '", path, "': no tensor named 'inputs'");
  const at::Tensor& inputs = in->second;
  TESSERA_CHECK(inputs.is_floating_point() && inputs.dim() >= 2 && inputs.size(0) >= 1 && inputs.numel() > 0,
                "dataset '", path, "': 'inputs' must be a floating-point tensor [samples, features...] with at least "
                "one sample of at least one value, got ", inputs.scalar_type(), " ", shapeStr(inputs),
                " (one value per sample: shape it [N, 1])");
  inputs_ = inputs.to(at::kFloat).contiguous();
  const int64_t rows = inputs_.size(0);
  const int64_t badInput = firstNonFiniteRow(inputs_);
  TESSERA_CHECK(badInput < 0, "dataset '", path, "': 'inputs' row ", badInput, " holds a NaN or infinite value");

  auto tg = tensors.find("targets");
  if (tg != tensors.end()) {
    const at::Tensor& targets = tg->second;
    TESSERA_CHECK(targets.dim() >= 1 && targets.size(0) == rows, "dataset '", path, "': 'targets' ",
                  shapeStr(targets), " must have the ", rows, " rows of 'inputs'");
    if (targets.is_floating_point()) {
      TESSERA_CHECK(targets.numel() > 0, "dataset '", path, "': float 'targets' ", shapeStr(targets),
                    " hold no values");
      targets_ = targets.to(at::kFloat).contiguous();
      const int64_t bad = firstNonFiniteRow(targets_);
      TESSERA_CHECK(bad < 0, "dataset '", path, "': 'targets' row ", bad, " holds a NaN or infinite value");
    } else {
      TESSERA_CHECK(targets.scalar_type() != at::kBool, "dataset '", path,
                    "': 'targets' is bool; class ids must be integers and values floating point");
      TESSERA_CHECK(targets.dim() == 1, "dataset '", path, "': integer 'targets' are class ids, one per sample [",
                    rows, "], got ", shapeStr(targets));
      targets_ = targets.to(at::kLong).contiguous();
      const at::Tensor negative = (targets_ < 0).reshape({rows, -1}).any(1).nonzero();
      TESSERA_CHECK(negative.numel() == 0, "dataset '", path, "': 'targets' row ",
                    negative.numel() ? negative[0][0].item<int64_t>() : 0, " holds a negative class id");
      // A corrupt id would otherwise size the classifier's head (Linear(width, id + 1)).
      const int64_t largestRow = targets_.argmax().item<int64_t>();
      classes_ = targets_[largestRow].item<int64_t>() + 1;
      TESSERA_CHECK(classes_ <= kMaxClasses, "dataset '", path, "': 'targets' row ", largestRow, " holds class id ",
                    classes_ - 1, "; at most ", kMaxClasses, " classes are supported");
    }
  }
  const auto held = static_cast<int64_t>(static_cast<double>(rows) * evalFraction);
  trainRows_ = rows - held;
  TESSERA_CHECK(trainRows_ >= 1, "dataset '", path, "': ", rows, " samples leave no training samples");
  TESSERA_CHECK(evalFraction == 0.0 || held >= 1, "dataset '", path, "': ", rows,
                " samples are too few to hold out data.eval_fraction ", evalFraction, " (raise it or set it to 0)");
}

Batch TensorDataset::rows(const at::Tensor& index) const {
  Batch b;
  b.inputs = inputs_.index_select(0, index);
  if (targets_.defined()) b.targets = targets_.index_select(0, index);
  return b;
}

Batch TensorDataset::trainBatch(const std::vector<int64_t>& indices) const {
  for (int64_t i : indices) {
    TESSERA_CHECK(i >= 0 && i < trainRows_, "TensorDataset::trainBatch: sample ", i, " out of range [0, ", trainRows_,
                  ")");
  }
  return rows(at::tensor(indices, at::kLong));
}

Batch TensorDataset::evalBatch(int64_t first, int64_t n) const {
  TESSERA_CHECK(first >= 0 && n >= 0 && first + n <= evalSamples(), "TensorDataset::evalBatch: [", first, ", ",
                first + n, ") out of range [0, ", evalSamples(), ")");
  return rows(at::arange(trainRows_ + first, trainRows_ + first + n, at::kLong));
}

DataSpec TensorDataset::spec() const {
  DataSpec s;
  s.tokens = false;
  s.inputShape = inputs_.sizes().slice(1).vec();
  s.hasTargets = targets_.defined();
  s.classes = classes_;
  if (targets_.defined() && targets_.is_floating_point()) s.targetShape = targets_.sizes().slice(1).vec();
  return s;
}

std::string TensorDataset::describe() const {
  std::string targets = !targets_.defined()       ? "no targets"
                        : classes_ > 0            ? strCat("class targets (", classes_, " classes)")
                                                  : strCat("float targets ", shapeStr(targets_.select(0, 0)));
  return strCat(path_, ": inputs ", shapeStr(inputs_), ", ", targets, "; ", trainSamples(), " train and ",
                evalSamples(), " held-out samples");
}

}  // namespace tessera::datasets
