// The WebDataset reader and its deterministic stream order (see webdataset.h).
#include "datasets/webdataset.h"

#include <glob.h>
#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <list>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "common/counter_rng.h"
#include "common/errors.h"
#include "common/file_open.h"
#include "datasets/data_options.h"
#include "datasets/shard_manifest.h"
#include "datasets/tar_file.h"
#include "imaging/image_io.h"
#include "imaging/image_ops.h"

namespace tessera::datasets {
namespace fs = std::filesystem;

namespace {

constexpr int64_t kMaxImageBytes = int64_t{256} << 20;
constexpr int64_t kMaxLabelBytes = int64_t{64} << 10;
constexpr size_t kRecentPositions = 4096;
constexpr size_t kMaxShardPaths = 1000000;
constexpr uint64_t kShardOrderStream = 0x7368617264ULL;  // "shard"
constexpr uint64_t kBufferStream = 0x627566ULL;          // "buf"

// ---- shard paths: directory, glob, brace list ----

// Expands the first {...} of `spec` (a comma list or a numeric range a..b, zero-padded to
// the width of its bounds), recursively.
void expandBraces(const std::string& spec, const std::string& whole, std::vector<std::string>& out) {
  const size_t open = spec.find('{');
  if (open == std::string::npos) {
    TESSERA_CHECK_AS(ConfigError, spec.find('}') == std::string::npos, "shard list '", whole, "': unmatched '}'");
    out.push_back(spec);
    return;
  }
  const size_t close = spec.find('}', open);
  TESSERA_CHECK_AS(ConfigError, close != std::string::npos, "shard list '", whole, "': unmatched '{'");
  const std::string body = spec.substr(open + 1, close - open - 1);
  const std::string head = spec.substr(0, open), tail = spec.substr(close + 1);
  TESSERA_CHECK_AS(ConfigError, body.find('{') == std::string::npos, "shard list '", whole, "': nested braces");
  std::vector<std::string> items;
  const size_t dots = body.find("..");
  if (dots != std::string::npos) {
    const std::string a = body.substr(0, dots), b = body.substr(dots + 2);
    const auto digits = [](const std::string& s) {
      return !s.empty() && s.size() <= 12 && std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c); });
    };
    TESSERA_CHECK_AS(ConfigError, digits(a) && digits(b), "shard list '", whole, "': {", body,
                     "} is not a range of numbers (as {000000..000099})");
    const int64_t first = std::stoll(a), last = std::stoll(b);
    TESSERA_CHECK_AS(ConfigError, first <= last && last - first < 10000000, "shard list '", whole, "': range {", body,
                     "} is empty or too long");
    const size_t width = std::max(a.size(), b.size());
    for (int64_t i = first; i <= last; ++i) {
      std::string n = std::to_string(i);
      if (n.size() < width && (a.size() > 1 && a[0] == '0')) n.insert(0, width - n.size(), '0');
      items.push_back(std::move(n));
    }
  } else {
    size_t start = 0;
    while (true) {
      const size_t comma = body.find(',', start);
      items.push_back(body.substr(start, comma - start));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
  for (const std::string& item : items) {
    expandBraces(head + item + tail, whole, out);
    TESSERA_CHECK_AS(ConfigError, out.size() <= kMaxShardPaths, "shard list '", whole, "' names more than ",
                     kMaxShardPaths, " shards");
  }
}

bool hasWildcard(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

}  // namespace

std::vector<std::string> expandShardPaths(const std::string& spec) {
  std::error_code ec;
  std::vector<std::string> paths;
  if (fs::is_directory(spec, ec)) {
    for (const auto& entry : fs::directory_iterator(spec, ec)) {
      const std::string name = entry.path().filename().string();
      if (entry.path().extension() == ".tar" && name.front() != '.') paths.push_back(entry.path().string());
    }
    TESSERA_CHECK_AS(ConfigError, !ec, "shard directory ", quote(spec), ": ", ec.message());
    std::sort(paths.begin(), paths.end());
    TESSERA_CHECK_AS(ConfigError, !paths.empty(), "shard directory ", quote(spec), " holds no .tar file",
                     relativePathNote(spec));
    return paths;
  }
  std::vector<std::string> patterns;
  expandBraces(spec, spec, patterns);
  for (const std::string& pattern : patterns) {
    if (!hasWildcard(pattern)) {
      TESSERA_CHECK_AS(ConfigError, fs::exists(pattern, ec), "shard ", quote(pattern), ": no such file",
                       patterns.size() > 1 ? strCat(" (one of '", spec, "')") : std::string(),
                       relativePathNote(pattern));
      paths.push_back(pattern);
      continue;
    }
    glob_t found{};
    const int status = ::glob(pattern.c_str(), GLOB_ERR, nullptr, &found);
    std::vector<std::string> matched;
    for (size_t i = 0; status == 0 && i < found.gl_pathc; ++i) matched.push_back(found.gl_pathv[i]);
    globfree(&found);
    TESSERA_CHECK_AS(ConfigError, status == 0 || status == GLOB_NOMATCH, "shards ", quote(pattern), ": cannot list them");
    TESSERA_CHECK_AS(ConfigError, !matched.empty(), "shards ", quote(pattern), ": no file matches",
                     relativePathNote(pattern));
    std::sort(matched.begin(), matched.end());
    paths.insert(paths.end(), matched.begin(), matched.end());
  }
  return paths;
}

// ---- the stream order ----

StreamOrder::StreamOrder(std::vector<int64_t> shardSamples, int64_t bufferSize, int64_t seed, bool shuffle)
    : counts_(std::move(shardSamples)), bufferSize_(shuffle ? std::max<int64_t>(1, bufferSize) : 1),
      seed_(static_cast<uint64_t>(seed)), shuffle_(shuffle) {
  for (int64_t c : counts_) {
    TESSERA_CHECK(c >= 0, "StreamOrder: a shard of ", c, " samples");
    total_ += c;
  }
  TESSERA_CHECK(total_ > 0, "StreamOrder: the shards hold no sample");
}

void StreamOrder::startEpoch(int64_t epoch) {
  epoch_ = epoch;
  emitted_ = 0;
  recent_.clear();
  shardOrder_.resize(counts_.size());
  for (size_t i = 0; i < shardOrder_.size(); ++i) shardOrder_[i] = static_cast<int64_t>(i);
  if (shuffle_) {  // Fisher-Yates from counter bits of (seed, epoch): the same on every rank and toolchain
    const uint64_t key = counterBits(seed_ ^ kShardOrderStream, static_cast<uint64_t>(epoch));
    for (size_t i = shardOrder_.size(); i > 1; --i) {
      const auto j = static_cast<size_t>(counterBits(key, i) % i);
      std::swap(shardOrder_[i - 1], shardOrder_[j]);
    }
  }
  orderCursor_ = 0;
  sampleCursor_ = 0;
  buffer_.clear();
  // Fill the buffer with the first samples in shard order.
  while (static_cast<int64_t>(buffer_.size()) < bufferSize_ && orderCursor_ < shardOrder_.size()) {
    const int64_t shard = shardOrder_[orderCursor_];
    if (sampleCursor_ < counts_[static_cast<size_t>(shard)]) {
      buffer_.push_back({shard, sampleCursor_++});
    } else {
      ++orderCursor_;
      sampleCursor_ = 0;
    }
  }
}

StreamOrder::Ref StreamOrder::emitNext() {
  const uint64_t key = counterBits(seed_ ^ kBufferStream, static_cast<uint64_t>(epoch_));
  const auto slot = static_cast<size_t>(counterBits(key, static_cast<uint64_t>(emitted_)) % buffer_.size());
  const Ref out = buffer_[slot];
  // Refill the slot with the next sample in shard order, or shrink the buffer at the epoch's end.
  while (orderCursor_ < shardOrder_.size() && sampleCursor_ >= counts_[static_cast<size_t>(shardOrder_[orderCursor_])]) {
    ++orderCursor_;
    sampleCursor_ = 0;
  }
  if (orderCursor_ < shardOrder_.size()) {
    buffer_[slot] = {shardOrder_[orderCursor_], sampleCursor_++};
  } else {
    buffer_[slot] = buffer_.back();
    buffer_.pop_back();
  }
  ++emitted_;
  recent_.push_back(out);
  if (recent_.size() > kRecentPositions) recent_.pop_front();
  return out;
}

StreamOrder::Ref StreamOrder::at(int64_t position) {
  TESSERA_CHECK(position >= 0, "StreamOrder: position ", position);
  const int64_t epoch = position / total_, within = position % total_;
  const auto firstRecent = emitted_ - static_cast<int64_t>(recent_.size());
  if (epoch != epoch_ || within < firstRecent) startEpoch(epoch);
  if (within < emitted_) return recent_[static_cast<size_t>(within - (emitted_ - static_cast<int64_t>(recent_.size())))];
  Ref out;
  while (emitted_ <= within) out = emitNext();
  return out;
}

// ---- shards and their samples ----

namespace {

// One sample of a shard: where its image is, its label, or why it is unusable.
struct SampleEntry {
  std::string key;
  int64_t imageOffset = 0, imageSize = -1;
  int64_t label = -1;
  int64_t headerOffset = 0;  // its first member's header, for messages
  std::string problem;       // non-empty: the sample is damaged (no image, no label, a bad label)
};

// A shard's samples, held compactly (about 40 bytes and the key a sample): the cached
// indexes are what a stream holds besides its buffer.
class ShardIndex {
 public:
  size_t size() const { return stored_.size(); }
  void add(const SampleEntry& e) {
    stored_.push_back({e.headerOffset, e.imageOffset, e.imageSize, e.label});
    keys_ += e.key;
    keyEnds_.push_back(keys_.size());
    if (!e.problem.empty()) problems_.emplace(stored_.size() - 1, e.problem);
  }
  SampleEntry at(size_t i) const {
    const Stored& s = stored_[i];
    SampleEntry e;
    const size_t start = i == 0 ? 0 : keyEnds_[i - 1];
    e.key = keys_.substr(start, keyEnds_[i] - start);
    e.headerOffset = s.headerOffset;
    e.imageOffset = s.imageOffset;
    e.imageSize = s.imageSize;
    e.label = s.label;
    if (const auto it = problems_.find(i); it != problems_.end()) e.problem = it->second;
    return e;
  }
  std::string problem;  // non-empty: the shard ends in damage after size() whole samples
  int64_t nonSamples = 0;  // groups of members that are no sample (LICENSE.txt, hidden files), passed over

  // XXH3-64 of what the index says of each sample (key, where its image is, its label):
  // another shard under the same name and count differs here.
  uint64_t contentDigest() const {
    std::string text = keys_;
    for (const Stored& s : stored_) text += strCat('\n', s.imageOffset, ' ', s.imageSize, ' ', s.label);
    return XXH3_64bits(text.data(), text.size());
  }

 private:
  struct Stored {
    int64_t headerOffset, imageOffset, imageSize, label;
  };
  std::vector<Stored> stored_;
  std::string keys_;
  std::vector<size_t> keyEnds_;
  std::map<size_t, std::string> problems_;
};

// WebDataset's split of a member name into key and extension: the key is everything up to
// the first '.' of the last path component.
std::pair<std::string, std::string> keyAndExtension(const std::string& name) {
  const size_t slash = name.rfind('/');
  const size_t dot = name.find('.', slash == std::string::npos ? 0 : slash + 1);
  if (dot == std::string::npos) return {name, ""};
  std::string ext = name.substr(dot + 1);
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  return {name.substr(0, dot), ext};
}

// The class id in a .cls member (a decimal number, surrounding white space allowed) or a
// .json member ({"label": id} or {"cls": id}); -1 with `problem` set otherwise.
int64_t parseLabel(const std::string& data, const std::string& ext, std::string& problem) {
  if (ext == "cls") {
    size_t a = 0, b = data.size();
    while (a < b && std::isspace(static_cast<unsigned char>(data[a]))) ++a;
    while (b > a && std::isspace(static_cast<unsigned char>(data[b - 1]))) --b;
    const std::string text = data.substr(a, b - a);
    if (text.empty() || text.size() > 7 ||
        !std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isdigit(c); })) {
      problem = strCat("its .cls is not a class number (", quote(text, 20), ")");
      return -1;
    }
    const int64_t label = std::stoll(text);
    if (label >= kMaxClasses) problem = strCat("class ", label, " is beyond ", kMaxClasses, " classes");
    return label >= kMaxClasses ? -1 : label;
  }
  const auto doc = nlohmann::json::parse(
      data, [](int depth, nlohmann::json::parse_event_t, nlohmann::json&) { return depth <= 8; }, false);
  for (const char* field : {"label", "cls"}) {
    if (doc.is_object() && doc.contains(field) && doc[field].is_number_integer()) {
      // As written (2^64-1 is not "-1"): an unsigned value past int64 is out of range too.
      const bool fits = !doc[field].is_number_unsigned() || doc[field].get<uint64_t>() < uint64_t(kMaxClasses);
      const int64_t label = fits ? doc[field].get<int64_t>() : -1;
      if (fits && label >= 0 && label < kMaxClasses) return label;
      problem = strCat("its .json ", field, " ", doc[field].dump(), " is not a class number below ", kMaxClasses);
      return -1;
    }
  }
  problem = "its .json has no integer \"label\" or \"cls\"";
  return -1;
}

// Walks shard `path`'s headers into its samples (reading only the small label members).
// A damage in the archive itself ends the walk with ShardIndex::problem set.
//
// Which members are read, as WebDataset's own readers do: members are grouped by key (the
// name up to the first '.' of its last path component); a group with an image (.png,
// .jpg, .jpeg) or a class label (.cls, or .json with "label" or "cls") is a sample, and a
// sample needs both. A group with neither (LICENSE.txt, dataset_info.json, README.md) is
// no sample and is passed over, as are hidden members (a last path component starting with
// '.') and members without an extension.
ShardIndex indexShard(const std::string& path) {
  ShardIndex index;
  TarReader tar(path);
  SampleEntry open;  // the sample being read; key empty: none
  int imageMembers = 0;
  const auto close = [&] {
    if (open.key.empty()) return;
    SampleEntry& s = open;
    if (imageMembers == 0 && s.label < 0) {  // no image, no label: not a sample
      ++index.nonSamples;
      open = SampleEntry{};
      return;
    }
    if (s.problem.empty() && imageMembers > 1) s.problem = "it holds more than one image";
    if (s.problem.empty() && s.imageSize < 0) s.problem = "it holds no .png, .jpg or .jpeg image";
    if (s.problem.empty() && s.label < 0) s.problem = "it holds no .cls or .json label";
    index.add(s);
    open = SampleEntry{};
    imageMembers = 0;
  };
  try {
    TarMember m;
    while (tar.next(m)) {
      auto [key, ext] = keyAndExtension(m.name);
      const size_t slash = m.name.rfind('/');
      const bool hidden = m.name.size() > (slash == std::string::npos ? 0 : slash + 1) &&
                          m.name[slash == std::string::npos ? 0 : slash + 1] == '.';
      if (ext.empty() || key.empty() || hidden) continue;  // not part of a sample (WebDataset ignores such members too)
      if (open.key != key) {
        close();
        open.key = key;
        open.headerOffset = m.headerOffset;
      }
      if (ext == "png" || ext == "jpg" || ext == "jpeg") {
        ++imageMembers;
        open.imageOffset = m.offset;
        open.imageSize = m.size;
        if (m.size > kMaxImageBytes) open.problem = strCat("its image holds ", m.size, " bytes");
      } else if (ext == "cls" || ext == "json") {
        if (m.size > kMaxLabelBytes) {
          open.problem = strCat("its .", ext, " holds ", m.size, " bytes");
        } else if (open.problem.empty()) {
          open.label = parseLabel(tar.readData(m, kMaxLabelBytes), ext, open.problem);
        }
      }
    }
    close();
  } catch (const Error& e) {
    // The archive is damaged from here on: the sample being read is incomplete, not kept.
    index.problem = e.what();
  }
  return index;
}

std::string describeSample(const std::string& shard, const SampleEntry& s) {
  return strCat("sample ", quote(s.key), " of shard ", quote(shard), " (its header at byte ", s.headerOffset, ")");
}

// One split's shards: their paths, manifests, sample counts, and the indexes of the shards
// read lately.
class ShardSet {
 public:
  ShardSet(const std::vector<std::string>& paths, bool skipDamaged, const char* key)
      : key_(key), skipDamaged_(skipDamaged) {
    std::map<std::string, std::optional<ShardManifest>> manifests;
    for (const std::string& path : paths) {
      const std::string dir = fs::path(path).parent_path().string();
      auto it = manifests.find(dir);
      if (it == manifests.end()) it = manifests.emplace(dir, readShardManifest(dir.empty() ? "." : dir)).first;
      const ShardEntry* entry = it->second ? it->second->find(fs::path(path).filename().string()) : nullptr;
      if (it->second) classes_ = std::max(classes_, it->second->classes);
      Shard shard;
      shard.path = path;
      if (entry != nullptr) {
        shard.expectedBytes = entry->bytes;
        shard.xxh3 = entry->xxh3;
        shard.content = entry->xxh3;
        shard.samples = entry->samples;
        std::error_code ec;
        const auto size = static_cast<int64_t>(fs::file_size(path, ec));
        TESSERA_CHECK(!ec, "shard ", quote(path), ": ", ec.message());
        if (size != entry->bytes) {
          const std::string what = strCat("shard ", quote(path), " is ", size, " bytes, its manifest says ", entry->bytes,
                                          size < entry->bytes ? strCat(": truncated at byte ", size) : ": changed since");
          if (!skipDamaged_) throw Error(what);
          dropped_.push_back(what);
          shard.samples = 0;
        }
      } else {
        // No manifest entry: the shard's headers are read now for its count and classes.
        ShardIndex index = indexShard(path);
        if (!index.problem.empty()) {
          if (!skipDamaged_) throw Error(index.problem);
          dropped_.push_back(strCat(index.problem, " (kept its first ", index.size(), " whole samples)"));
        }
        for (size_t i = 0; i < index.size(); ++i) {
          const SampleEntry s = index.at(i);
          if (!s.problem.empty() && !skipDamaged_) throw Error(strCat(describeSample(path, s), ": ", s.problem));
          classes_ = std::max(classes_, s.label + 1);
        }
        shard.samples = static_cast<int64_t>(index.size());
        shard.content = index.contentDigest();
        shard.verified = true;
        scanned_ += 1;
        nonSamples_ += index.nonSamples;
        cache_.emplace_front(static_cast<int64_t>(shards_.size()), std::make_shared<const ShardIndex>(std::move(index)));
        if (cache_.size() > cachedShards_) cache_.pop_back();
      }
      starts_.push_back(total_);
      total_ += shard.samples;
      shards_.push_back(std::move(shard));
    }
    TESSERA_CHECK(total_ > 0, key_, ": the shards hold no sample");
  }

  int64_t size() const { return total_; }
  int64_t classes() const { return classes_; }
  size_t shardCount() const { return shards_.size(); }
  int64_t scanned() const { return scanned_; }
  const std::vector<std::string>& dropped() const { return dropped_; }
  std::vector<int64_t> counts() const {
    std::vector<int64_t> c;
    for (const Shard& s : shards_) c.push_back(s.samples);
    return c;
  }
  const std::string& path(int64_t shard) const { return shards_[static_cast<size_t>(shard)].path; }
  // XXH3-64 over the shards' file names (not directories: the set may move) and counts.
  uint64_t digest() const {
    std::string text;
    for (const Shard& s : shards_) text += strCat(fs::path(s.path).filename().string(), '\n', s.samples, '\n');
    return XXH3_64bits(text.data(), text.size());
  }
  // XXH3-64 over what each shard holds: its manifest's checksum of the file, or for a shard
  // scanned without one, its samples' keys, places and labels. A shard replaced by another
  // of the same name and count changes it.
  uint64_t contentDigest() const {
    std::string text;
    for (const Shard& s : shards_) text += strCat(hex64(s.content), '\n');
    return XXH3_64bits(text.data(), text.size());
  }
  int64_t nonSamples() const { return nonSamples_; }
  // Keeps the indexes of the `n` shards read last. A buffer of B samples draws from about
  // B / (samples per shard) + 2 shards at once; a shard that left the cache is indexed again
  // (a header walk), which costs time, never a wrong sample.
  void setCachedShards(size_t n) { cachedShards_ = n; }

  // Sample `sample` of shard `shard`, its shard indexed (and its checksum checked) when it
  // is not among the recent ones. tessera::Error naming the shard, or the sample's problem.
  SampleEntry entry(int64_t shard, int64_t sample) const {
    const std::shared_ptr<const ShardIndex> index = indexOf(shard);
    const Shard& s = shards_[static_cast<size_t>(shard)];
    if (sample >= static_cast<int64_t>(index->size())) {
      throw Error(index->problem.empty()
                      ? strCat("shard ", quote(s.path), " holds ", index->size(), " samples, its manifest says ", s.samples)
                      : index->problem);
    }
    const SampleEntry e = index->at(static_cast<size_t>(sample));
    if (!e.problem.empty()) throw Error(strCat(describeSample(s.path, e), ": ", e.problem));
    return e;
  }

  // The sample at position `i` of the split in shard order (held-out samples).
  std::pair<int64_t, int64_t> inOrder(int64_t i) const {
    TESSERA_CHECK(i >= 0 && i < total_, key_, ": sample ", i, " past the end");
    // The last shard starting at or before i (shards of 0 samples share their start with the next).
    const auto shard = std::upper_bound(starts_.begin(), starts_.end(), i) - starts_.begin() - 1;
    return {static_cast<int64_t>(shard), i - starts_[static_cast<size_t>(shard)]};
  }


 private:
  struct Shard {
    std::string path;
    int64_t samples = 0, expectedBytes = -1;
    uint64_t xxh3 = 0;
    uint64_t content = 0;  // contentDigest's part: the manifest's xxh3, or the scan's digest
    mutable bool verified = false;  // checksum checked (or no manifest to check against); under mutex_
  };

  std::shared_ptr<const ShardIndex> indexOf(int64_t shard) const {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = cache_.begin(); it != cache_.end(); ++it) {
        if (it->first == shard) {
          cache_.splice(cache_.begin(), cache_, it);
          return cache_.front().second;
        }
      }
    }
    const Shard& s = shards_[static_cast<size_t>(shard)];
    bool verify = false;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      verify = !s.verified;
    }
    std::shared_ptr<ShardIndex> index;
    const uint64_t sum = verify ? fileXxh3(s.path) : s.xxh3;
    if (sum != s.xxh3) {
      // Cached as a shard without samples: each of its samples then fails at once (skip
      // passes over them without reading the shard again).
      index = std::make_shared<ShardIndex>();
      index->problem = strCat("shard ", quote(s.path), ": its checksum is ", hex64(sum), ", its manifest says ",
                              hex64(s.xxh3), ": the shard changed or is damaged");
    } else {
      index = std::make_shared<ShardIndex>(indexShard(s.path));
    }
    TESSERA_CHECK(!index->problem.empty() || static_cast<int64_t>(index->size()) == s.samples || skipDamaged_,
                  "shard '", s.path, "' holds ", index->size(), " samples, its manifest says ", s.samples);
    const std::lock_guard<std::mutex> lock(mutex_);
    s.verified = true;
    cache_.emplace_front(shard, index);
    if (cache_.size() > cachedShards_) cache_.pop_back();
    return index;
  }

  size_t cachedShards_ = 8;
  std::vector<Shard> shards_;
  const char* key_;
  bool skipDamaged_;
  std::vector<int64_t> starts_;  // the split position of each shard's first sample
  int64_t total_ = 0, classes_ = 0, scanned_ = 0, nonSamples_ = 0;
  std::vector<std::string> dropped_;
  mutable std::mutex mutex_;
  mutable std::list<std::pair<int64_t, std::shared_ptr<const ShardIndex>>> cache_;
};

class WebDataset : public Dataset {
 public:
  WebDataset(const DataOptions& data, int64_t seed)
      : train_(expandShardPaths(data.path), data.on_error == "skip", "data.path"),
        skip_(data.on_error == "skip"),
        order_(train_.counts(), data.shuffle_buffer, seed, data.shuffle),
        channels_(data.channels),
        size_(data.image_size) {
    if (!data.eval_path.empty()) {
      try {
        eval_ = std::make_unique<ShardSet>(expandShardPaths(data.eval_path), skip_, "data.eval_path");
      } catch (const ConfigError& e) {
        throw DataFileError("data.eval_path", e.what(), true);
      } catch (const std::exception& e) {
        throw DataFileError("data.eval_path", e.what(), false);
      }
    }
    const int64_t perShard = std::max<int64_t>(1, train_.size() / static_cast<int64_t>(train_.shardCount()));
    train_.setCachedShards(static_cast<size_t>(std::clamp<int64_t>(4 + data.shuffle_buffer / perShard, 4, 256)));
    // The model is sized by the training shards' classes; held-out shards naming a class
    // they never do would quietly widen it (IDX data refuses this too).
    if (eval_ && eval_->classes() > train_.classes()) {
      throw DataFileError("data.eval_path",
                          strCat("the held-out shards name class ", eval_->classes() - 1, ", which the training shards "
                                 "of data.path never do (", train_.classes(), " classes)"),
                          true);
    }
    classes_ = train_.classes();
    TESSERA_CHECK(classes_ > 0, "data.path: the shards' labels name no class");
    // The first readable sample (under skip; the first one under fail) sets what
    // data.channels and data.image_size leave open.
    at::Tensor image;
    SampleEntry first;
    std::string firstShard;
    for (int64_t i = 0; !image.defined(); ++i) {
      const auto [shard, sample] = train_.inOrder(i);
      try {
        first = train_.entry(shard, sample);
        firstShard = train_.path(shard);
        image = imaging::decodeImage(readShardRange(firstShard, first.imageOffset, first.imageSize),
                                     describeSample(firstShard, first), channels_);
      } catch (const Error& e) {
        if (!skip_ || i + 1 >= train_.size()) throw;
      }
    }
    if (channels_ == 0) channels_ = static_cast<int>(image.size(0));
    if (size_ == 0) {
      TESSERA_CHECK(image.size(1) == image.size(2), describeSample(firstShard, first), " is ", image.size(2), "x",
                    image.size(1), ": not square; set data.image_size to resize every image");
      size_ = image.size(1);
      resize_ = false;
    }
  }

  int64_t trainSamples() const override { return train_.size(); }
  int64_t evalSamples() const override { return eval_ ? eval_->size() : 0; }
  bool streams() const override { return true; }

  Batch trainBatch(const std::vector<int64_t>& positions) const override {
    std::vector<at::Tensor> images;
    std::vector<int64_t> labels;
    for (int64_t position : positions) {
      TESSERA_CHECK(position >= 0, "webdataset: stream position ", position);
      images.push_back(loadSkipping(train_, labels, position, [&](int64_t p) {
        const std::lock_guard<std::mutex> lock(orderMutex_);
        const StreamOrder::Ref ref = order_.at(p);
        return std::pair{ref.shard, ref.sample};
      }, order_.samplesPerEpoch()));
    }
    return batchOf(images, labels);
  }

  Batch evalBatch(int64_t first, int64_t n) const override {
    TESSERA_CHECK(eval_ && first >= 0 && n >= 0 && first + n <= evalSamples(), "webdataset: held-out samples [",
                  first, ", ", first + n, ") out of range [0, ", evalSamples(), ")");
    std::vector<at::Tensor> images;
    std::vector<int64_t> labels;
    for (int64_t i = first; i < first + n; ++i) {
      images.push_back(loadSkipping(*eval_, labels, i, [&](int64_t p) { return eval_->inOrder(p % evalSamples()); },
                                    evalSamples()));
    }
    return batchOf(images, labels);
  }

  DataSpec spec() const override {
    DataSpec s;
    s.inputShape = {channels_, size_, size_};
    s.classes = classes_;
    return s;
  }

  // The names and counts part comes first and as it always read: a checkpoint written before
  // the contents were fingerprinted holds that part alone (run_setup.cpp compares so).
  std::string fingerprint() const override {
    return strCat(train_.shardCount(), " shards, ", trainSamples(), " samples, names and counts XXH3 ",
                  hex64(train_.digest()), "; contents XXH3 ", hex64(train_.contentDigest()));
  }

  SkipCount skipped() const override {
    const std::lock_guard<std::mutex> lock(orderMutex_);
    return skipped_;
  }

  std::string describe() const override {
    std::string d = strCat(train_.shardCount(), " shards (", trainSamples(), " samples) of ", shardsNamed(),
                           eval_ ? strCat(", held out: ", eval_->shardCount(), " shards (", evalSamples(), " samples)")
                                 : std::string(", no held-out shards (data.eval_path)"),
                           "; ", classes_, " classes, ", channels_, "x", size_, "x", size_);
    if (train_.scanned() > 0) d += strCat("; ", train_.scanned(), " shards without a manifest entry were scanned");
    if (train_.nonSamples() > 0) {
      d += strCat("; ", train_.nonSamples(), " groups of members that are no sample (no image, no label) passed over");
    }
    for (const std::string& dropped : train_.dropped()) d += strCat("; data.on_error skip: ", dropped);
    return d;
  }

 private:
  // The first shard, and "..." when there are more: how the log line names them.
  std::string shardsNamed() const { return train_.path(0) + (train_.shardCount() > 1 ? " ..." : ""); }

  // The sample at `position` (`where(p)`: its shard and number), or under data.on_error skip
  // the first readable one after it, each position passed over counted once; at most
  // `limit` positions are tried (an epoch) before the error is the last one's.
  template <typename Where>
  at::Tensor loadSkipping(const ShardSet& set, std::vector<int64_t>& labels, int64_t position, Where where,
                          int64_t limit) const {
    for (int64_t p = position;; ++p) {
      const auto [shard, sample] = where(p);
      try {
        return load(set, shard, sample, labels);
      } catch (const Error& e) {
        if (!skip_ || p - position + 1 >= limit) throw;
        const std::lock_guard<std::mutex> lock(orderMutex_);
        int64_t& through = &set == &train_ ? skippedTrainThrough_ : skippedEvalThrough_;
        if (p > through) {  // rows of a batch come in order: a position passed over by two rows counts once
          skipped_.samples += 1;
          skipped_.last = e.what();
          through = p;
        }
      }
    }
  }

  at::Tensor load(const ShardSet& set, int64_t shard, int64_t sample, std::vector<int64_t>& labels) const {
    const SampleEntry e = set.entry(shard, sample);
    const std::string what = describeSample(set.path(shard), e);
    TESSERA_CHECK(e.label < classes_, what, ": class ", e.label, " is beyond the ", classes_,
                  " classes of the manifest");
    at::Tensor image = imaging::decodeImage(readShardRange(set.path(shard), e.imageOffset, e.imageSize), what, channels_);
    if (resize_) {
      image = imaging::resizeImage(image, size_, size_);
    } else {
      TESSERA_CHECK(image.size(1) == size_ && image.size(2) == size_, what, " is ", image.size(2), "x", image.size(1),
                    ", not the ", size_, "x", size_, " of the first; set data.image_size to resize every image");
    }
    labels.push_back(e.label);
    return image;
  }

  static Batch batchOf(const std::vector<at::Tensor>& images, const std::vector<int64_t>& labels) {
    Batch b;
    b.inputs = images.empty() ? at::empty({0}, at::kFloat) : imaging::toModelPixels(at::stack(images));
    b.targets = at::tensor(labels, at::kLong);
    return b;
  }

  ShardSet train_;
  std::unique_ptr<ShardSet> eval_;
  bool skip_;
  mutable std::mutex orderMutex_;
  mutable StreamOrder order_;
  mutable SkipCount skipped_;
  mutable int64_t skippedTrainThrough_ = -1, skippedEvalThrough_ = -1;  // the last position counted
  int channels_;
  int64_t size_;
  bool resize_ = true;
  int64_t classes_ = 0;
};

}  // namespace

std::unique_ptr<Dataset> makeWebDataset(const DataOptions& data, int64_t seed) {
  return std::make_unique<WebDataset>(data, seed);
}

}  // namespace tessera::datasets
