// data.*: the keys of the training data (data_options.h).
#include "datasets/data_options.h"

#include "common/config.h"
#include "common/limits.h"

namespace tessera::datasets {

bool isImageKind(const std::string& kind) { return kind == "idx" || kind == "image_folder" || kind == "webdataset"; }

// data.*: the dataset, the batch sizes and the held-out fraction.
void bindDataKeys(config::ConfigSchema& s, DataOptions& data) {
  s.describeSection("data", "Training data");
  s.add("data.kind", &data.kind,
        "Dataset kind: text (bytes), tokens (flat binary token ids), tensors (safetensors 'inputs' and 'targets'), "
        "idx (MNIST-format images and labels, gzipped or not), image_folder (<path>/<class>/<image>.png|jpg) or "
        "webdataset (tar shards of KEY.png|jpg with KEY.cls|json, streamed)")
      .oneOf({"text", "tokens", "tensors", "idx", "image_folder", "webdataset"});
  s.add("data.path", &data.path,
        "Input file (text: any file, read as bytes; tokens: little-endian ids; tensors: a safetensors file with "
        "'inputs' [N, ...] and optional 'targets': integer class ids [N] for cross-entropy, floats for "
        "mean-squared error; webdataset: a directory of .tar shards, a glob or a brace list "
        "such as shards/train-{000000..000099}.tar)")
      .required()
      .nonEmpty();
  s.add("data.labels", &data.labels, "idx: the labels file (idx1) of data.path");
  s.add("data.eval_path", &data.eval_path,
        "idx, image_folder, webdataset: held-out images (the test split) instead of data.eval_fraction of "
        "data.path (webdataset: shards as data.path names them; without it no samples are held out)");
  s.add("data.eval_labels", &data.eval_labels, "idx: the labels file of data.eval_path");
  s.add("data.image_size", &data.image_size, "images (idx, image_folder, webdataset): resize images to this square size (0: as stored)")
      .min(0).max(1 << 14);
  s.add("data.channels", &data.channels, "image_folder, webdataset: 1 (gray) or 3 (RGB); 0: the first image's")
      .min(0).max(3);
  s.add("data.shuffle_buffer", &data.shuffle_buffer,
        "webdataset: samples held in the shuffle buffer (a larger one mixes more shards at once; memory holds "
        "references, not images)")
      .min(1).max(int64_t{1} << 24);
  s.add("data.on_error", &data.on_error,
        "webdataset: fail (a damaged shard or sample stops the run, named) or skip (a shard truncated at start is "
        "left out; a sample that cannot be read gives its row to the next readable one, counted in the log)")
      .oneOf({"fail", "skip"});
  s.add("data.hflip", &data.hflip, "images: flip each training sample horizontally with probability 1/2");
  s.add("data.token_dtype", &data.token_dtype, "tokens: width of each id in the file").oneOf({"uint16", "uint32"});
  s.add("data.global_batch", &data.global_batch, "Samples per optimizer step over all ranks").min(1).max(kMaxBatch);
  s.add("data.micro_batch", config::IntOrWordTarget{&data.micro_batch, "auto", kAutoMicroBatch},
        "Samples per forward/backward on one rank, at most (the largest that divides a rank's share of "
        "data.global_batch is used); auto: a rank's whole share, no gradient accumulation")
      .min(1)
      .max(kMaxBatch);
  s.add("data.shuffle", &data.shuffle, "Seeded shuffle per epoch; false reads samples in file order");
  s.add("data.eval_fraction", &data.eval_fraction, "Fraction at the end of the file held out for evaluation")
      .min(0.0).lessThan(1.0);
}

}  // namespace tessera::datasets
