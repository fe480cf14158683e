// IDX and image-folder datasets (see image_dataset.h).
#include "datasets/image_dataset.h"

#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <new>
#include <vector>

#include "common/errors.h"
#include "common/file_open.h"
#include "imaging/image_io.h"
#include "imaging/image_ops.h"
#include "datasets/data_options.h"

namespace tessera::datasets {
namespace fs = std::filesystem;

namespace {

constexpr int64_t kMaxFileBytes = int64_t{1} << 32;  // an IDX file (compressed or not) above 4 GiB is refused

uint32_t bigEndian32(const std::string& bytes, size_t at) {
  uint32_t v = 0;
  for (size_t i = 0; i < 4; ++i) v = (v << 8) | static_cast<unsigned char>(bytes[at + i]);
  return v;
}

// The size an IDX file of `dims` dimensions declares (header + data), read from the first
// bytes of `bytes`; 0 while they are too few, or when the header is not one (idxDims then
// says what is wrong with it).
int64_t declaredIdxBytes(const std::string& bytes, int dims) {
  const size_t header = 4 + 4 * static_cast<size_t>(dims);
  if (bytes.size() < header || bigEndian32(bytes, 0) != (0x0800u | static_cast<uint32_t>(dims))) return 0;
  int64_t count = 1;
  for (int d = 0; d < dims; ++d) {
    const int64_t size = std::max<int64_t>(1, bigEndian32(bytes, 4 + 4 * static_cast<size_t>(d)));
    if (count > kMaxFileBytes / size) return 0;  // count * size > kMaxFileBytes, checked before it can overflow
    count *= size;
  }
  return static_cast<int64_t>(header) + count;
}

// The bytes of IDX file `path` (`dims` dimensions), gunzipped when they are gzip (magic
// 1f 8b). Inflating stops one byte past the size the header declares, so a small file
// that inflates to gigabytes (a gzip bomb) costs no more memory than the data it claims.
std::string readMaybeGzipped(const std::string& path, int dims) {
  std::string raw = readRegularFile(path, kMaxFileBytes);
  if (raw.size() < 2 || static_cast<unsigned char>(raw[0]) != 0x1f || static_cast<unsigned char>(raw[1]) != 0x8b) {
    return raw;
  }
  z_stream z{};
  TESSERA_CHECK(inflateInit2(&z, 16 + MAX_WBITS) == Z_OK, "'", path, "': zlib could not start");
  std::string out;
  z.next_in = reinterpret_cast<Bytef*>(raw.data());
  z.avail_in = static_cast<uInt>(std::min<size_t>(raw.size(), UINT32_MAX));
  int status = Z_OK;
  int64_t declared = 0;
  constexpr size_t kChunk = size_t{1} << 20;
  try {
    while (status == Z_OK) {
      if (declared == 0) {
        declared = declaredIdxBytes(out, dims);
        // Room for what the header declares, up to what the compressed bytes can hold
        // (deflate inflates at most ~1032:1): a forged header reserves nothing large.
        const size_t room = std::min(static_cast<size_t>(declared), raw.size() * 1032);
        if (declared > 0) out.reserve(room + kChunk);
      }
      const int64_t limit = declared > 0 ? declared : kMaxFileBytes;
      if (static_cast<int64_t>(out.size()) > limit) {
        inflateEnd(&z);
        throw Error(strCat("'", path, "': decompresses to more than the ", limit, " bytes ",
                           declared > 0 ? "its IDX header declares" : "a data file may hold"));
      }
      const size_t before = out.size();
      out.resize(before + kChunk);
      z.next_out = reinterpret_cast<Bytef*>(out.data() + before);
      z.avail_out = static_cast<uInt>(kChunk);
      status = inflate(&z, Z_NO_FLUSH);
      out.resize(before + (kChunk - z.avail_out));
      if (status == Z_BUF_ERROR && z.avail_in == 0) break;  // input ended before the stream did
    }
  } catch (const std::bad_alloc&) {
    inflateEnd(&z);
    throw Error(strCat("'", path, "': out of memory decompressing it (", out.size(), " bytes so far",
                       declared > 0 ? strCat(", its header declares ", declared) : std::string(), ")"));
  }
  inflateEnd(&z);
  TESSERA_CHECK(status == Z_STREAM_END, "'", path, "': gzip data is truncated or corrupt",
                z.msg != nullptr ? strCat(" (", z.msg, ")") : std::string());
  return out;
}

// The dimensions of an IDX file of unsigned bytes with `dims` dimensions, after checking
// its magic and that its size is exactly header + data.
std::vector<int64_t> idxDims(const std::string& bytes, const std::string& path, int dims, const char* what) {
  const size_t header = 4 + 4 * static_cast<size_t>(dims);
  TESSERA_CHECK(bytes.size() >= 4, "IDX ", what, " file '", path, "': ", bytes.size(), " bytes, too short for a header");
  const uint32_t magic = bigEndian32(bytes, 0);
  TESSERA_CHECK(magic == (0x0800u | static_cast<uint32_t>(dims)), "IDX ", what, " file '", path, "': magic 0x", std::hex,
                magic, std::dec, ", expected 0x", std::hex, 0x0800u | static_cast<uint32_t>(dims), std::dec,
                " (unsigned bytes, ", dims, " dimensions)", magic == 0x0803u || magic == 0x0801u ? strCat(
                    ": is it the ", magic == 0x0803u ? "images" : "labels", " file?") : std::string());
  TESSERA_CHECK(bytes.size() >= header, "IDX ", what, " file '", path, "': truncated header");
  std::vector<int64_t> out;
  int64_t count = 1;
  for (int d = 0; d < dims; ++d) {
    out.push_back(bigEndian32(bytes, 4 + 4 * static_cast<size_t>(d)));
    TESSERA_CHECK(out.back() >= 1 && out.back() < (int64_t{1} << 31), "IDX ", what, " file '", path, "': dimension ",
                  d, " is ", out.back());
    count *= out.back();
    TESSERA_CHECK(count <= kMaxFileBytes, "IDX ", what, " file '", path, "': dimensions hold more than ", kMaxFileBytes,
                  " values");
  }
  TESSERA_CHECK(bytes.size() == header + static_cast<size_t>(count), "IDX ", what, " file '", path, "': ",
                bytes.size() - header, " data bytes for dimensions holding ", count,
                bytes.size() < header + static_cast<size_t>(count) ? " (truncated)" : " (trailing bytes)");
  return out;
}

at::Tensor bytesAsTensor(const std::string& bytes, size_t offset, std::vector<int64_t> shape) {
  at::Tensor t = at::empty(shape, at::kByte);
  std::copy_n(bytes.data() + offset, t.numel(), reinterpret_cast<char*>(t.data_ptr<uint8_t>()));
  return t;
}

}  // namespace

at::Tensor readIdxImages(const std::string& path) {
  const std::string bytes = readMaybeGzipped(path, 3);
  const std::vector<int64_t> d = idxDims(bytes, path, 3, "images");
  return bytesAsTensor(bytes, 16, {d[0], 1, d[1], d[2]});
}

at::Tensor readIdxLabels(const std::string& path) {
  const std::string bytes = readMaybeGzipped(path, 1);
  const std::vector<int64_t> d = idxDims(bytes, path, 1, "labels");
  return bytesAsTensor(bytes, 8, {d[0]}).to(at::kLong);
}

namespace {

bool isImageFile(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  return ext == ".png" || ext == ".jpg" || ext == ".jpeg";
}

}  // namespace

ImageFolderListing listImageFolder(const std::string& root, std::vector<std::string> classNames) {
  ImageFolderListing out;
  out.classNames = std::move(classNames);
  std::error_code ec;
  TESSERA_CHECK(fs::is_directory(root, ec), "image folder ", quote(root), ": not a directory", relativePathNote(root));
  const bool given = !out.classNames.empty();
  if (given) {  // a held-out split: its class folders must be the train split's
    for (const auto& entry : fs::directory_iterator(root)) {
      const std::string name = entry.path().filename().string();
      TESSERA_CHECK(!entry.is_directory() || name.front() == '.' ||
                        std::find(out.classNames.begin(), out.classNames.end(), name) != out.classNames.end(),
                    "image folder ", quote(root), ": class folder ", quote(name), " is not a class of the train split");
    }
  } else {
    for (const auto& entry : fs::directory_iterator(root)) {
      if (entry.is_directory() && entry.path().filename().string().front() != '.') {
        out.classNames.push_back(entry.path().filename().string());
      }
    }
    std::sort(out.classNames.begin(), out.classNames.end());
    TESSERA_CHECK(!out.classNames.empty(), "image folder ", quote(root), ": no class sub-folders (expected ", root,
                  "/<class>/<image>.png)");
    TESSERA_CHECK(static_cast<int64_t>(out.classNames.size()) <= kMaxClasses, "image folder ", quote(root), ": ",
                  out.classNames.size(), " class folders");
  }
  for (size_t c = 0; c < out.classNames.size(); ++c) {
    const fs::path dir = fs::path(root) / out.classNames[c];
    if (given && !fs::is_directory(dir, ec)) continue;  // a held-out split may lack a class
    std::vector<std::string> files;
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (isImageFile(entry.path()) && entry.path().filename().string().front() != '.') files.push_back(entry.path().string());
    }
    std::sort(files.begin(), files.end());
    TESSERA_CHECK(given || !files.empty(), "image folder ", quote(root), ": class folder ", quote(out.classNames[c]),
                  " holds no .png, .jpg or .jpeg file");
    for (std::string& f : files) {
      out.files.push_back(std::move(f));
      out.labels.push_back(static_cast<int64_t>(c));
    }
  }
  TESSERA_CHECK(!out.files.empty(), "image folder ", quote(root), ": no images");
  return out;
}

namespace {

// Where a dataset's images come from: one split's files.
class ImageSource {
 public:
  virtual ~ImageSource() = default;
  virtual int64_t size() const = 0;
  virtual at::Tensor pixels(int64_t i) const = 0;  // [C, H, W] uint8 at the dataset's size
  virtual int64_t label(int64_t i) const = 0;
  virtual std::string describe() const = 0;
};

// `read(path)` of the file the data key `key` names, its errors as DataFileErrors naming
// the key (a missing file and a ConfigError as the config's fault).
template <typename Read>
auto readDataFile(const char* key, const std::string& path, Read read) {
  std::error_code missing;
  if (!fs::exists(path, missing)) throw DataFileError(key, strCat("no file at '", path, "'"), true);
  try {
    return read(path);
  } catch (const DataFileError&) {
    throw;
  } catch (const ConfigError& e) {
    throw DataFileError(key, e.what(), true);
  } catch (const std::exception& e) {
    throw DataFileError(key, e.what(), false);
  }
}

// The keys an IDX split's two files come from: data.path and data.labels, or
// data.eval_path and data.eval_labels.
struct IdxKeys {
  const char* images;
  const char* labels;
};

// IDX images and labels, in memory.
class IdxSource : public ImageSource {
 public:
  IdxSource(const std::string& imagesPath, const std::string& labelsPath, int64_t imageSize, IdxKeys keys)
      : images_(readDataFile(keys.images, imagesPath, readIdxImages)),
        labels_(readDataFile(keys.labels, labelsPath, readIdxLabels)),
        path_(imagesPath) {
    if (labels_.size(0) != images_.size(0)) {
      throw DataFileError(keys.labels, strCat("IDX labels file '", labelsPath, "' holds ", labels_.size(0),
                                              " labels for the ", images_.size(0), " images of '", imagesPath, "'"),
                          false);
    }
    // Resized when a batch asks, as image folders are: the whole file resized at once would
    // hold every image at data.image_size (the run checks a batch's size before it starts).
    if (imageSize > 0 && (images_.size(2) != imageSize || images_.size(3) != imageSize)) resizeTo_ = imageSize;
  }
  int64_t size() const override { return images_.size(0); }
  at::Tensor pixels(int64_t i) const override {
    return resizeTo_ > 0 ? imaging::resizeImage(images_[i], resizeTo_, resizeTo_) : images_[i];
  }
  int64_t label(int64_t i) const override { return labels_[i].item<int64_t>(); }
  std::string describe() const override {
    const int64_t h = resizeTo_ > 0 ? resizeTo_ : images_.size(2), w = resizeTo_ > 0 ? resizeTo_ : images_.size(3);
    return strCat(path_, " (", images_.size(0), " images ", images_.size(1), "x", h, "x", w, ")");
  }
  at::Tensor allLabels() const { return labels_; }

 private:
  at::Tensor images_;  // [N, 1, H, W] uint8, as stored
  at::Tensor labels_;  // [N] int64
  std::string path_;
  int64_t resizeTo_ = 0;  // data.image_size when it differs from the stored size
};

// A folder per class; images decoded on demand.
class FolderSource : public ImageSource {
 public:
  // `classNames`: the classes in order (the train split's; the held-out split must use
  // the same names). Empty: this folder's sub-folders, sorted.
  FolderSource(const std::string& root, std::vector<std::string> classNames, int64_t imageSize, int channels)
      : root_(root), size_(imageSize), channels_(channels) {
    ImageFolderListing listing = listImageFolder(root, std::move(classNames));
    classNames_ = std::move(listing.classNames);
    files_ = std::move(listing.files);
    labels_ = std::move(listing.labels);
    if (channels_ == 0 || size_ == 0) {
      const at::Tensor first = imaging::readImage(files_.front(), channels_);
      if (channels_ == 0) channels_ = static_cast<int>(first.size(0));
      if (size_ == 0) {
        TESSERA_CHECK(first.size(1) == first.size(2), "image ", quote(files_.front()), " is ", first.size(2), "x",
                      first.size(1), ": not square; set data.image_size to resize every image");
        size_ = first.size(1);
        resize_ = false;
      }
    }
  }
  int64_t size() const override { return static_cast<int64_t>(files_.size()); }
  at::Tensor pixels(int64_t i) const override {
    const std::string& file = files_[static_cast<size_t>(i)];
    at::Tensor image;
    try {
      image = imaging::readImage(file, channels_);
    } catch (const Error& e) {
      throw Error(strCat(e.what(), " (sample ", i, " of image folder ", quote(root_), ")"));
    }
    if (resize_) return imaging::resizeImage(image, size_, size_);
    TESSERA_CHECK(image.size(1) == size_ && image.size(2) == size_, "image ", quote(file), " (sample ", i, ") is ",
                  image.size(2), "x", image.size(1), ", not the ", size_, "x", size_,
                  " of the first; set data.image_size to resize every image");
    return image;
  }
  int64_t label(int64_t i) const override { return labels_[static_cast<size_t>(i)]; }
  std::string describe() const override {
    return strCat(root_, " (", files_.size(), " images in ", classNames_.size(), " classes, ", channels_, "x", size_, "x",
                  size_, ")");
  }
  const std::vector<std::string>& classNames() const { return classNames_; }
  int64_t imageSize() const { return size_; }
  int channels() const { return channels_; }

 private:
  std::string root_;
  std::vector<std::string> classNames_;
  std::vector<std::string> files_;
  std::vector<int64_t> labels_;
  int64_t size_;
  int channels_;
  bool resize_ = true;
};

// Train and held-out samples of one or two sources.
class ImageDataset : public Dataset {
 public:
  ImageDataset(std::unique_ptr<ImageSource> train, std::unique_ptr<ImageSource> eval, double evalFraction, int64_t classes)
      : train_(std::move(train)), eval_(std::move(eval)), classes_(classes) {
    if (eval_) {
      for (int64_t i = 0; i < train_->size(); ++i) trainIndex_.push_back(i);
      for (int64_t i = 0; i < eval_->size(); ++i) evalIndex_.push_back(i);
    } else {
      // Sample i is held out when floor((i + 1) f) passes an integer: spread over the file.
      for (int64_t i = 0; i < train_->size(); ++i) {
        const bool held = static_cast<int64_t>(static_cast<double>(i + 1) * evalFraction) >
                          static_cast<int64_t>(static_cast<double>(i) * evalFraction);
        (held ? evalIndex_ : trainIndex_).push_back(i);
      }
    }
    TESSERA_CHECK(!trainIndex_.empty(), "dataset ", train_->describe(), ": no training samples left");
    TESSERA_CHECK(evalFraction == 0.0 || eval_ || !evalIndex_.empty(), "dataset ", train_->describe(),
                  ": too few samples to hold out data.eval_fraction ", evalFraction);
    const at::Tensor first = train_->pixels(trainIndex_.front());
    shape_ = first.sizes().vec();
  }

  int64_t trainSamples() const override { return static_cast<int64_t>(trainIndex_.size()); }
  int64_t evalSamples() const override { return static_cast<int64_t>(evalIndex_.size()); }
  Batch trainBatch(const std::vector<int64_t>& indices) const override {
    for (int64_t i : indices) {
      TESSERA_CHECK(i >= 0 && i < trainSamples(), "image dataset: train sample ", i, " out of range [0, ", trainSamples(), ")");
    }
    std::vector<int64_t> rows;
    for (int64_t i : indices) rows.push_back(trainIndex_[static_cast<size_t>(i)]);
    return gather(*train_, rows);
  }
  Batch evalBatch(int64_t first, int64_t n) const override {
    TESSERA_CHECK(first >= 0 && n >= 0 && first + n <= evalSamples(), "image dataset: held-out samples [", first, ", ",
                  first + n, ") out of range [0, ", evalSamples(), ")");
    std::vector<int64_t> rows(evalIndex_.begin() + first, evalIndex_.begin() + first + n);
    return gather(eval_ ? *eval_ : *train_, rows);
  }
  DataSpec spec() const override {
    DataSpec s;
    s.inputShape = shape_;
    s.hasTargets = true;
    s.classes = classes_;
    return s;
  }
  std::string describe() const override {
    return strCat(train_->describe(), eval_ ? strCat(", held out: ", eval_->describe()) : std::string(), "; ",
                  classes_, " classes; ", trainSamples(), " train and ", evalSamples(), " held-out samples");
  }

 private:
  Batch gather(const ImageSource& source, const std::vector<int64_t>& rows) const {
    Batch b;
    std::vector<at::Tensor> images;
    std::vector<int64_t> labels;
    for (int64_t r : rows) {
      images.push_back(source.pixels(r));
      labels.push_back(source.label(r));
    }
    b.inputs = images.empty() ? at::empty({0}, at::kFloat) : imaging::toModelPixels(at::stack(images));
    b.targets = at::tensor(labels, at::kLong);
    return b;
  }

  std::unique_ptr<ImageSource> train_, eval_;
  int64_t classes_;
  std::vector<int64_t> trainIndex_, evalIndex_;
  std::vector<int64_t> shape_;
};

int64_t classesOfLabels(const at::Tensor& labels, const std::string& path) {
  const int64_t largest = labels.max().item<int64_t>();
  TESSERA_CHECK(largest < kMaxClasses, "IDX labels file '", path, "': label ", largest, " (at most ", kMaxClasses,
                " classes)");
  return largest + 1;
}

}  // namespace

std::unique_ptr<Dataset> makeIdxDataset(const DataOptions& data) {
  TESSERA_CHECK_AS(ConfigError, !data.labels.empty(), "data.labels: data.kind idx needs the labels file of data.path");
  auto train = std::make_unique<IdxSource>(data.path, data.labels, data.image_size, IdxKeys{"data.path", "data.labels"});
  const int64_t classes = readDataFile("data.labels", data.labels,
                                       [&](const std::string& path) { return classesOfLabels(train->allLabels(), path); });
  std::unique_ptr<IdxSource> eval;
  if (!data.eval_path.empty()) {
    TESSERA_CHECK_AS(ConfigError, !data.eval_labels.empty(), "data.eval_labels: data.eval_path needs its labels file");
    eval = std::make_unique<IdxSource>(data.eval_path, data.eval_labels, data.image_size,
                                       IdxKeys{"data.eval_path", "data.eval_labels"});
    const int64_t evalClasses = readDataFile("data.eval_labels", data.eval_labels, [&](const std::string& path) {
      return classesOfLabels(eval->allLabels(), path);
    });
    if (evalClasses > classes) {
      throw DataFileError("data.eval_labels",
                          strCat("IDX labels file '", data.eval_labels, "' holds label ", evalClasses - 1,
                                 ", a class the train labels '", data.labels, "' never name (", classes, " classes)"),
                          false);
    }
    const at::Tensor a = train->pixels(0), b = eval->pixels(0);
    if (a.sizes() != b.sizes()) {
      throw DataFileError("data.eval_path",
                          strCat("IDX images file '", data.eval_path, "' holds ", b.sizes(), " images; '", data.path,
                                 "' holds ", a.sizes()),
                          false);
    }
  }
  return std::make_unique<ImageDataset>(std::move(train), std::move(eval), data.eval_fraction, classes);
}

namespace {

// makeImageFolderDataset without the translation of filesystem errors.
std::unique_ptr<Dataset> makeFolderDataset(const DataOptions& data) {
  auto train = std::make_unique<FolderSource>(data.path, std::vector<std::string>{}, data.image_size, data.channels);
  const std::vector<std::string> classes = train->classNames();
  std::unique_ptr<FolderSource> eval;
  if (!data.eval_path.empty()) {
    eval = readDataFile("data.eval_path", data.eval_path, [&](const std::string& path) {
      auto source = std::make_unique<FolderSource>(path, classes, data.image_size, train->channels());
      TESSERA_CHECK(source->imageSize() == train->imageSize(), "image folder '", path, "' holds ", source->imageSize(),
                    "x", source->imageSize(), " images, '", data.path, "' ", train->imageSize(), "x",
                    train->imageSize(), ": set data.image_size to resize both");
      return source;
    });
  }
  return std::make_unique<ImageDataset>(std::move(train), std::move(eval), data.eval_fraction,
                                        static_cast<int64_t>(classes.size()));
}

}  // namespace

std::unique_ptr<Dataset> makeImageFolderDataset(const DataOptions& data) {
  try {
    return makeFolderDataset(data);
  } catch (const fs::filesystem_error& e) {  // an unreadable folder while listing it
    throw Error(strCat("image folder: ", e.what()));
  }
}

}  // namespace tessera::datasets
