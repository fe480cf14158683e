// The training data's options (data.*): which dataset, where, the batch sizes and the
// held-out split; bindDataKeys() registers them with a config schema.
#pragma once

#include <cstdint>
#include <string>

namespace tessera::config {
class ConfigSchema;
}

namespace tessera::datasets {

// data.micro_batch: auto, as held until finishTrainConfig resolves it for the world size.
constexpr int64_t kAutoMicroBatch = 0;

struct DataOptions {
  std::string kind = "text";   // text (byte-level) | tokens (flat uint16/uint32 ids) | tensors (safetensors) | idx | image_folder | webdataset
  std::string path = "";       // input file (image_folder: the folder; webdataset: the shards); required
  std::string labels = "";     // idx: the labels file of `path`
  std::string eval_path = "";  // idx, image_folder, webdataset: the held-out split's images (instead of eval_fraction)
  std::string eval_labels = "";// idx: the labels file of eval_path
  int64_t image_size = 0;      // idx, image_folder: resize to image_size x image_size (0: as stored)
  int64_t channels = 0;        // image_folder, webdataset: 1 or 3 (0: the first image's)
  int64_t shuffle_buffer = 1000;  // webdataset: samples in the shuffle buffer
  std::string on_error = "fail";  // webdataset: fail | skip (a damaged sample gives its row to the next readable one)
  bool hflip = false;          // images: flip each training sample horizontally with probability 1/2
  std::string token_dtype = "uint16";  // tokens: uint16 | uint32
  int64_t global_batch = 32;   // samples per optimizer step over all ranks
  int64_t micro_batch = 16;    // samples per forward/backward on one rank (finishTrainConfig may lower it;
                               // auto, kAutoMicroBatch: a rank's whole share)
  // The micro_batch the config asked for, when it does not divide the samples a rank gets
  // per step (global_batch / world size) on this world size: micro_batch is then the
  // largest that does, and the run says so. 0: as asked.
  int64_t micro_batch_asked = 0;
  bool shuffle = true;         // seeded shuffle per epoch; false reads in file order
  double eval_fraction = 0.05; // tail of the file held out for evaluation
};

// Whether data.kind `kind` holds images (idx, image_folder, webdataset): what image models
// and the image keys (data.image_size, data.hflip, ...) need.
bool isImageKind(const std::string& kind);

// Registers data.* with `schema` (bound by pointer to `data`).
void bindDataKeys(config::ConfigSchema& schema, DataOptions& data);

}  // namespace tessera::datasets
