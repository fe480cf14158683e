// The safetensors tensor dataset: rows and splits, class and float targets, file order
// with shuffling off, the errors for malformed files (each naming the file and the
// tensor or row), the per-sample noise seeds, and that the shipped toy data is what
// scripts/make_toy_data.py writes.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "checkpoint/safetensors.h"
#include "common/errors.h"
#include "common/filesystem.h"
#include "datasets/dataset.h"
#include "datasets/data_options.h"
#include "datasets/tensor_dataset.h"
#include "datasets/text_dataset.h"
#include "trainer/train_config.h"
#include "tests/support/scratch_path.h"
#include "tests/support/error_capture.h"

namespace tessera::datasets {
namespace {

using tessera::test::errorOf;

namespace fs = std::filesystem;

std::string writeTensors(const std::string& name, const std::map<std::string, at::Tensor>& tensors) {
  const fs::path path = test::scratchPath("tessera_tds", name);
  checkpoint::saveSafetensors(path.string(), tensors);
  return path.string();
}

TEST(TensorDatasetTest, RowsSplitsAndClassTargets) {
  const at::Tensor inputs = at::arange(10 * 3, at::kFloat).view({10, 3});
  const at::Tensor targets = at::tensor(std::vector<int64_t>{0, 1, 2, 0, 1, 2, 0, 1, 4, 0});
  const std::string path = writeTensors("cls.safetensors", {{"inputs", inputs}, {"targets", targets}});
  TensorDataset ds(path, 0.2);
  EXPECT_EQ(ds.trainSamples(), 8);
  EXPECT_EQ(ds.evalSamples(), 2);
  const Batch b = ds.trainBatch({7, 0, 3});
  EXPECT_TRUE(at::equal(b.inputs, inputs.index_select(0, at::tensor(std::vector<int64_t>{7, 0, 3}))));
  EXPECT_EQ(b.targets.scalar_type(), at::kLong);
  EXPECT_EQ((std::vector<int64_t>{b.targets[0].item<int64_t>(), b.targets[1].item<int64_t>(), b.targets[2].item<int64_t>()}),
            (std::vector<int64_t>{1, 0, 0}));
  const Batch e = ds.evalBatch(0, 2);  // the last 2 rows
  EXPECT_TRUE(at::equal(e.inputs, inputs.narrow(0, 8, 2)));
  EXPECT_EQ(e.targets[0].item<int64_t>(), 4);
  const DataSpec spec = ds.spec();
  EXPECT_FALSE(spec.tokens);
  EXPECT_EQ(spec.inputShape, std::vector<int64_t>{3});
  EXPECT_EQ(spec.classes, 5);  // largest id + 1, held-out rows included
  EXPECT_NE(ds.describe().find("5 classes"), std::string::npos) << ds.describe();
  EXPECT_THROW(ds.trainBatch({8}), Error);  // held-out rows are not train samples
  EXPECT_THROW(ds.trainBatch({-1}), Error);
  EXPECT_THROW(ds.evalBatch(1, 2), Error);
}

TEST(TensorDatasetTest, FloatTargetsAndImagesWithoutTargets) {
  const at::Tensor images = at::randn({7, 2, 3, 5}, at::kDouble);  // doubles are read as float32
  const at::Tensor values = at::randn({7, 4}, at::kFloat);
  TensorDataset regression(writeTensors("reg.safetensors", {{"inputs", images}, {"targets", values}}), 0.3);
  EXPECT_EQ(regression.trainSamples(), 5);  // 7 - floor(2.1)
  const DataSpec spec = regression.spec();
  EXPECT_EQ(spec.inputShape, (std::vector<int64_t>{2, 3, 5}));
  EXPECT_EQ(spec.classes, 0);
  EXPECT_EQ(spec.targetShape, std::vector<int64_t>{4});
  const Batch b = regression.trainBatch({4});
  EXPECT_EQ(b.inputs.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(b.inputs[0], images[4].to(at::kFloat)));
  EXPECT_TRUE(at::equal(b.targets[0], values[4]));

  TensorDataset unlabelled(writeTensors("img.safetensors", {{"inputs", images}}), 0.0);
  EXPECT_EQ(unlabelled.trainSamples(), 7);
  EXPECT_EQ(unlabelled.evalSamples(), 0);
  EXPECT_FALSE(unlabelled.spec().hasTargets);
  EXPECT_FALSE(unlabelled.trainBatch({0, 1}).targets.defined());
}

// With data.shuffle false the sampler hands out the rows in file order, a global batch at
// a time, split over the ranks in rank order.
TEST(TensorDatasetTest, UnshuffledSamplerReadsTheFileInOrder) {
  const at::Tensor inputs = at::arange(12, at::kFloat).view({12, 1});
  TensorDataset ds(writeTensors("order.safetensors", {{"inputs", inputs}}), 0.0);
  DistributedSampler sampler(ds.trainSamples(), 6, /*seed=*/3, /*shuffle=*/false);
  std::vector<float> seen;
  for (int64_t step = 0; step < 2; ++step) {
    for (int rank = 0; rank < 3; ++rank) {
      const Batch b = ds.trainBatch(sampler.indicesFor(step, rank, 3));
      for (int64_t i = 0; i < b.size(); ++i) seen.push_back(b.inputs[i][0].item<float>());
    }
  }
  EXPECT_EQ(seen, (std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}));
}

TEST(TensorDatasetTest, MalformedFilesAreRefusedWithTheFileAndTensorNamed) {
  const at::Tensor x = at::randn({6, 2});
  struct Case {
    std::string name;
    std::map<std::string, at::Tensor> tensors;
    std::string expected;
  };
  at::Tensor nanRow = x.clone();
  nanRow[4][1] = std::numeric_limits<float>::quiet_NaN();
  at::Tensor infTarget = at::zeros({6, 1});
  infTarget[2][0] = std::numeric_limits<float>::infinity();
  const std::vector<Case> cases = {
      {"no_inputs", {{"targets", at::zeros({6}, at::kLong)}}, "no tensor named 'inputs'"},
      {"extra", {{"inputs", x}, {"labels", at::zeros({6}, at::kLong)}}, "unexpected tensor 'labels'"},
      {"int_inputs", {{"inputs", at::zeros({6, 2}, at::kLong)}}, "'inputs' must be a floating-point tensor"},
      {"rows", {{"inputs", x}, {"targets", at::zeros({5}, at::kLong)}}, "must have the 6 rows"},
      {"negative", {{"inputs", x}, {"targets", at::tensor(std::vector<int64_t>{0, 1, -2, 0, 1, 0})}}, "row 2 holds a negative class id"},
      {"class_matrix", {{"inputs", x}, {"targets", at::zeros({6, 2}, at::kLong)}}, "class ids, one per sample"},
      {"bool", {{"inputs", x}, {"targets", at::zeros({6}, at::kBool)}}, "'targets' is bool"},
      {"nan", {{"inputs", nanRow}}, "'inputs' row 4 holds a NaN"},
      {"inf", {{"inputs", x}, {"targets", infTarget}}, "'targets' row 2 holds a NaN or infinite"},
      {"one_dim", {{"inputs", at::zeros({6})}}, "shape it [N, 1]"},
      {"no_features", {{"inputs", at::zeros({6, 3, 0})}}, "at least one value"},
      {"empty_targets", {{"inputs", x}, {"targets", at::zeros({6, 0})}}, "'targets' [6, 0] hold no values"},
      {"huge_class", {{"inputs", x}, {"targets", at::tensor(std::vector<int64_t>{0, 1, 0, int64_t{1} << 40, 1, 0})}},
       "row 3 holds class id 1099511627776"},
  };
  for (const Case& c : cases) {
    const std::string path = writeTensors(c.name + ".safetensors", c.tensors);
    const std::string message = errorOf([&] { TensorDataset(path, 0.0); });
    EXPECT_NE(message.find(c.expected), std::string::npos) << c.name << ": " << message;
    EXPECT_NE(message.find(path), std::string::npos) << c.name << ": " << message;
  }
  const std::string tiny = writeTensors("tiny.safetensors", {{"inputs", at::zeros({2, 1})}});
  EXPECT_NE(errorOf([&] { TensorDataset(tiny, 0.4); }).find("too few to hold out"), std::string::npos);
  const std::string notSafetensors = writeTensors("garbage.safetensors", {{"inputs", x}});
  std::ofstream(notSafetensors, std::ios::binary) << "not a safetensors file";
  EXPECT_NE(errorOf([&] { TensorDataset(notSafetensors, 0.0); }).find(notSafetensors), std::string::npos);
  EXPECT_NE(errorOf([&] { TensorDataset("/nonexistent/data.safetensors", 0.0); }).find("/nonexistent/data.safetensors"),
            std::string::npos);
}

TEST(TensorDatasetTest, MakeDatasetPicksTheKind) {
  DataOptions data;
  data.kind = "tensors";
  data.path = writeTensors("kind.safetensors", {{"inputs", at::zeros({4, 3})}});
  data.eval_fraction = 0.25;
  const auto ds = makeDataset(data, TokenWindows{});
  EXPECT_NE(dynamic_cast<TensorDataset*>(ds.get()), nullptr);
  EXPECT_EQ(ds->evalSamples(), 1);
}

TEST(NoiseSeedTest, DependsOnSeedStepAndIndexOnly) {
  std::set<uint64_t> seen;
  for (int64_t seed : {0, 1}) {
    for (int64_t step : {-2, -1, 0, 1, 2}) {
      for (int64_t index = 0; index < 64; ++index) seen.insert(noiseSeed(seed, step, index));
    }
  }
  EXPECT_EQ(seen.size(), 2u * 5u * 64u);  // no collisions between neighbours
  EXPECT_EQ(noiseSeed(5, 3, 9), noiseSeed(5, 3, 9));
}

// data/rings.safetensors (configs/diffusion.yaml) is exactly what the script writes.
TEST(ToyDataTest, ShippedRingsMatchTheScript) {
  const fs::path out = test::scratchPath("tessera_toy", "rings.safetensors");
  const std::string command = std::string(TESSERA_PYTHON3) + " " + TESSERA_SOURCE_DIR + "/scripts/make_toy_data.py " +
                              out.string() + " > /dev/null";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  auto bytes = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  };
  const std::string shipped = bytes(fs::path(TESSERA_SOURCE_DIR) / "data" / "rings.safetensors");
  ASSERT_FALSE(shipped.empty());
  EXPECT_TRUE(shipped == bytes(out / "rings.safetensors")) << "data/rings.safetensors differs from the script's output";
  TensorDataset rings((out / "rings.safetensors").string(), 0.05);
  EXPECT_EQ(rings.spec().inputShape, std::vector<int64_t>{2});
  EXPECT_EQ(rings.spec().classes, 3);
  const at::Tensor radius = rings.evalBatch(0, rings.evalSamples()).inputs.norm(2, 1);
  EXPECT_GT(radius.min().item<double>(), 0.25);
  EXPECT_LT(radius.max().item<double>(), 1.8);
  removeTree(out);
}

}  // namespace
}  // namespace tessera::datasets
