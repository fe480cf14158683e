// Image datasets (datasets/image_dataset.h): IDX files raw and gzipped (shape, pixels,
// labels, the interleaved held-out rule, a separate held-out split, resizing, and the
// errors for malformed, truncated, mismatched, missing and non-regular files, each naming
// the file), and class folders (sorted class ids, samples, sizes, undecodable images,
// empty classes, a held-out split's classes).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/errors.h"
#include "imaging/image_io.h"
#include "imaging/image_ops.h"
#include "datasets/dataset.h"
#include "datasets/image_dataset.h"
#include "trainer/train_config.h"
#include "tests/support/scratch_path.h"
#include "tests/support/error_capture.h"

namespace tessera::datasets {
namespace {

using tessera::test::errorOf;
using tessera::test::errorWithoutBlockingOn;

namespace fs = std::filesystem;

// [n, h, w] (or [c, h, w]) uint8 pixels running through the byte values in a scrambled order.
at::Tensor pattern(int64_t n, int64_t h, int64_t w, int64_t salt = 0) {
  return at::arange(n * h * w, at::kLong).mul(73).add(41 + salt).remainder(256).to(at::kByte).view({n, h, w});
}

void appendBigEndian32(std::string& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>((v >> shift) & 0xFF));
}

// An IDX images file: magic 0x00000803, N, H, W (big-endian), then the pixels.
std::string idxImages(const at::Tensor& images, uint32_t magic = 0x00000803) {
  std::string out;
  appendBigEndian32(out, magic);
  for (int64_t d = 0; d < 3; ++d) appendBigEndian32(out, static_cast<uint32_t>(images.size(d)));
  const at::Tensor c = images.contiguous();
  if (c.numel() > 0) out.append(reinterpret_cast<const char*>(c.data_ptr<uint8_t>()), static_cast<size_t>(c.numel()));
  return out;
}

// An IDX labels file: magic 0x00000801, N, then one byte per label.
std::string idxLabels(const std::vector<int64_t>& labels) {
  std::string out;
  appendBigEndian32(out, 0x00000801);
  appendBigEndian32(out, static_cast<uint32_t>(labels.size()));
  for (int64_t l : labels) out.push_back(static_cast<char>(l));
  return out;
}

void writeFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void writeGzip(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  if (f == nullptr) throw std::runtime_error("gzopen " + path);
  const int written = gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  const int closed = gzclose(f);
  if (written != static_cast<int>(bytes.size()) || closed != Z_OK) throw std::runtime_error("gzwrite " + path);
}

std::vector<int64_t> longs(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// The rows the documented rule holds out of n for fraction f: floor((i + 1) f) > floor(i f).
std::vector<int64_t> heldOutRows(int64_t n, double f) {
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < n; ++i) {
    if (std::floor(static_cast<double>(i + 1) * f) > std::floor(static_cast<double>(i) * f)) rows.push_back(i);
  }
  return rows;
}

std::vector<int64_t> complementOf(const std::vector<int64_t>& rows, int64_t n) {
  std::vector<int64_t> out;
  size_t next = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (next < rows.size() && rows[next] == i) {
      ++next;
    } else {
      out.push_back(i);
    }
  }
  return out;
}

std::vector<int64_t> firstIndices(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(i);
  return out;
}

// --- IDX --------------------------------------------------------------------------------

// Ten 4x3 images (pixel values 0 and 255 included) and their labels, raw and gzipped.
class IdxDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::scratchPath("tessera_idx", "dir");
    fs::create_directories(dir_);
    images_ = pattern(10, 4, 3).clone();
    images_[0][0][0].fill_(0);
    images_[0][0][1].fill_(255);
    labels_ = {3, 1, 4, 1, 5, 0, 2, 6, 5, 3};  // 7 classes; the largest id is not the last
    imagesPath_ = write("train-images-idx3-ubyte", idxImages(images_));
    labelsPath_ = write("train-labels-idx1-ubyte", idxLabels(labels_));
    imagesGz_ = dir_ + "/train-images-idx3-ubyte.gz";
    labelsGz_ = dir_ + "/train-labels-idx1-ubyte.gz";
    writeGzip(imagesGz_, idxImages(images_));
    writeGzip(labelsGz_, idxLabels(labels_));
  }

  std::string write(const std::string& name, const std::string& bytes) const {
    const std::string path = dir_ + "/" + name;
    writeFile(path, bytes);
    return path;
  }

  DataOptions options(double evalFraction) const {
    DataOptions d;
    d.kind = "idx";
    d.path = imagesPath_;
    d.labels = labelsPath_;
    d.eval_fraction = evalFraction;
    return d;
  }

  // The model pixels [rows.size(), 1, 4, 3] of file rows `rows`.
  at::Tensor modelPixelsOf(const std::vector<int64_t>& rows) const {
    return imaging::toModelPixels(images_.index_select(0, at::tensor(rows)).unsqueeze(1));
  }

  std::vector<int64_t> labelsOf(const std::vector<int64_t>& rows) const {
    std::vector<int64_t> out;
    for (int64_t r : rows) out.push_back(labels_[static_cast<size_t>(r)]);
    return out;
  }

  std::string dir_, imagesPath_, labelsPath_, imagesGz_, labelsGz_;
  at::Tensor images_;  // [10, 4, 3] uint8
  std::vector<int64_t> labels_;
};

TEST_F(IdxDatasetTest, ReadIdxImagesGivesNx1xHxWAndTheExactPixels) {
  const at::Tensor images = readIdxImages(imagesPath_);
  EXPECT_EQ(images.scalar_type(), at::kByte);
  EXPECT_EQ(images.sizes().vec(), (std::vector<int64_t>{10, 1, 4, 3}));
  EXPECT_TRUE(at::equal(images, images_.unsqueeze(1)));
}

TEST_F(IdxDatasetTest, ReadIdxLabelsGivesInt64Labels) {
  const at::Tensor labels = readIdxLabels(labelsPath_);
  EXPECT_EQ(labels.scalar_type(), at::kLong);
  EXPECT_EQ(labels.sizes().vec(), std::vector<int64_t>{10});
  EXPECT_EQ(longs(labels), labels_);
}

TEST_F(IdxDatasetTest, GzippedFilesReadAsTheRawOnes) {
  ASSERT_EQ(static_cast<unsigned char>(readFile(imagesGz_)[0]), 0x1f);  // really gzip
  EXPECT_TRUE(at::equal(readIdxImages(imagesGz_), readIdxImages(imagesPath_)));
  EXPECT_TRUE(at::equal(readIdxLabels(labelsGz_), readIdxLabels(labelsPath_)));
  DataOptions d = options(0.0);
  d.path = imagesGz_;
  d.labels = labelsGz_;
  const auto ds = makeIdxDataset(d);
  EXPECT_EQ(ds->trainSamples(), 10);
  EXPECT_TRUE(at::equal(ds->trainBatch(firstIndices(10)).inputs, modelPixelsOf(firstIndices(10))));
}

TEST_F(IdxDatasetTest, TrainBatchInputsAreModelPixelsAndTargetsTheLabels) {
  const auto ds = makeIdxDataset(options(0.0));
  EXPECT_EQ(ds->trainSamples(), 10);
  EXPECT_EQ(ds->evalSamples(), 0);
  const Batch b = ds->trainBatch({9, 0, 5});
  EXPECT_EQ(b.inputs.scalar_type(), at::kFloat);
  EXPECT_EQ(b.inputs.sizes().vec(), (std::vector<int64_t>{3, 1, 4, 3}));
  EXPECT_GE(b.inputs.min().item<float>(), -1.0f);
  EXPECT_LE(b.inputs.max().item<float>(), 1.0f);
  EXPECT_TRUE(at::equal(b.inputs, modelPixelsOf({9, 0, 5})));
  EXPECT_FLOAT_EQ(b.inputs[1][0][0][0].item<float>(), -1.0f);  // pixel 0
  EXPECT_FLOAT_EQ(b.inputs[1][0][0][1].item<float>(), 1.0f);  // pixel 255
  EXPECT_EQ(b.targets.scalar_type(), at::kLong);
  EXPECT_EQ(longs(b.targets), (std::vector<int64_t>{3, 3, 0}));
  EXPECT_THROW(ds->trainBatch({10}), Error);
  EXPECT_THROW(ds->trainBatch({-1}), Error);
}

// data.hflip is an augmentation of training (train_config.h); the dataset hands out the
// pixels as stored, flip or not.
TEST_F(IdxDatasetTest, DatasetDoesNotFlipImagesItself) {
  DataOptions d = options(0.0);
  d.hflip = true;
  const auto ds = makeIdxDataset(d);
  for (int repeat = 0; repeat < 4; ++repeat) {
    EXPECT_TRUE(at::equal(ds->trainBatch(firstIndices(10)).inputs, modelPixelsOf(firstIndices(10))));
  }
}

TEST_F(IdxDatasetTest, SpecIsTheImageShapeWithClassesFromTheLargestLabel) {
  const auto ds = makeIdxDataset(options(0.0));
  const DataSpec spec = ds->spec();
  EXPECT_FALSE(spec.tokens);
  EXPECT_EQ(spec.inputShape, (std::vector<int64_t>{1, 4, 3}));
  EXPECT_TRUE(spec.hasTargets);
  EXPECT_EQ(spec.classes, 7);  // largest label 6, + 1
  EXPECT_NE(ds->describe().find(imagesPath_), std::string::npos) << ds->describe();
  EXPECT_NE(ds->describe().find("7 classes"), std::string::npos) << ds->describe();
}

TEST_F(IdxDatasetTest, EvalFractionHoldsOutTheInterleavedSamples) {
  // f = 0.25: floor((i + 1) / 4) > floor(i / 4) at i = 3 and 7.
  const auto quarter = makeIdxDataset(options(0.25));
  EXPECT_EQ(quarter->trainSamples(), 8);
  EXPECT_EQ(quarter->evalSamples(), 2);
  const Batch held = quarter->evalBatch(0, 2);
  EXPECT_TRUE(at::equal(held.inputs, modelPixelsOf({3, 7})));
  EXPECT_EQ(longs(held.targets), (std::vector<int64_t>{1, 6}));
  const Batch train = quarter->trainBatch(firstIndices(8));
  EXPECT_TRUE(at::equal(train.inputs, modelPixelsOf({0, 1, 2, 4, 5, 6, 8, 9})));
  EXPECT_EQ(longs(train.targets), labelsOf({0, 1, 2, 4, 5, 6, 8, 9}));
  EXPECT_EQ(quarter->spec().classes, 7);  // held-out labels count too
  EXPECT_THROW(quarter->evalBatch(1, 2), Error);

  for (const double f : {0.1, 0.3, 0.5, 0.9}) {
    const std::vector<int64_t> heldRows = heldOutRows(10, f);
    const std::vector<int64_t> trainRows = complementOf(heldRows, 10);
    const auto ds = makeIdxDataset(options(f));
    ASSERT_EQ(ds->evalSamples(), static_cast<int64_t>(heldRows.size())) << f;
    ASSERT_EQ(ds->trainSamples(), static_cast<int64_t>(trainRows.size())) << f;
    const Batch e = ds->evalBatch(0, ds->evalSamples());
    EXPECT_TRUE(at::equal(e.inputs, modelPixelsOf(heldRows))) << f;
    EXPECT_EQ(longs(e.targets), labelsOf(heldRows)) << f;
    EXPECT_EQ(longs(ds->trainBatch(firstIndices(ds->trainSamples())).targets), labelsOf(trainRows)) << f;
  }
}

TEST_F(IdxDatasetTest, EvalFractionLeavingNoSplitIsAnError) {
  // Two samples hold none out at 0.3 (floor(0.6) = 0); all of them at 1.
  const std::string two = write("two-images", idxImages(pattern(2, 4, 3)));
  const std::string twoLabels = write("two-labels", idxLabels({0, 1}));
  DataOptions d = options(0.3);
  d.path = two;
  d.labels = twoLabels;
  EXPECT_NE(errorOf([&] { makeIdxDataset(d); }).find("too few samples"), std::string::npos);
  d.eval_fraction = 1.0;
  EXPECT_NE(errorOf([&] { makeIdxDataset(d); }).find("no training samples"), std::string::npos);
}

TEST_F(IdxDatasetTest, ImageSizeResizesEverySample) {
  DataOptions d = options(0.0);
  d.image_size = 2;
  const auto small = makeIdxDataset(d);
  EXPECT_EQ(small->spec().inputShape, (std::vector<int64_t>{1, 2, 2}));
  const Batch b = small->trainBatch({4});
  EXPECT_EQ(b.inputs.sizes().vec(), (std::vector<int64_t>{1, 1, 2, 2}));
  EXPECT_TRUE(at::equal(b.inputs[0], imaging::toModelPixels(imaging::resizeImage(images_[4].unsqueeze(0), 2, 2))));

  d.image_size = 6;
  const auto large = makeIdxDataset(d);
  EXPECT_EQ(large->spec().inputShape, (std::vector<int64_t>{1, 6, 6}));
  EXPECT_EQ(large->trainBatch({0, 1}).inputs.sizes().vec(), (std::vector<int64_t>{2, 1, 6, 6}));
}

TEST_F(IdxDatasetTest, EvalPathAndEvalLabelsAreTheHeldOutSplit) {
  const at::Tensor evalImages = pattern(3, 4, 3, 17);
  DataOptions d = options(0.25);  // ignored with eval_path
  d.eval_path = write("t10k-images", idxImages(evalImages));
  d.eval_labels = write("t10k-labels", idxLabels({2, 0, 6}));
  const auto ds = makeIdxDataset(d);
  EXPECT_EQ(ds->trainSamples(), 10);
  EXPECT_EQ(ds->evalSamples(), 3);
  const Batch e = ds->evalBatch(0, 3);
  EXPECT_TRUE(at::equal(e.inputs, imaging::toModelPixels(evalImages.unsqueeze(1))));
  EXPECT_EQ(longs(e.targets), (std::vector<int64_t>{2, 0, 6}));
  EXPECT_EQ(longs(ds->evalBatch(1, 1).targets), std::vector<int64_t>{0});
  EXPECT_EQ(ds->spec().classes, 7);

  // A held-out label the train labels never reach.
  DataOptions unknownClass = d;
  unknownClass.eval_labels = write("t10k-labels-7", idxLabels({2, 7, 6}));
  const std::string classMessage = errorOf([&] { makeIdxDataset(unknownClass); });
  EXPECT_NE(classMessage.find(unknownClass.eval_labels), std::string::npos) << classMessage;

  // Held-out images of another size.
  DataOptions otherSize = d;
  otherSize.eval_path = write("t10k-images-5x5", idxImages(pattern(3, 5, 5)));
  const std::string sizeMessage = errorOf([&] { makeIdxDataset(otherSize); });
  EXPECT_NE(sizeMessage.find(otherSize.eval_path), std::string::npos) << sizeMessage;
  // ... which image_size reconciles.
  otherSize.image_size = 4;
  EXPECT_EQ(makeIdxDataset(otherSize)->evalBatch(0, 3).inputs.sizes().vec(), (std::vector<int64_t>{3, 1, 4, 4}));
}

TEST_F(IdxDatasetTest, MissingLabelsFilesAreConfigErrors) {
  DataOptions d = options(0.0);
  d.labels = "";
  EXPECT_THROW(makeIdxDataset(d), ConfigError);
  d = options(0.0);
  d.eval_path = imagesPath_;
  EXPECT_THROW(makeIdxDataset(d), ConfigError);  // eval_path without eval_labels
}

// The files beside data.path name their own key: missing is the config's fault, damaged
// is the file's.
TEST_F(IdxDatasetTest, ErrorsOfTheOtherFilesNameTheirKey) {
  auto keyOf = [](const DataOptions& d, bool configError) {
    try {
      makeIdxDataset(d);
    } catch (const DataFileError& e) {
      EXPECT_EQ(e.configError(), configError) << e.what();
      return e.key();
    }
    return std::string("no DataFileError");
  };
  DataOptions d = options(0.0);
  d.labels = dir_ + "/none.gz";
  EXPECT_EQ(keyOf(d, true), "data.labels");
  d = options(0.0);
  d.labels = imagesPath_;  // an images file where the labels belong
  EXPECT_EQ(keyOf(d, false), "data.labels");
  d = options(0.0);
  d.eval_path = dir_ + "/none-images";
  d.eval_labels = d.labels;
  EXPECT_EQ(keyOf(d, true), "data.eval_path");
  d.eval_path = imagesPath_;
  d.eval_labels = imagesPath_;
  EXPECT_EQ(keyOf(d, false), "data.eval_labels");
}

TEST_F(IdxDatasetTest, MalformedFilesAreErrorsNamingTheFile) {
  const std::string images = idxImages(images_);
  std::string gz;
  {
    const std::string path = dir_ + "/whole.gz";
    writeGzip(path, images);
    gz = readFile(path);
  }
  // A gzip bomb: a 10x4x3 header, then 64 MiB of zeros (64 KiB compressed). Inflating stops
  // one chunk past the 136 bytes the header declares, not at 64 MiB.
  std::string bomb;
  {
    const std::string path = dir_ + "/bomb.gz";
    writeGzip(path, images.substr(0, 16) + std::string(size_t{64} << 20, '\0'));
    bomb = readFile(path);
  }
  struct Case {
    std::string name;
    std::string bytes;
    bool labels;           // read with readIdxLabels, else readIdxImages
    std::string expected;  // a part of the message besides the path
  };
  const std::vector<Case> cases = {
      {"bad-magic", idxImages(images_, 0x00000804), false, "magic"},
      {"garbage-magic", "GIF89a and more bytes", false, "magic"},
      {"truncated-pixels", images.substr(0, images.size() - 5), false, "truncated"},
      {"trailing-bytes", images + "xy", false, "trailing bytes"},
      {"truncated-header", images.substr(0, 10), false, "truncated header"},
      {"too-short", std::string("\x00\x00", 2), false, "too short"},
      {"no-images", idxImages(at::zeros({0, 4, 3}, at::kByte)), false, "dimension 0 is 0"},
      {"truncated.gz", gz.substr(0, gz.size() / 2), false, "gzip data is truncated or corrupt"},
      {"bomb.gz", bomb, false, "decompresses to more than the 136 bytes its IDX header declares"},
      {"labels-with-image-magic", images, true, "images file"},
      {"images-with-label-magic", idxLabels(labels_), false, "labels file"},
      {"truncated-labels", idxLabels(labels_).substr(0, 12), true, "truncated"},
  };
  for (const Case& c : cases) {
    const std::string path = write(c.name, c.bytes);
    const std::string message =
        c.labels ? errorOf([&] { readIdxLabels(path); }) : errorOf([&] { readIdxImages(path); });
    EXPECT_NE(message.find(path), std::string::npos) << c.name << ": " << message;
    EXPECT_NE(message.find(c.expected), std::string::npos) << c.name << ": " << message;
  }

  const std::string missing = dir_ + "/missing-idx3-ubyte";
  EXPECT_NE(errorOf([&] { readIdxImages(missing); }).find(missing), std::string::npos);
  EXPECT_NE(errorOf([&] { readIdxLabels(dir_); }).find(dir_), std::string::npos);  // a directory

  // Through the dataset: the bad file is named whichever of the four it is.
  DataOptions d = options(0.0);
  d.path = dir_ + "/truncated-pixels";
  EXPECT_NE(errorOf([&] { makeIdxDataset(d); }).find(d.path), std::string::npos);
  d = options(0.0);
  d.labels = missing;
  EXPECT_NE(errorOf([&] { makeIdxDataset(d); }).find(missing), std::string::npos);
}

TEST_F(IdxDatasetTest, LabelCountNotMatchingTheImagesNamesTheLabelsFile) {
  DataOptions d = options(0.0);
  d.labels = write("nine-labels", idxLabels({0, 1, 2, 3, 4, 5, 6, 0, 1}));
  const std::string message = errorOf([&] { makeIdxDataset(d); });
  EXPECT_NE(message.find(d.labels), std::string::npos) << message;
  EXPECT_NE(message.find("9 labels"), std::string::npos) << message;
}

TEST_F(IdxDatasetTest, FifoIsRefusedWithoutBlocking) {
  const std::string fifo = dir_ + "/fifo-idx3-ubyte";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string message = errorWithoutBlockingOn(fifo, [fifo] { readIdxImages(fifo); });
  EXPECT_NE(message.find(fifo), std::string::npos) << message;
  EXPECT_NE(message.find("FIFO"), std::string::npos) << message;
}

// --- image folders ----------------------------------------------------------------------

// data/<class>/<k>.png: classes written as cat, ant, bee (sorted: ant 0, bee 1, cat 2),
// two 4x4 RGB images each, beside files and folders the dataset must skip.
class ImageFolderDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = test::scratchPath("tessera_imgfolder", "data");
    int64_t salt = 0;
    for (const char* cls : {"cat", "ant", "bee"}) {
      for (int k = 0; k < 2; ++k) {
        const at::Tensor image = pattern(3, 4, 4, salt++);
        writeImage(root_ + "/" + cls + "/" + std::to_string(k) + ".png", image);
        images_[cls].push_back(image);
      }
    }
    writeFile(root_ + "/ant/notes.txt", "not an image");
    writeImage(root_ + "/bee/.hidden.png", pattern(3, 9, 9));
    writeImage(root_ + "/.cache/0.png", pattern(3, 9, 9));  // a hidden folder is no class
  }

  static void writeImage(const std::string& path, const at::Tensor& image) {
    fs::create_directories(fs::path(path).parent_path());
    imaging::writePng(path, image);
  }

  static DataOptions options(const std::string& path) {
    DataOptions d;
    d.kind = "image_folder";
    d.path = path;
    d.eval_fraction = 0.0;
    return d;
  }

  // The written images in the dataset's order (classes sorted, files sorted in each).
  std::vector<at::Tensor> inOrder() const {
    std::vector<at::Tensor> out;
    for (const char* cls : {"ant", "bee", "cat"}) {
      for (const at::Tensor& image : images_.at(cls)) out.push_back(image);
    }
    return out;
  }

  std::string root_;
  std::map<std::string, std::vector<at::Tensor>> images_;
};

TEST_F(ImageFolderDatasetTest, ClassesAreSortedFolderNamesAndSamplesFollowThem) {
  const auto ds = makeImageFolderDataset(options(root_));
  EXPECT_EQ(ds->trainSamples(), 6);
  EXPECT_EQ(ds->evalSamples(), 0);
  const DataSpec spec = ds->spec();
  EXPECT_EQ(spec.classes, 3);
  EXPECT_EQ(spec.inputShape, (std::vector<int64_t>{3, 4, 4}));
  EXPECT_TRUE(spec.hasTargets);
  const Batch b = ds->trainBatch(firstIndices(6));
  EXPECT_EQ(longs(b.targets), (std::vector<int64_t>{0, 0, 1, 1, 2, 2}));  // ant, ant, bee, bee, cat, cat
  EXPECT_EQ(b.inputs.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(b.inputs, imaging::toModelPixels(at::stack(inOrder()))));
  EXPECT_NE(ds->describe().find("3 classes"), std::string::npos) << ds->describe();
}

TEST_F(ImageFolderDatasetTest, EvalFractionSplitsEveryClass) {
  DataOptions d = options(root_);
  d.eval_fraction = 0.5;  // every odd sample: the second image of each class
  const auto ds = makeImageFolderDataset(d);
  EXPECT_EQ(ds->trainSamples(), 3);
  EXPECT_EQ(ds->evalSamples(), 3);
  EXPECT_EQ(longs(ds->evalBatch(0, 3).targets), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(longs(ds->trainBatch({0, 1, 2}).targets), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_TRUE(at::equal(ds->evalBatch(2, 1).inputs[0], imaging::toModelPixels(images_.at("cat")[1])));
}

TEST_F(ImageFolderDatasetTest, ChannelsOneReadsColourImagesAsGray) {
  DataOptions d = options(root_);
  d.channels = 1;
  const auto ds = makeImageFolderDataset(d);
  EXPECT_EQ(ds->spec().inputShape, (std::vector<int64_t>{1, 4, 4}));
  EXPECT_EQ(ds->trainBatch({0, 5}).inputs.sizes().vec(), (std::vector<int64_t>{2, 1, 4, 4}));
}

TEST_F(ImageFolderDatasetTest, ImageOfAnotherSizeIsAnErrorNamingItUnlessImageSizeIsSet) {
  const std::string odd = root_ + "/bee/1.png";  // sample 3
  const at::Tensor fiveByFive = pattern(3, 5, 5, 40);
  writeImage(odd, fiveByFive);

  // Images are decoded when their batch is read: the dataset opens, the batch fails.
  std::unique_ptr<Dataset> ds;
  ASSERT_NO_THROW(ds = makeImageFolderDataset(options(root_)));
  EXPECT_NO_THROW(ds->trainBatch({0, 1, 2, 4, 5}));
  const std::string message = errorOf([&] { ds->trainBatch({2, 3}); });
  EXPECT_NE(message.find(odd), std::string::npos) << message;
  EXPECT_NE(message.find("sample 3"), std::string::npos) << message;
  EXPECT_NE(message.find("5x5"), std::string::npos) << message;

  DataOptions d = options(root_);
  d.image_size = 4;
  const auto resized = makeImageFolderDataset(d);
  const Batch b = resized->trainBatch({3});
  EXPECT_EQ(b.inputs.sizes().vec(), (std::vector<int64_t>{1, 3, 4, 4}));
  EXPECT_TRUE(at::equal(b.inputs[0], imaging::toModelPixels(imaging::resizeImage(fiveByFive, 4, 4))));
  EXPECT_TRUE(at::equal(resized->trainBatch({0}).inputs[0], imaging::toModelPixels(images_.at("ant")[0])));

  d.image_size = 2;  // every image resized, those of the first's size too
  EXPECT_EQ(makeImageFolderDataset(d)->spec().inputShape, (std::vector<int64_t>{3, 2, 2}));
}

TEST_F(ImageFolderDatasetTest, UndecodableImageIsAnErrorNamingItWhenItsBatchIsRead) {
  const std::string bad = root_ + "/cat/bad.png";  // sorted after cat/0.png and cat/1.png: sample 6
  writeFile(bad, "this is not a PNG file");
  std::unique_ptr<Dataset> ds;
  ASSERT_NO_THROW(ds = makeImageFolderDataset(options(root_)));
  EXPECT_EQ(ds->trainSamples(), 7);
  EXPECT_NO_THROW(ds->trainBatch(firstIndices(6)));
  const std::string message = errorOf([&] { ds->trainBatch({6}); });
  EXPECT_NE(message.find(bad), std::string::npos) << message;
  // image_dataset.h: "Every problem names the file, and the index for a sample".
  EXPECT_NE(message.find("sample 6"), std::string::npos) << message;
}

TEST_F(ImageFolderDatasetTest, UndecodableFirstImageFailsWhenTheDatasetOpens) {
  const std::string bad = root_ + "/ant/0.png";  // the first file: read for the size and channels
  writeFile(bad, "this is not a PNG file");
  const std::string message = errorOf([&] { makeImageFolderDataset(options(root_)); });
  EXPECT_NE(message.find(bad), std::string::npos) << message;
}

TEST_F(ImageFolderDatasetTest, NonSquareFirstImageWithoutImageSizeIsAnError) {
  const std::string wide = root_ + "/ant/0.png";
  writeImage(wide, pattern(3, 4, 6));
  const std::string message = errorOf([&] { makeImageFolderDataset(options(root_)); });
  EXPECT_NE(message.find(wide), std::string::npos) << message;
  DataOptions d = options(root_);
  d.image_size = 4;
  EXPECT_EQ(makeImageFolderDataset(d)->trainBatch({0}).inputs.sizes().vec(), (std::vector<int64_t>{1, 3, 4, 4}));
}

TEST_F(ImageFolderDatasetTest, ClassFolderWithoutImagesIsAnError) {
  fs::remove(root_ + "/bee/0.png");
  fs::remove(root_ + "/bee/1.png");
  writeFile(root_ + "/bee/readme.txt", "no images here");  // and bee/.hidden.png does not count
  const std::string message = errorOf([&] { makeImageFolderDataset(options(root_)); });
  EXPECT_NE(message.find(root_), std::string::npos) << message;
  EXPECT_NE(message.find("'bee'"), std::string::npos) << message;
}

TEST_F(ImageFolderDatasetTest, FolderWithoutClassFoldersOrMissingIsAnError) {
  const std::string flat = test::scratchPath("tessera_imgfolder", "flat");
  writeImage(flat + "/0.png", pattern(3, 4, 4));
  const std::string message = errorOf([&] { makeImageFolderDataset(options(flat)); });
  EXPECT_NE(message.find(flat), std::string::npos) << message;
  EXPECT_NE(message.find("no class sub-folders"), std::string::npos) << message;

  const std::string missing = root_ + "/missing";
  EXPECT_NE(errorOf([&] { makeImageFolderDataset(options(missing)); }).find(missing), std::string::npos);
  const std::string file = root_ + "/ant/0.png";
  EXPECT_NE(errorOf([&] { makeImageFolderDataset(options(file)); }).find(file), std::string::npos);
}

TEST_F(ImageFolderDatasetTest, EvalPathUsesTheTrainClassIds) {
  const std::string evalRoot = test::scratchPath("tessera_imgfolder", "test");
  const at::Tensor catImage = pattern(3, 4, 4, 90);
  writeImage(evalRoot + "/cat/0.png", catImage);  // no ant or bee: a split may lack classes
  writeImage(evalRoot + "/ant/0.png", pattern(3, 4, 4, 91));
  DataOptions d = options(root_);
  d.eval_path = evalRoot;
  d.eval_fraction = 0.5;  // ignored with eval_path
  const auto ds = makeImageFolderDataset(d);
  EXPECT_EQ(ds->trainSamples(), 6);
  EXPECT_EQ(ds->evalSamples(), 2);
  EXPECT_EQ(ds->spec().classes, 3);
  const Batch e = ds->evalBatch(0, 2);
  EXPECT_EQ(longs(e.targets), (std::vector<int64_t>{0, 2}));  // ant, cat: the train split's ids
  EXPECT_TRUE(at::equal(e.inputs[1], imaging::toModelPixels(catImage)));
}

TEST_F(ImageFolderDatasetTest, EvalPathWithOtherClassFoldersIsAnError) {
  const std::string evalRoot = test::scratchPath("tessera_imgfolder", "test");
  writeImage(evalRoot + "/ant/0.png", pattern(3, 4, 4));
  writeImage(evalRoot + "/dog/0.png", pattern(3, 4, 4));
  DataOptions d = options(root_);
  d.eval_path = evalRoot;
  const std::string message = errorOf([&] { makeImageFolderDataset(d); });
  EXPECT_NE(message.find(evalRoot), std::string::npos) << message;
  EXPECT_NE(message.find("'dog'"), std::string::npos) << message;
}

}  // namespace
}  // namespace tessera::datasets
