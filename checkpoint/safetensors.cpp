// Safetensors writer, bounds-checked reader and strict import (see safetensors.h).
#include "checkpoint/safetensors.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>

#include "checkpoint/format.h"
#include "checkpoint/json_internal.h"
#include "common/errors.h"

namespace tessera::checkpoint {

namespace fs = std::filesystem;
using detail::asArray;
using detail::asInt;
using detail::asObject;
using detail::asString;
using detail::Json;

namespace {

int64_t rowsOf(const std::vector<int64_t>& shape) { return shape.empty() ? 1 : shape[0]; }

}  // namespace

int64_t SafetensorsEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const SafetensorsEntry* SafetensorsHeader::find(const std::string& name) const {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

namespace {

// The header's JSON text: its 8-byte little-endian length checked against the bytes read
// and the file's size; sets h.headerBytes.
std::string readHeaderText(const uint8_t* data, size_t size, int64_t fileSize, const std::string& source,
                           SafetensorsHeader& h) {
  if (size < 8 || fileSize < 8) throw CheckpointError(strCat(source, ": shorter than the 8-byte header length"));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | data[i];
  if (n < 2 || n > static_cast<uint64_t>(kMaxSafetensorsHeader)) {
    throw CheckpointError(strCat(source, ": header length ", n, " is outside [2, ", kMaxSafetensorsHeader, "]"));
  }
  h.headerBytes = static_cast<int64_t>(n);
  if (h.dataOffset() > fileSize) {
    throw CheckpointError(strCat(source, ": header of ", n, " bytes runs past the end of the file (", fileSize, " bytes)"));
  }
  if (static_cast<int64_t>(size) < h.dataOffset()) throw CheckpointError(strCat(source, ": header not fully read"));
  return std::string(reinterpret_cast<const char*>(data) + 8, static_cast<size_t>(n));
}

// One tensor's entry: only dtype, shape and data_offsets, whose range lies in the data
// section and holds exactly the shape's bytes.
SafetensorsEntry parseTensorEntry(const std::string& name, const Json& v, int64_t dataBytes, const std::string& where) {
  asObject(v, where);
  for (const auto& [k, unused] : v.items()) {
    (void)unused;
    if (k != "dtype" && k != "shape" && k != "data_offsets") throw CheckpointError(strCat(where, ": unknown key '", k, "'"));
  }
  SafetensorsEntry e;
  e.name = name;
  e.dtype = parseDtypeName(asString(detail::member(v, "dtype", where), where + ".dtype", 16), where);
  int64_t nbytes = dtypeBytes(e.dtype);
  const Json& shape = asArray(detail::member(v, "shape", where), where + ".shape");
  if (shape.size() > 64) throw CheckpointError(strCat(where, ": shape has ", shape.size(), " dims"));
  for (const auto& d : shape) {
    e.shape.push_back(asInt(d, where + ".shape", 0));
    nbytes = checkedMul(nbytes, e.shape.back(), where + ".shape");
  }
  const Json& off = asArray(detail::member(v, "data_offsets", where), where + ".data_offsets");
  if (off.size() != 2) throw CheckpointError(strCat(where, ": data_offsets must be [begin, end]"));
  e.begin = asInt(off[0], where + ".data_offsets", 0, dataBytes);
  e.end = asInt(off[1], where + ".data_offsets", e.begin, dataBytes);
  if (e.end - e.begin != nbytes) {
    throw CheckpointError(strCat(where, ": data_offsets [", e.begin, ", ", e.end, ") hold ", e.end - e.begin,
                                 " bytes, but shape ", at::IntArrayRef(e.shape), " of ", dtypeName(e.dtype), " needs ", nbytes));
  }
  return e;
}

// Sorts the tensors by data offset and checks that they tile the data section: no
// overlap, no hole, nothing left over.
void checkDataCovered(std::vector<SafetensorsEntry>& tensors, int64_t dataBytes, const std::string& source) {
  std::sort(tensors.begin(), tensors.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  int64_t next = 0;
  for (const auto& e : tensors) {
    if (e.begin != next) {
      throw CheckpointError(strCat(source, ": tensor '", e.name, "' starts at data offset ", e.begin, ", expected ", next,
                                   e.begin < next ? " (overlap)" : " (hole)"));
    }
    next = e.end;
  }
  if (next != dataBytes) {
    throw CheckpointError(strCat(source, ": tensors cover ", next, " bytes of a ", dataBytes, "-byte data section"));
  }
}

}  // namespace

SafetensorsHeader parseSafetensorsHeader(const uint8_t* data, size_t size, int64_t fileSize, const std::string& source) {
  SafetensorsHeader h;
  const std::string text = readHeaderText(data, size, fileSize, source, h);
  if (text[0] != '{') throw CheckpointError(strCat(source, ": header does not start with '{'"));
  const Json j = detail::parseJson(text, source + " header", 8);
  asObject(j, source + " header");
  const int64_t dataBytes = fileSize - h.dataOffset();
  for (const auto& [name, v] : j.items()) {
    if (name == "__metadata__") {
      for (const auto& [k, mv] : asObject(v, source + ": __metadata__").items()) {
        h.metadata[k] = asString(mv, strCat(source, ": __metadata__.", k));
      }
      continue;
    }
    h.tensors.push_back(parseTensorEntry(name, v, dataBytes, strCat(source, ": tensor '", name, "'")));
  }
  checkDataCovered(h.tensors, dataBytes, source);
  return h;
}

namespace {

// metadata.total_size of an index: a non-negative integer when present.
std::optional<int64_t> indexTotalSize(const Json& index, const std::string& source) {
  if (!detail::hasMember(index, "metadata")) return std::nullopt;
  const Json& metadata = detail::asObject(index["metadata"], source + ".metadata");
  if (!detail::hasMember(metadata, "total_size")) return std::nullopt;
  return detail::asInt(metadata["total_size"], source + ".metadata.total_size", 0);
}

}  // namespace

std::map<std::string, std::string> parseSafetensorsIndex(const std::string& text, const std::string& source) {
  if (static_cast<int64_t>(text.size()) > kMaxIndexBytes) {
    throw CheckpointError(strCat(source, ": ", text.size(), " bytes, more than the ", kMaxIndexBytes, " an index may have"));
  }
  const Json j = detail::parseJson(text, source);
  asObject(j, source);
  indexTotalSize(j, source);  // checked here, compared with the files by SafetensorsSet
  const Json& map = asObject(detail::member(j, "weight_map", source), source + ".weight_map");
  std::map<std::string, std::string> out;
  for (const auto& [name, f] : map.items()) {
    if (name.empty()) throw CheckpointError(strCat(source, ": weight_map has an empty tensor name"));
    const std::string file = asString(f, source + ".weight_map." + name, 255);
    if (file.empty() || file == ".." || file == "." || file.find('/') != std::string::npos ||
        file.find('\0') != std::string::npos) {
      throw CheckpointError(strCat(source, ": weight_map file '", file, "' is not a plain file name"));
    }
    out[name] = file;
  }
  return out;
}

namespace {

bool isIndexPath(const std::string& path) {
  return path.size() > 11 && path.compare(path.size() - 11, 11, ".index.json") == 0;
}

// The shard files of index `path`'s weight map, each once.
std::vector<std::string> indexFiles(const std::string& path, const std::map<std::string, std::string>& weightMap) {
  std::vector<std::string> files;
  std::set<std::string> unique;
  for (const auto& [name, file] : weightMap) {
    if (unique.insert(file).second) files.push_back((fs::path(path).parent_path() / file).string());
  }
  return files;
}

}  // namespace

std::vector<std::string> safetensorsFiles(const std::string& path) {
  if (!isIndexPath(path)) return {path};
  return indexFiles(path, parseSafetensorsIndex(readFileBounded(path, kMaxIndexBytes, LinkPolicy::kFollow), path));
}

SafetensorsSet::SafetensorsSet(const std::string& path) {
  if (!isIndexPath(path)) {
    open({path});
    return;
  }
  const std::string text = readFileBounded(path, kMaxIndexBytes, LinkPolicy::kFollow);
  const std::map<std::string, std::string> expectedFile = parseSafetensorsIndex(text, path);
  const std::optional<int64_t> totalSize = indexTotalSize(detail::parseJson(text, path), path);
  open(indexFiles(path, expectedFile));
  for (const auto& [name, file] : expectedFile) {
    auto it = byName_.find(name);
    if (it == byName_.end() || fs::path(it->second.reader->path()).filename() != file) {
      throw CheckpointError(strCat(path, ": weight_map puts '", name, "' in ", file, ", which does not hold it"));
    }
  }
  // The index describes its shards: nothing in a file it does not list, the total right.
  int64_t bytes = 0;
  for (const auto& [name, located] : byName_) {
    if (!expectedFile.count(name)) {
      throw CheckpointError(strCat(path, ": '", detail::printableKey(name), "' is in ",
                                   fs::path(located.reader->path()).filename().string(), " but not in weight_map"));
    }
    bytes += located.entry->bytes();
  }
  if (totalSize && *totalSize != bytes) {
    throw CheckpointError(strCat(path, ": metadata.total_size is ", *totalSize, ", the files' tensors hold ", bytes,
                                 " bytes"));
  }
}

void SafetensorsSet::open(const std::vector<std::string>& files) {
  for (const auto& f : files) {
    readers_.push_back(std::make_unique<SafetensorsReader>(f));
    const SafetensorsReader* r = readers_.back().get();
    for (const auto& e : r->header().tensors) {
      if (!byName_.emplace(e.name, Located{r, &e}).second) {
        throw CheckpointError(strCat(f, ": tensor '", e.name, "' also appears in another file of the set"));
      }
    }
  }
}

std::map<std::string, at::Tensor> loadSafetensors(const std::string& path) {
  const SafetensorsSet set(path);
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, located] : set.byName()) out[name] = located.reader->read(name);
  return out;
}

std::string buildSafetensorsHeader(std::vector<SafetensorsEntry>& tensors, std::map<std::string, std::string> metadata) {
  if (!metadata.count("format")) metadata["format"] = "pt";
  Json j = Json::object();
  j["__metadata__"] = metadata;
  int64_t offset = 0;
  std::set<std::string> names;
  for (auto& t : tensors) {
    TESSERA_CHECK(!t.name.empty() && t.name != "__metadata__" && names.insert(t.name).second,
                  "buildSafetensorsHeader: bad or duplicate tensor name '", t.name, "'");
    t.begin = offset;
    t.end = offset + t.numel() * dtypeBytes(t.dtype);
    offset = t.end;
    j[t.name] = {{"dtype", dtypeName(t.dtype)}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
  }
  std::string text = j.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + text;
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<SafetensorsEntry> tensors,
                                     std::map<std::string, std::string> metadata)
    : path_(std::move(path)), tensors_(std::move(tensors)) {
  const std::string header = buildSafetensorsHeader(tensors_, std::move(metadata));
  headerSize_ = static_cast<int64_t>(header.size());
  dataBytes_ = tensors_.empty() ? 0 : tensors_.back().end;
  checkReplaceable(path_);
  file_ = File::openWrite(path_ + ".tmp");
  file_.writeAll(header.data(), header.size());
}

SafetensorsWriter::~SafetensorsWriter() {
  if (!finished_) {
    std::error_code ec;
    fs::remove(path_ + ".tmp", ec);
  }
}

void SafetensorsWriter::write(const void* data, int64_t bytes) {
  TESSERA_CHECK(bytes >= 0 && written_ + bytes <= dataBytes_, "SafetensorsWriter: ", path_, ": writing ", bytes,
                " bytes at data offset ", written_, " of ", dataBytes_);
  if (bytes > 0) file_.writeAll(data, static_cast<size_t>(bytes));
  written_ += bytes;
}

void SafetensorsWriter::writeTensor(const at::Tensor& t) {
  TESSERA_CHECK(t.device().is_cpu() && t.is_contiguous(), "SafetensorsWriter::writeTensor: needs a contiguous CPU tensor");
  write(t.data_ptr(), t.numel() * static_cast<int64_t>(t.element_size()));
}

void SafetensorsWriter::finish() {
  TESSERA_CHECK(written_ == dataBytes_, "SafetensorsWriter: ", path_, ": ", written_, " of ", dataBytes_,
                " data bytes written");
  file_.sync();
  file_.close();
  renamePath(path_ + ".tmp", path_);
  const fs::path parent = fs::path(path_).parent_path();
  syncDirectory(parent.empty() ? "." : parent.string());
  finished_ = true;
}

void saveSafetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                     std::map<std::string, std::string> metadata) {
  std::vector<SafetensorsEntry> plan;
  for (const auto& [name, t] : tensors) plan.push_back({name, t.scalar_type(), t.sizes().vec()});
  SafetensorsWriter writer(path, std::move(plan), std::move(metadata));
  for (const auto& [name, t] : tensors) writer.writeTensor(t.cpu().contiguous());
  writer.finish();
}

SafetensorsReader::SafetensorsReader(std::string path) : path_(std::move(path)), file_(File::openRead(path_, LinkPolicy::kFollow)) {
  const int64_t size = file_.size();
  uint8_t lenBytes[8] = {};
  if (size < 8) throw CheckpointError(strCat(path_, ": shorter than the 8-byte header length"));
  file_.readAt(lenBytes, 8, 0, "the header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | lenBytes[i];
  // Bound before allocating: never trust a length field.
  const int64_t want = static_cast<int64_t>(std::min<uint64_t>(n, static_cast<uint64_t>(kMaxSafetensorsHeader)));
  std::vector<uint8_t> buf(static_cast<size_t>(8 + std::min(want, size - 8)));
  file_.readAt(buf.data(), buf.size(), 0, "the header");
  header_ = parseSafetensorsHeader(buf.data(), buf.size(), size, path_);
}

const SafetensorsEntry& SafetensorsReader::entry(const std::string& name) const {
  const SafetensorsEntry* e = header_.find(name);
  if (e == nullptr) throw CheckpointError(strCat(path_, ": no tensor '", name, "'"));
  return *e;
}

at::Tensor SafetensorsReader::read(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  at::Tensor out = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
  if (e.bytes() > 0) file_.readAt(out.data_ptr(), static_cast<size_t>(e.bytes()), header_.dataOffset() + e.begin, "tensor '" + name + "'");
  return out;
}

void SafetensorsReader::readRows(const SafetensorsEntry& e, int64_t rowBegin, int64_t rowEnd, void* dst) const {
  const int64_t rows = rowsOf(e.shape);
  TESSERA_CHECK(0 <= rowBegin && rowBegin <= rowEnd && rowEnd <= rows, "SafetensorsReader::readRows: rows [", rowBegin,
                ", ", rowEnd, ") of '", e.name, "' with ", rows, " rows");
  const int64_t rowBytes = rows == 0 ? 0 : e.bytes() / rows;
  const int64_t n = (rowEnd - rowBegin) * rowBytes;
  if (n > 0) file_.readAt(dst, static_cast<size_t>(n), header_.dataOffset() + e.begin + rowBegin * rowBytes, "tensor '" + e.name + "'");
}

std::string safetensorsLayoutProblem(const SafetensorsHeader& header, const SafetensorsLayout& layout) {
  for (const SafetensorsEntry& e : header.tensors) {
    const auto it = layout.find(e.name);
    if (it == layout.end()) return strCat("a tensor ", quote(e.name), " it should not have");
    if (e.shape != it->second.first || e.dtype != it->second.second) {
      return strCat(quote(e.name), " is ", dtypeName(e.dtype), " ", at::IntArrayRef(e.shape), ", not ",
                    dtypeName(it->second.second), " ", at::IntArrayRef(it->second.first));
    }
  }
  for (const auto& [name, expected] : layout) {
    if (header.find(name) == nullptr) return strCat("no tensor ", quote(name));
  }
  return "";
}

}  // namespace tessera::checkpoint
