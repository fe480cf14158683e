// TensorBoard event-file writer (see tensorboard_writer.h).
#include "observe/tensorboard_writer.h"

#include <isa-l/crc.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "common/errors.h"
#include "common/file_open.h"
#include "tensorboard_summary.pb.h"

namespace tessera::observe {
namespace {

double wallTime() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string hostName() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  std::string host(name);
  for (char& c : host) {
    if (c == '/' || c == '\\') c = '_';  // the name becomes part of a file name
  }
  return host;
}

std::string littleEndian(uint64_t value, int bytes) {
  std::string out(static_cast<size_t>(bytes), '\0');
  for (int i = 0; i < bytes; ++i) out[static_cast<size_t>(i)] = static_cast<char>((value >> (8 * i)) & 0xff);
  return out;
}

}  // namespace

uint32_t crc32c(const std::string& data) {
  // ISA-L's crc32_iscsi neither inverts its start value nor its result; CRC-32C does both.
  auto* bytes = reinterpret_cast<unsigned char*>(const_cast<char*>(data.data()));  // read only; ISA-L takes no const
  uint32_t crc = 0xffffffffu;
  size_t done = 0;
  while (done < data.size()) {  // crc32_iscsi takes an int length
    const size_t chunk = std::min<size_t>(data.size() - done, size_t{1} << 30);
    crc = crc32_iscsi(bytes + done, static_cast<int>(chunk), crc);
    done += chunk;
  }
  return crc ^ 0xffffffffu;
}

uint32_t maskedCrc32c(const std::string& data) {
  const uint32_t crc = crc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string frameRecord(const std::string& data) {
  const std::string length = littleEndian(data.size(), 8);
  return length + littleEndian(maskedCrc32c(length), 4) + data + littleEndian(maskedCrc32c(data), 4);
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::filesystem::create_directories(dir);
  const double now = wallTime();
  // Two writers started within a second (a quick restart) must not share a file.
  for (int attempt = 0;; ++attempt) {
    path_ = (std::filesystem::path(dir) / strCat("events.out.tfevents.", static_cast<int64_t>(now), ".", hostName(),
                                                 attempt == 0 ? "" : strCat(".", attempt)))
                .string();
    std::error_code ec;
    if (!std::filesystem::exists(path_, ec)) break;
    TESSERA_CHECK(attempt < 1000, "TensorBoardWriter: no free event file name in ", dir);
  }
  fd_ = openForAppend(path_);
  tensorboard::Event event;
  event.set_wall_time(now);
  event.set_file_version("brain.Event:2");
  writeEvent(event.SerializeAsString());
}

TensorBoardWriter::~TensorBoardWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void TensorBoardWriter::addScalars(int64_t step, const std::vector<std::pair<std::string, double>>& scalars) {
  tensorboard::Event event;
  event.set_wall_time(wallTime());
  event.set_step(step);
  for (const auto& [tag, value] : scalars) {
    tensorboard::Summary::Value* v = event.mutable_summary()->add_value();
    v->set_tag(tag);
    v->set_simple_value(static_cast<float>(value));
  }
  writeEvent(event.SerializeAsString());
}

void TensorBoardWriter::addImage(int64_t step, const std::string& tag, const EncodedImage& image) {
  tensorboard::Event event;
  event.set_wall_time(wallTime());
  event.set_step(step);
  tensorboard::Summary::Value* v = event.mutable_summary()->add_value();
  v->set_tag(tag);
  tensorboard::Summary::Image* out = v->mutable_image();
  out->set_height(image.height);
  out->set_width(image.width);
  out->set_colorspace(image.channels);
  out->set_encoded_image_string(image.png);
  writeEvent(event.SerializeAsString());
}

void TensorBoardWriter::writeEvent(const std::string& serialisedEvent) {
  const std::string record = frameRecord(serialisedEvent);
  writeAllTo(fd_, record.data(), record.size(), path_);
}

}  // namespace tessera::observe
