// Image datasets as users keep them: the IDX files of MNIST and Fashion-MNIST (what
// torchvision reads; gzipped or not) and a folder per class (torchvision's ImageFolder:
// PNG and JPEG files, classes in sorted order of their folder names). Samples are
// [channels, height, width] images scaled to [-1, 1] with their class id as the target.
//
// Held-out samples come from separate files when data.eval_path is set (the test split),
// else every sample i with floor((i + 1) f) > floor(i f) for f = data.eval_fraction is
// held out: spread over the file, so every class is in both splits.
//
// IDX images are read into memory once (uint8, 47 MB for Fashion-MNIST's 60000); folder
// images are decoded when a batch asks for them (the trainer's loader thread does so
// ahead of the step, data_loader.h). Every problem names the file, and the index for a
// sample: a truncated or malformed IDX file, a label file whose count or type does not
// match, an undecodable image, an image of another size when data.image_size is 0.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "datasets/dataset.h"

namespace tessera::datasets {

struct DataOptions;

// IDX image file (magic 0x00000803: [N, H, W] uint8) -> [N, 1, H, W] uint8.
at::Tensor readIdxImages(const std::string& path);
// IDX label file (magic 0x00000801: [N] uint8) -> [N] int64.
at::Tensor readIdxLabels(const std::string& path);

// data.kind idx: data.path the images, data.labels the labels (data.eval_path and
// data.eval_labels: the held-out split), resized to data.image_size when it is set.
std::unique_ptr<Dataset> makeIdxDataset(const DataOptions& data);

// The images of image folder `root` (<root>/<class>/<image>.{png,jpg,jpeg}): class folders
// in sorted order of their names (or `classNames` when given, a held-out split's, which may
// lack some), files sorted within each. tessera::Error naming the folder when it holds none.
struct ImageFolderListing {
  std::vector<std::string> classNames;
  std::vector<std::string> files;
  std::vector<int64_t> labels;  // the class of each file: its index in classNames
};
ImageFolderListing listImageFolder(const std::string& root, std::vector<std::string> classNames = {});

// data.kind image_folder: data.path/<class>/<image>.{png,jpg,jpeg}, resized to
// data.image_size (0: every image must have the first one's size) with data.channels
// (0: the first image's).
std::unique_ptr<Dataset> makeImageFolderDataset(const DataOptions& data);

}  // namespace tessera::datasets
