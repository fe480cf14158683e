// TensorBoard event files: <dir>/events.out.tfevents.<time>.<host>, a sequence of TFRecords
// (length, masked CRC-32C of the length, data, masked CRC-32C of the data) whose data is a
// serialised tensorboard.Event (tensorboard_summary.proto). TensorBoard, tbparse or
// tf.data read them; nothing here depends on TensorFlow.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tessera::observe {

// CRC-32C (Castagnoli) of `data`, and TFRecord's masked form of it: a CRC stored next to
// data that itself holds CRCs is rotated and offset so the two cannot be confused.
uint32_t crc32c(const std::string& data);
uint32_t maskedCrc32c(const std::string& data);

// One TFRecord holding `data`: what an event file is a sequence of.
std::string frameRecord(const std::string& data);

// A PNG to show as an image: its bytes and its size (TensorBoard shows the bytes as given).
struct EncodedImage {
  std::string png;
  int height = 0;
  int width = 0;
  int channels = 0;  // 1 gray, 3 RGB
};

class TensorBoardWriter {
 public:
  // Creates `dir` when missing and a new event file in it (a resumed run writes a second
  // file: TensorBoard reads every file of a directory as one run). The file starts with
  // the file-version record. Throws tessera::Error naming the file when it cannot write.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One event at `step` holding every (tag, value); written through to the file, so a
  // TensorBoard watching the directory sees it at once and a crash loses nothing written.
  void addScalars(int64_t step, const std::vector<std::pair<std::string, double>>& scalars);
  void addImage(int64_t step, const std::string& tag, const EncodedImage& image);

  const std::string& path() const { return path_; }

 private:
  void writeEvent(const std::string& serialisedEvent);
  std::string path_;
  int fd_ = -1;
};

}  // namespace tessera::observe
