// Writing WebDataset shards and their manifest (see shard_writer.h).
#include "datasets/shard_writer.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <vector>

#include "common/errors.h"
#include "common/file_open.h"
#include "datasets/data_options.h"
#include "datasets/image_dataset.h"
#include "datasets/tar_file.h"
#include "imaging/image_io.h"

namespace tessera::datasets {
namespace fs = std::filesystem;

namespace {

constexpr int64_t kMaxImageFileBytes = int64_t{256} << 20;

std::string numbered(const char* format, int64_t n) {
  char text[32];
  std::snprintf(text, sizeof text, format, static_cast<long long>(n));
  return text;
}

}  // namespace

ShardWriter::ShardWriter(std::string directory, std::string prefix, int64_t samplesPerShard)
    : directory_(std::move(directory)), prefix_(std::move(prefix)), samplesPerShard_(samplesPerShard) {
  TESSERA_CHECK_AS(ConfigError, samplesPerShard_ >= 1, "shards: ", samplesPerShard_, " samples per shard");
  std::error_code ec;
  fs::create_directories(directory_, ec);
  TESSERA_CHECK(!ec && fs::is_directory(directory_), "shard directory ", quote(directory_), ": cannot create it",
                ec ? strCat(" (", ec.message(), ")") : std::string());
  // Shards already there (a manifest, or the .tar files of an earlier write) would mix with these.
  for (const auto& entry : fs::directory_iterator(directory_)) {
    const std::string name = entry.path().filename().string();
    TESSERA_CHECK_AS(ConfigError, name != kShardManifestName && entry.path().extension() != ".tar",
                     "shard directory ", quote(directory_), " already holds shards ('", name,
                     "'); remove them or write to another directory");
  }
}

ShardWriter::~ShardWriter() {
  // Not finished (an input failed part-way): the shards written so far are removed, so the
  // directory can be written again.
  if (!finished_) discard();
}

void ShardWriter::discard() {
  shard_.reset();
  std::error_code ec;
  for (const ShardEntry& e : manifest_.shards) fs::remove(fs::path(directory_) / e.name, ec);
  if (finished_) fs::remove(fs::path(directory_) / kShardManifestName, ec);
  finished_ = true;
}

void ShardWriter::add(const std::string& image, const std::string& extension, int64_t label) {
  TESSERA_CHECK(extension == "png" || extension == "jpg", "shards: image extension '", extension, "'");
  TESSERA_CHECK(label >= 0, "shards: label ", label);
  if (!shard_) {
    shardName_ = prefix_ + numbered("-%06lld.tar", static_cast<int64_t>(manifest_.shards.size()));
    shard_ = std::make_unique<TarWriter>((fs::path(directory_) / shardName_).string());
  }
  const std::string key = numbered("%08lld", samples_);
  shard_->add(key + "." + extension, image);
  shard_->add(key + ".cls", std::to_string(label));
  manifest_.classes = std::max(manifest_.classes, label + 1);
  ++samples_;
  if (++inShard_ == samplesPerShard_) closeShard();
}

void ShardWriter::closeShard() {
  if (!shard_) return;
  ShardEntry entry;
  entry.name = shardName_;
  entry.samples = inShard_;
  entry.bytes = shard_->finish();
  shard_.reset();
  entry.xxh3 = fileXxh3((fs::path(directory_) / shardName_).string());
  manifest_.add(entry);
  inShard_ = 0;
}

ShardManifest ShardWriter::finish() {
  closeShard();
  TESSERA_CHECK(!manifest_.shards.empty(), "shard directory ", quote(directory_), ": no samples to write");
  writeShardManifest(directory_, manifest_);
  finished_ = true;
  return manifest_;
}

namespace {

// One split's samples, read (or listed) before anything is written: a mistake in the input
// leaves no half-written directory behind.
struct SplitSource {
  at::Tensor pixels, classes;  // idx: [N, 1, H, W] uint8 and [N]
  ImageFolderListing listing;  // image_folder
  bool idx = false;
};

SplitSource readSplit(const DataOptions& data, const std::string& images, const std::string& labels,
                      const std::vector<std::string>& classNames) {
  SplitSource source;
  source.idx = data.kind == "idx";
  if (source.idx) {
    source.pixels = readIdxImages(images);
    source.classes = readIdxLabels(labels);
    TESSERA_CHECK(source.classes.size(0) == source.pixels.size(0), "IDX labels file '", labels, "' holds ",
                  source.classes.size(0), " labels for the ", source.pixels.size(0), " images of '", images, "'");
  } else {
    source.listing = listImageFolder(images, classNames);
    // Every file within what a shard member may hold, before anything is written.
    for (const std::string& file : source.listing.files) {
      std::error_code ec;
      const auto bytes = static_cast<int64_t>(fs::file_size(file, ec));
      TESSERA_CHECK(!ec, "image ", quote(file), ": ", ec.message());
      TESSERA_CHECK(bytes <= kMaxImageFileBytes, "image ", quote(file), " holds ", bytes, " bytes, more than the ",
                    kMaxImageFileBytes, " a shard member may (nothing was written)");
    }
  }
  return source;
}

// `out` may be neither empty nor where the inputs are read from: shards written into an
// input folder would become part of it.
void checkOutputDirectory(const DataOptions& data, const std::string& out) {
  TESSERA_CHECK_AS(UsageError, !out.empty(), "--out is empty: name the directory to write train/ and eval/ into");
  std::error_code ec;
  const fs::path target = fs::weakly_canonical(fs::absolute(out), ec);
  for (const std::string& input : {data.path, data.eval_path}) {
    if (input.empty() || !fs::is_directory(input, ec)) continue;
    const fs::path folder = fs::weakly_canonical(fs::absolute(input), ec);
    const auto mismatch = std::mismatch(folder.begin(), folder.end(), target.begin(), target.end());
    TESSERA_CHECK_AS(UsageError, mismatch.first != folder.end(), "--out ", quote(out), " is in the input folder ",
                     quote(input), ": the shards would become part of the images they are made of; write elsewhere");
  }
}

// The split's samples into `writer`: IDX images encoded as PNG, image files as they are.
ShardManifest writeSplit(const SplitSource& source, ShardWriter& writer) {
  if (source.idx) {
    for (int64_t i = 0; i < source.pixels.size(0); ++i) {
      writer.add(imaging::encodePng(source.pixels[i]), "png", source.classes[i].item<int64_t>());
    }
    return writer.finish();
  }
  for (size_t i = 0; i < source.listing.files.size(); ++i) {
    const std::string& file = source.listing.files[i];
    std::string ext = fs::path(file).extension().string().substr(1);
    for (char& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    writer.add(readRegularFile(file, kMaxImageFileBytes), ext == "png" ? "png" : "jpg", source.listing.labels[i]);
  }
  return writer.finish();
}

}  // namespace

ShardWriteSummary writeImageShards(const DataOptions& data, const std::string& out, int64_t samplesPerShard) {
  TESSERA_CHECK_AS(ConfigError, data.kind == "idx" || data.kind == "image_folder",
                   "shards are written from data.kind idx or image_folder, not ", data.kind);
  TESSERA_CHECK_AS(ConfigError, data.kind != "idx" || !data.labels.empty(), "data.kind idx needs its labels file");
  TESSERA_CHECK_AS(ConfigError, data.kind != "idx" || data.eval_path.empty() || !data.eval_labels.empty(),
                   "the held-out IDX images need their labels file");
  checkOutputDirectory(data, out);
  const SplitSource train = readSplit(data, data.path, data.labels, {});
  std::optional<SplitSource> eval;
  if (!data.eval_path.empty()) eval = readSplit(data, data.eval_path, data.eval_labels, train.listing.classNames);
  ShardWriteSummary summary;
  summary.trainDirectory = (fs::path(out) / "train").string();
  if (eval) summary.evalDirectory = (fs::path(out) / "eval").string();
  ShardWriter trainWriter(summary.trainDirectory, "train", samplesPerShard);
  std::unique_ptr<ShardWriter> evalWriter;
  if (eval) evalWriter = std::make_unique<ShardWriter>(summary.evalDirectory, "eval", samplesPerShard);
  summary.train = writeSplit(train, trainWriter);
  try {
    if (eval) summary.eval = writeSplit(*eval, *evalWriter);
  } catch (...) {
    trainWriter.discard();  // the corrected command can then write train/ again
    throw;
  }
  return summary;
}

}  // namespace tessera::datasets
