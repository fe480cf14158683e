// Reading and writing a shard directory's manifest.json (see shard_manifest.h).
#include "datasets/shard_manifest.h"

#include <unistd.h>
#include <xxhash.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <vector>

#include "common/errors.h"
#include "common/file_open.h"

namespace tessera::datasets {
namespace {

constexpr const char* kFormat = "tessera-webdataset-1";
constexpr int64_t kMaxManifestBytes = int64_t{256} << 20;
constexpr int64_t kMaxManifestClasses = int64_t{1} << 20;

using Json = nlohmann::json;

const Json& field(const Json& object, const char* key, const std::string& where) {
  const auto it = object.find(key);
  TESSERA_CHECK(it != object.end(), where, ": no \"", key, "\"");
  return *it;
}

int64_t nonNegative(const Json& object, const char* key, const std::string& where) {
  const Json& v = field(object, key, where);
  TESSERA_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0, where, ": \"", key, "\" is not a count");
  return v.get<int64_t>();
}

}  // namespace

bool ShardManifest::add(ShardEntry entry) {
  if (!byName_.emplace(entry.name, shards.size()).second) return false;
  shards.push_back(std::move(entry));
  return true;
}

const ShardEntry* ShardManifest::find(const std::string& name) const {
  const auto it = byName_.find(name);
  return it == byName_.end() ? nullptr : &shards[it->second];
}

std::optional<ShardManifest> readShardManifest(const std::string& directory) {
  const std::string path = (std::filesystem::path(directory) / kShardManifestName).string();
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return std::nullopt;
  const std::string text = readRegularFile(path, kMaxManifestBytes);
  // Nesting is refused past depth 4 while parsing: a manifest is an object of an array of objects.
  const Json doc = Json::parse(
      text, [](int depth, Json::parse_event_t, Json&) { return depth <= 4; }, /*allow_exceptions=*/false);
  TESSERA_CHECK(doc.is_object(), "shard manifest ", quote(path), ": not a JSON object (malformed, or nested too deep)");
  const Json& format = field(doc, "format", strCat("shard manifest ", quote(path), ""));
  TESSERA_CHECK(format.is_string() && format.get<std::string>() == kFormat, "shard manifest '", path,
                "': format is not \"", kFormat, "\"");
  ShardManifest m;
  m.classes = nonNegative(doc, "classes", strCat("shard manifest ", quote(path), ""));
  TESSERA_CHECK(m.classes <= kMaxManifestClasses, "shard manifest ", quote(path), ": \"classes\" ", m.classes,
                " is above ", kMaxManifestClasses);
  const Json& shards = field(doc, "shards", strCat("shard manifest ", quote(path), ""));
  TESSERA_CHECK(shards.is_array(), "shard manifest ", quote(path), ": \"shards\" is not a list");
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string where = strCat("shard manifest ", quote(path), ", shards[", i, "]");
    const Json& s = shards[i];
    TESSERA_CHECK(s.is_object(), where, ": not an object");
    ShardEntry e;
    const Json& name = field(s, "name", where);
    TESSERA_CHECK(name.is_string() && !name.get<std::string>().empty() &&
                      name.get<std::string>().find('/') == std::string::npos && name.get<std::string>() != ".." &&
                      name.get<std::string>().size() <= 255,
                  where, ": \"name\" is not a file name in the manifest's directory");
    e.name = name.get<std::string>();
    e.samples = nonNegative(s, "samples", where);
    e.bytes = nonNegative(s, "bytes", where);
    const Json& sum = field(s, "xxh3", where);
    TESSERA_CHECK(sum.is_string() && sum.get<std::string>().size() == 16 &&
                      sum.get<std::string>().find_first_not_of("0123456789abcdef") == std::string::npos,
                  where, ": \"xxh3\" is not 16 hex digits");
    e.xxh3 = std::stoull(sum.get<std::string>(), nullptr, 16);
    // Each sample is at least two members of a 512-byte header each.
    TESSERA_CHECK(e.samples <= e.bytes / 1024, where, ": ", e.samples, " samples cannot fit in ", e.bytes, " bytes");
    const std::string shardName = e.name;
    TESSERA_CHECK(m.add(std::move(e)), where, ": shard ", quote(shardName), " is listed twice");
  }
  return m;
}

void writeShardManifest(const std::string& directory, const ShardManifest& manifest) {
  Json shards = Json::array();
  for (const ShardEntry& e : manifest.shards) {
    shards.push_back({{"name", e.name}, {"samples", e.samples}, {"bytes", e.bytes}, {"xxh3", hex64(e.xxh3)}});
  }
  const Json doc = {{"format", kFormat}, {"classes", manifest.classes}, {"shards", shards}};
  replaceFile((std::filesystem::path(directory) / kShardManifestName).string(), doc.dump(1) + "\n");
}

uint64_t fileXxh3(const std::string& path) {
  const int fd = openRegularForRead(path, LinkPolicy::kFollow);
  if (fd < 0) throw Error(strCat("'", path, "': no such file"));
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  std::vector<char> buffer(size_t{1} << 20);
  ssize_t n = 0;
  while ((n = ::read(fd, buffer.data(), buffer.size())) != 0) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      XXH3_freeState(state);
      ::close(fd);
      throw Error(strCat("'", path, "': read failed: ", errnoText(err)));
    }
    XXH3_64bits_update(state, buffer.data(), static_cast<size_t>(n));
  }
  const uint64_t digest = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  ::close(fd);
  return digest;
}

std::string hex64(uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(value));
  return text;
}

}  // namespace tessera::datasets
