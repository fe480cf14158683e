// metadata.json / rank index / trainer state: serialisation and validating parsers.
#include "checkpoint/metadata.h"

#include <cstdio>
#include <set>

#include "checkpoint/format.h"
#include "checkpoint/json_internal.h"
#include "common/limits.h"

namespace tessera::checkpoint {

using detail::asArray;
using detail::asInt;
using detail::asObject;
using detail::asString;
using detail::hasMember;
using detail::Json;
using detail::member;

namespace {

constexpr int64_t kMaxDims = 64;

// Tensor names become safetensors keys and log text: printable, bounded.
void checkTensorName(const std::string& name, const std::string& where) {
  if (name.empty() || name.size() > 4096) throw CheckpointError(strCat(where, ": tensor name of length ", name.size()));
  for (unsigned char c : name) {
    if (c < 0x20 || c == 0x7f) {
      throw CheckpointError(strCat(where, ": tensor name '", detail::printableKey(name), "' has a control character"));
    }
  }
}

// Data files live inside the checkpoint directory: a plain file name, never a path.
void checkFileName(const std::string& name, const std::string& where) {
  bool ok = !name.empty() && name.size() <= 255 && name != "." && name != "..";
  for (char c : name) {
    const bool allowed = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                         c == '-' || c == '.';
    ok = ok && allowed;
  }
  if (!ok) throw CheckpointError(strCat(where, ": file name '", name, "' is not a plain file name"));
}

const char* placementName(dtensor::Placement p) { return p == dtensor::Placement::kShard0 ? "shard0" : "replicate"; }

dtensor::Placement parsePlacement(const std::string& s, const std::string& where) {
  if (s == "shard0") return dtensor::Placement::kShard0;
  if (s == "replicate") return dtensor::Placement::kReplicate;
  throw CheckpointError(strCat(where, ": unknown placement '", s, "' (shard0 | replicate)"));
}

Json chunkToJson(const ChunkInfo& c) {
  Json sums = Json::array();
  for (uint64_t s : c.checksums) sums.push_back(checksumHex(s));
  return Json{{"rank", c.rank},        {"file", c.file}, {"offset", c.offset}, {"length", c.length},
              {"rows", {c.rowBegin, c.rowEnd}}, {"checksums", sums}};
}

Json tensorToJson(const TensorInfo& t) {
  Json chunks = Json::array();
  for (const auto& c : t.chunks) chunks.push_back(chunkToJson(c));
  return Json{{"name", t.name},
              {"dtype", dtypeName(t.dtype)},
              {"shape", t.shape},
              {"placement", placementName(t.placement)},
              {"chunks", chunks}};
}

// Parses the tensor's own fields (not the chunks).
TensorInfo parseTensorHead(const Json& j, const std::string& where) {
  asObject(j, where);
  TensorInfo t;
  t.name = asString(member(j, "name", where), where + ".name");
  const std::string tw = strCat(where, " (tensor '", t.name, "')");
  checkTensorName(t.name, tw);
  t.dtype = parseDtypeName(asString(member(j, "dtype", tw), tw + ".dtype", 16), tw + ".dtype");
  const Json& shape = asArray(member(j, "shape", tw), tw + ".shape");
  if (static_cast<int64_t>(shape.size()) > kMaxDims) throw CheckpointError(strCat(tw, ": shape has ", shape.size(), " dims"));
  int64_t numel = 1;
  for (const auto& d : shape) {
    t.shape.push_back(asInt(d, tw + ".shape", 0));
    numel = checkedMul(numel, t.shape.back(), tw + ".shape");
  }
  checkedMul(numel, dtypeBytes(t.dtype), tw + ".shape");
  t.placement = parsePlacement(asString(member(j, "placement", tw), tw + ".placement", 16), tw + ".placement");
  return t;
}

ChunkInfo parseChunk(const Json& j, const TensorInfo& t, int64_t blockBytes, const std::string& where) {
  asObject(j, where);
  ChunkInfo c;
  c.rank = static_cast<int>(asInt(member(j, "rank", where), where + ".rank", 0, kMaxWorldSize));
  c.file = asString(member(j, "file", where), where + ".file", 255);
  checkFileName(c.file, where + ".file");
  c.offset = asInt(member(j, "offset", where), where + ".offset", 0);
  c.length = asInt(member(j, "length", where), where + ".length", 0);
  checkedAdd(c.offset, c.length, where);
  const Json& rows = asArray(member(j, "rows", where), where + ".rows");
  if (rows.size() != 2) throw CheckpointError(strCat(where, ".rows: expected [begin, end]"));
  c.rowBegin = asInt(rows[0], where + ".rows", 0, t.rows());
  c.rowEnd = asInt(rows[1], where + ".rows", c.rowBegin, t.rows());
  if (c.rowEnd == c.rowBegin) throw CheckpointError(strCat(where, ": empty row range [", c.rowBegin, ", ", c.rowEnd, ")"));
  const int64_t expected = checkedMul(c.rowEnd - c.rowBegin, t.rowBytes(), where);
  if (c.length != expected) {
    throw CheckpointError(strCat(where, ": length ", c.length, " does not match rows [", c.rowBegin, ", ", c.rowEnd,
                                 ") of ", t.rowBytes(), " bytes each (", expected, ")"));
  }
  const Json& sums = asArray(member(j, "checksums", where), where + ".checksums");
  const int64_t blocks = blockBytes > 0 ? (c.length + blockBytes - 1) / blockBytes : 0;
  if (static_cast<int64_t>(sums.size()) != blocks) {
    throw CheckpointError(strCat(where, ": ", sums.size(), " checksums for ", blocks, " blocks of ", blockBytes, " bytes"));
  }
  c.checksums.reserve(sums.size());
  for (const auto& s : sums) c.checksums.push_back(parseChecksumHex(asString(s, where + ".checksums", 64), where));
  return c;
}

std::string rankStateText(const Json& v, const std::string& where) {
  asObject(v, where);
  return v.dump();
}

}  // namespace

int64_t TensorInfo::rowElements() const {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}
int64_t TensorInfo::rowBytes() const { return rowElements() * dtypeBytes(dtype); }
int64_t TensorInfo::numel() const { return rows() * rowElements(); }
int64_t TensorInfo::bytes() const { return numel() * dtypeBytes(dtype); }

const TensorInfo* CheckpointMetadata::find(const std::string& name) const {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

int64_t CheckpointMetadata::tensorBytes() const {
  int64_t total = 0;
  for (const auto& t : tensors) total += t.bytes();
  return total;
}

bool CheckpointMetadata::holdsPrefix(const std::string& prefix) const {
  for (const auto& t : tensors) {
    if (t.name.compare(0, prefix.size(), prefix) == 0) return true;
  }
  return false;
}

std::map<std::string, std::string> CheckpointMetadata::exportNames() const {
  return version >= 3 ? exportNamesOf(components) : aliases;
}

std::map<std::string, std::string> exportNamesOf(const std::vector<ComponentRecord>& components) {
  std::map<std::string, std::string> names;
  for (const ComponentRecord& c : components) {
    for (const auto& [name, prefix] : c.exports) {
      const auto [it, fresh] = names.emplace(name, prefix);
      if (!fresh && it->second != prefix) {
        throw Error(strCat("export name '", detail::printableKey(name), "' stands for '", detail::printableKey(it->second),
                           "' and, in component '", detail::printableKey(c.key), "', for '",
                           detail::printableKey(prefix), "'"));
      }
    }
  }
  return names;
}

namespace {

// metadata_checksum of a metadata object without that key: XXH3 of its compact JSON
// (nlohmann orders keys, so the text is canonical).
std::string metadataChecksum(const Json& withoutChecksum) {
  const std::string compact = withoutChecksum.dump();
  return checksumHex(checksum(compact.data(), compact.size()));
}

}  // namespace

std::string toJson(const CheckpointMetadata& m) {
  Json components = Json::array();
  for (const auto& c : m.components) {
    components.push_back(
        {{"key", c.key}, {"kind", c.kind}, {"of", c.of}, {"parts", c.parts}, {"exports", c.exports}});
  }
  Json files = Json::array();
  for (const auto& f : m.files) files.push_back({{"name", f.name}, {"bytes", f.bytes}});
  Json tensors = Json::array();
  for (const auto& t : m.tensors) tensors.push_back(tensorToJson(t));
  Json rankStates = Json::array();
  for (const auto& s : m.rankStates) rankStates.push_back(Json::parse(s));
  Json j{{"format", kFormatName},
         {"version", m.version},
         {"step", m.step},
         {"world_size", m.worldSize},
         {"strategy", m.strategy},
         {"checksum", {{"algorithm", kChecksumAlgorithm}, {"block_bytes", m.blockBytes}}},
         {"trainer_state",
          {{"file", m.trainerState.name},
           {"bytes", m.trainerState.bytes},
           {"checksum", checksumHex(m.trainerStateChecksum)}}},
         {"rank_states", rankStates},
         {"files", files},
         {"tensors", tensors}};
  if (m.version >= 3) {
    j["components"] = components;
  } else {
    j["aliases"] = m.aliases;
  }
  if (m.version >= 2) j["metadata_checksum"] = metadataChecksum(j);
  return j.dump(1) + "\n";
}

std::string resealMetadata(const std::string& text, const std::string& source) {
  Json j = detail::parseJson(text, source);
  asObject(j, source);
  j.erase("metadata_checksum");
  j["metadata_checksum"] = metadataChecksum(j);
  return j.dump(1) + "\n";
}

namespace {

// format, version, step, world_size, strategy and the checksum settings.
void parseMetadataHead(const Json& j, const std::string& source, CheckpointMetadata& m) {
  const std::string format = asString(member(j, "format", source), source + ".format", 64);
  if (format != kFormatName) throw CheckpointError(strCat(source, ": format '", format, "' is not ", kFormatName));
  m.version = static_cast<int>(asInt(member(j, "version", source), source + ".version", 1, 1000));
  if (m.version < kOldestFormatVersion || m.version > kFormatVersion) {
    throw CheckpointError(strCat(source, ": format version ", m.version, "; this build reads versions ",
                                 kOldestFormatVersion, " to ", kFormatVersion));
  }
  m.step = asInt(member(j, "step", source), source + ".step", 0);
  m.worldSize = static_cast<int>(asInt(member(j, "world_size", source), source + ".world_size", 1, kMaxWorldSize));
  m.strategy = asString(member(j, "strategy", source), source + ".strategy", 256);
  const Json& cs = asObject(member(j, "checksum", source), source + ".checksum");
  const std::string algo = asString(member(cs, "algorithm", source + ".checksum"), source + ".checksum.algorithm", 64);
  if (algo != kChecksumAlgorithm) throw CheckpointError(strCat(source, ": unknown checksum algorithm '", algo, "'"));
  m.blockBytes = asInt(member(cs, "block_bytes", source + ".checksum"), source + ".checksum.block_bytes", 8, kMaxBlockBytes);
  if (m.blockBytes % 8 != 0) throw CheckpointError(strCat(source, ": block_bytes ", m.blockBytes, " is not a multiple of 8"));
}

// trainer_state (its file, size and checksum), rank_states (one per rank) and, before
// format 3, aliases.
void parseMetadataStates(const Json& j, const std::string& source, CheckpointMetadata& m) {
  const Json& ts = asObject(member(j, "trainer_state", source), source + ".trainer_state");
  m.trainerState.name = asString(member(ts, "file", source + ".trainer_state"), source + ".trainer_state.file", 255);
  checkFileName(m.trainerState.name, source + ".trainer_state.file");
  m.trainerState.bytes = asInt(member(ts, "bytes", source + ".trainer_state"), source + ".trainer_state.bytes", 0, kMaxJsonBytes);
  m.trainerStateChecksum = parseChecksumHex(asString(member(ts, "checksum", source), source + ".trainer_state.checksum", 64),
                                            source + ".trainer_state.checksum");

  const Json& rs = asArray(member(j, "rank_states", source), source + ".rank_states");
  if (static_cast<int64_t>(rs.size()) != m.worldSize) {
    throw CheckpointError(strCat(source, ": ", rs.size(), " rank_states for world size ", m.worldSize));
  }
  for (size_t r = 0; r < rs.size(); ++r) m.rankStates.push_back(rankStateText(rs[r], strCat(source, ".rank_states[", r, "]")));

  if (m.version < 3 && hasMember(j, "aliases")) {
    for (const auto& [k, v] : asObject(j["aliases"], source + ".aliases").items()) {
      checkTensorName(k, source + ".aliases");
      m.aliases[k] = asString(v, strCat(source, ".aliases.", k), 4096);
    }
  }
}

// The data files, each listed once; returns their sizes by name.
std::map<std::string, int64_t> parseMetadataFiles(const Json& j, const std::string& source, CheckpointMetadata& m) {
  std::map<std::string, int64_t> fileBytes;
  const Json& files = asArray(member(j, "files", source), source + ".files");
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string where = strCat(source, ".files[", i, "]");
    FileInfo f;
    f.name = asString(member(files[i], "name", where), where + ".name", 255);
    checkFileName(f.name, where);
    f.bytes = asInt(member(files[i], "bytes", where), where + ".bytes", 0);
    if (!fileBytes.emplace(f.name, f.bytes).second) throw CheckpointError(strCat(where, ": file '", f.name, "' listed twice"));
    m.files.push_back(f);
  }
  return fileBytes;
}

// A tensor's chunks: each of a rank in the world and inside a listed file, together
// covering the tensor's rows once, in order.
void parseTensorChunks(const Json& tensor, const std::string& tw, const CheckpointMetadata& m,
                       const std::map<std::string, int64_t>& fileBytes, TensorInfo& t) {
  const Json& chunks = asArray(member(tensor, "chunks", tw), tw + ".chunks");
  int64_t nextRow = 0;
  for (size_t k = 0; k < chunks.size(); ++k) {
    const std::string cw = strCat(tw, " chunk ", k);
    ChunkInfo c = parseChunk(chunks[k], t, m.blockBytes, cw);
    if (c.rank >= m.worldSize) throw CheckpointError(strCat(cw, ": rank ", c.rank, " of world size ", m.worldSize));
    auto f = fileBytes.find(c.file);
    if (f == fileBytes.end()) throw CheckpointError(strCat(cw, ": file '", c.file, "' is not in the file list"));
    if (c.offset + c.length > f->second) {
      throw CheckpointError(strCat(cw, ": bytes [", c.offset, ", ", c.offset + c.length, ") lie outside ", c.file, " (",
                                   f->second, " bytes)"));
    }
    if (c.rowBegin != nextRow) {
      throw CheckpointError(strCat(cw, ": rows [", c.rowBegin, ", ", c.rowEnd, ") do not start at row ", nextRow,
                                   " (chunks must cover the rows once, in order)"));
    }
    nextRow = c.rowEnd;
    t.chunks.push_back(std::move(c));
  }
  if (nextRow != t.rows()) {
    throw CheckpointError(strCat(tw, ": chunks cover rows [0, ", nextRow, ") of ", t.rows()));
  }
}

// The tensors, each listed once, with their chunks.
void parseMetadataTensors(const Json& j, const std::string& source, const std::map<std::string, int64_t>& fileBytes,
                          CheckpointMetadata& m) {
  std::set<std::string> names;
  const Json& tensors = asArray(member(j, "tensors", source), source + ".tensors");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string where = strCat(source, ".tensors[", i, "]");
    TensorInfo t = parseTensorHead(tensors[i], where);
    const std::string tw = strCat(source, ": tensor '", t.name, "'");
    if (!names.insert(t.name).second) throw CheckpointError(strCat(tw, " is listed twice"));
    parseTensorChunks(tensors[i], tw, m, fileBytes, t);
    m.tensors.push_back(std::move(t));
  }
}

}  // namespace

namespace {

// A prefix metadata.json records (an alias's, a component's part or export): trusted by
// every export, so it must end in '/' and hold tensors.
void checkRecordedPrefix(const CheckpointMetadata& m, const std::string& prefix, const std::string& where) {
  if (prefix.empty() || prefix.back() != '/') {
    throw CheckpointError(strCat(where, ": '", detail::printableKey(prefix), "' is not a prefix ending in '/'"));
  }
  if (!m.holdsPrefix(prefix)) {
    throw CheckpointError(strCat(where, ": no tensor is under '", detail::printableKey(prefix), "'"));
  }
}

// A name that already names tensors of its own (`own`) may not be exported as others.
void checkOwnName(const CheckpointMetadata& m, const std::string& own, const std::string& prefix,
                  const std::string& where) {
  if (own != prefix && m.holdsPrefix(own)) {
    throw CheckpointError(strCat(where, ": points to '", detail::printableKey(prefix), "', but '",
                                 detail::printableKey(own), "' holds tensors of that name"));
  }
}

// Formats 1 and 2: export aliases (name -> tensor prefix); "<name>/" holding tensors is
// that name's own.
void checkAliases(const CheckpointMetadata& m, const std::string& source) {
  for (const auto& [alias, prefix] : m.aliases) {
    const std::string where = strCat(source, ".aliases.", detail::printableKey(alias));
    checkRecordedPrefix(m, prefix, where);
    checkOwnName(m, alias + "/", prefix, where);
  }
}

// A name inside the component table: printable, bounded, not empty.
std::string componentName(const Json& v, const std::string& where) {
  const std::string name = asString(v, where, 4096);
  checkTensorName(name, where);
  return name;
}

std::map<std::string, std::string> prefixMap(const Json& j, const char* key, const std::string& where) {
  std::map<std::string, std::string> out;
  for (const auto& [name, prefix] : asObject(member(j, key, where), where + "." + key).items()) {
    const std::string w = strCat(where, ".", key, ".", detail::printableKey(name));
    checkTensorName(name, w);
    out[name] = asString(prefix, w, 4096);
  }
  return out;
}

// Format 3: the component table. Each component's prefixes lie under its key and hold
// tensors; `of` names another component; an export name means one prefix; a name that is
// a key or a part ("decoder" with decoder/..., "decoder_ema" a part at ema/decoder_ema/)
// is exported as nothing else.
void parseComponents(const Json& j, const std::string& source, CheckpointMetadata& m) {
  constexpr size_t kMaxComponents = 4096;
  const Json& cs = asArray(member(j, "components", source), source + ".components");
  if (cs.size() > kMaxComponents) throw CheckpointError(strCat(source, ": ", cs.size(), " components"));
  std::set<std::string> keys;
  for (size_t i = 0; i < cs.size(); ++i) {
    const std::string where = strCat(source, ".components[", i, "]");
    asObject(cs[i], where);
    ComponentRecord c;
    c.key = componentName(member(cs[i], "key", where), where + ".key");
    if (c.key.front() == '/' || c.key.back() == '/') {
      throw CheckpointError(strCat(where, ".key: '", detail::printableKey(c.key), "' starts or ends with '/'"));
    }
    c.kind = asString(member(cs[i], "kind", where), where + ".kind", 64);
    c.of = asString(member(cs[i], "of", where), where + ".of", 4096);
    c.parts = prefixMap(cs[i], "parts", where);
    c.exports = prefixMap(cs[i], "exports", where);
    keys.insert(c.key);
    m.components.push_back(std::move(c));
  }
  std::map<std::string, std::string> own;       // a key's or a part's name -> its prefix
  std::map<std::string, std::string> exported;  // export name -> prefix
  for (const ComponentRecord& c : m.components) {
    own.emplace(c.key, c.prefix());
    for (const auto& [name, prefix] : c.parts) own.emplace(name, prefix);
  }
  for (size_t i = 0; i < m.components.size(); ++i) {
    const ComponentRecord& c = m.components[i];
    const std::string where = strCat(source, ".components[", i, "] ('", detail::printableKey(c.key), "')");
    if (!c.of.empty() && (c.of == c.key || !keys.count(c.of))) {
      throw CheckpointError(strCat(where, ".of: '", detail::printableKey(c.of), "' is not another component's key"));
    }
    auto underKey = [&](const std::string& prefix, const std::string& w) {
      checkRecordedPrefix(m, prefix, w);
      if (prefix.compare(0, c.prefix().size(), c.prefix()) != 0) {
        throw CheckpointError(strCat(w, ": '", detail::printableKey(prefix), "' is not under the component's key '",
                                     detail::printableKey(c.prefix()), "'"));
      }
    };
    for (const auto& [name, prefix] : c.parts) underKey(prefix, strCat(where, ".parts.", detail::printableKey(name)));
    for (const auto& [name, prefix] : c.exports) {
      const std::string w = strCat(where, ".exports.", detail::printableKey(name));
      underKey(prefix, w);
      const auto [it, fresh] = exported.emplace(name, prefix);
      if (!fresh && it->second != prefix) {
        throw CheckpointError(strCat(w, ": '", detail::printableKey(prefix), "', but another component exports it as '",
                                     detail::printableKey(it->second), "'"));
      }
      const auto mine = own.find(name);
      if (mine != own.end()) checkOwnName(m, mine->second, prefix, w);
      checkOwnName(m, name + "/", prefix, w);
    }
  }
}

}  // namespace

CheckpointMetadata parseMetadata(const std::string& text, const std::string& source) {
  if (static_cast<int64_t>(text.size()) > kMaxJsonBytes) throw CheckpointError(strCat(source, ": too large"));
  const Json j = detail::parseJson(text, source);
  asObject(j, source);
  CheckpointMetadata m;
  parseMetadataHead(j, source, m);
  if (m.version >= 2) {
    // Checked before any other field is believed.
    const uint64_t recorded = parseChecksumHex(
        asString(member(j, "metadata_checksum", source), source + ".metadata_checksum", 64), source + ".metadata_checksum");
    Json content = j;
    content.erase("metadata_checksum");
    if (parseChecksumHex(metadataChecksum(content), "") != recorded) {
      throw CheckpointError(strCat(source, ": its content does not match its metadata_checksum (the file was damaged "
                                           "or edited after the save)"));
    }
  }
  parseMetadataStates(j, source, m);
  const std::map<std::string, int64_t> fileBytes = parseMetadataFiles(j, source, m);
  parseMetadataTensors(j, source, fileBytes, m);
  if (m.version >= 3) {
    parseComponents(j, source, m);
  } else {
    checkAliases(m, source);
  }
  return m;
}

std::string toJson(const RankIndex& index) {
  Json tensors = Json::array();
  for (const auto& t : index.tensors) tensors.push_back(tensorToJson(t));
  Json j{{"rank", index.rank},
         {"world_size", index.worldSize},
         {"step", index.step},
         {"block_bytes", index.blockBytes},
         {"file", {{"name", index.file.name}, {"bytes", index.file.bytes}}},
         {"rank_state", Json::parse(index.rankState)},
         {"tensors", tensors}};
  return j.dump() + "\n";
}

RankIndex parseRankIndex(const std::string& text, const std::string& source) {
  if (static_cast<int64_t>(text.size()) > kMaxJsonBytes) throw CheckpointError(strCat(source, ": too large"));
  const Json j = detail::parseJson(text, source);
  asObject(j, source);
  RankIndex r;
  r.worldSize = static_cast<int>(asInt(member(j, "world_size", source), source + ".world_size", 1, kMaxWorldSize));
  r.rank = static_cast<int>(asInt(member(j, "rank", source), source + ".rank", 0, r.worldSize - 1));
  r.step = asInt(member(j, "step", source), source + ".step", 0);
  r.blockBytes = asInt(member(j, "block_bytes", source), source + ".block_bytes", 8, kMaxBlockBytes);
  const Json& f = asObject(member(j, "file", source), source + ".file");
  r.file.name = asString(member(f, "name", source + ".file"), source + ".file.name", 255);
  checkFileName(r.file.name, source + ".file.name");
  r.file.bytes = asInt(member(f, "bytes", source + ".file"), source + ".file.bytes", 0);
  r.rankState = rankStateText(member(j, "rank_state", source), source + ".rank_state");
  const Json& tensors = asArray(member(j, "tensors", source), source + ".tensors");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string where = strCat(source, ".tensors[", i, "]");
    TensorInfo t = parseTensorHead(tensors[i], where);
    const Json& chunks = asArray(member(tensors[i], "chunks", where), where + ".chunks");
    if (chunks.size() > 1) throw CheckpointError(strCat(where, ": a rank index holds at most one chunk per tensor"));
    for (const auto& c : chunks) {
      ChunkInfo chunk = parseChunk(c, t, r.blockBytes, where + ".chunks[0]");
      if (chunk.file != r.file.name || chunk.rank != r.rank || chunk.offset + chunk.length > r.file.bytes) {
        throw CheckpointError(strCat(where, ": chunk does not lie in this rank's file ", r.file.name));
      }
      t.chunks.push_back(std::move(chunk));
    }
    r.tensors.push_back(std::move(t));
  }
  return r;
}

std::string parseTrainerState(const std::string& text, const std::string& source) {
  if (static_cast<int64_t>(text.size()) > kMaxJsonBytes) throw CheckpointError(strCat(source, ": too large"));
  const Json j = detail::parseJson(text, source, 64);
  asObject(j, source);
  return j.dump();
}

std::string rankDataFile(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rank_%05d.bin", rank);
  return buf;
}
std::string rankIndexFile(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rank_%05d.json", rank);
  return buf;
}
std::string rankErrorFile(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rank_%05d.error", rank);
  return buf;
}
std::string stepDirName(int64_t step) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "step_%08lld", static_cast<long long>(step));
  return buf;
}

std::optional<int64_t> parseStepDirName(const std::string& name) {
  constexpr size_t kPrefix = 5;  // "step_"
  if (name.size() <= kPrefix || name.compare(0, kPrefix, "step_") != 0 || name.size() > kPrefix + 18) return std::nullopt;
  int64_t step = 0;
  for (size_t i = kPrefix; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    step = step * 10 + (name[i] - '0');  // at most 18 digits: no overflow
  }
  if (stepDirName(step) != name) return std::nullopt;  // not the canonical spelling
  return step;
}

}  // namespace tessera::checkpoint
