// WebDataset shards (datasets/tar_file.h, shard_manifest.h, shard_writer.h, webdataset.h):
// the tar reader against archives written by Python's tarfile (pax long names) and GNU tar,
// the writer's archives read back by both; damaged and truncated archives named with the
// byte offset; shard lists (directory, glob, brace ranges); the stream order (each epoch a
// permutation, the same from any starting point, local to the buffer, seeded); and the
// dataset: labels and pixels as written, held-out shards, manifests checked (size and
// checksum), scanned shards without one, and data.on_error skip counting what it passed.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "common/errors.h"
#include "datasets/data_options.h"
#include "datasets/dataset.h"
#include "datasets/image_dataset.h"
#include "datasets/shard_manifest.h"
#include "datasets/shard_writer.h"
#include "datasets/tar_file.h"
#include "datasets/text_dataset.h"
#include "datasets/webdataset.h"
#include "imaging/image_io.h"
#include "tests/support/error_capture.h"
#include "tests/support/idx_images.h"
#include "tests/support/run_command.h"
#include "tests/support/scratch_path.h"

namespace tessera::datasets {
namespace {

namespace fs = std::filesystem;
using tessera::test::errorOf;
using tessera::test::runCommand;
using tessera::test::shellQuote;

std::string scratch(const std::string& tag) { return tessera::test::scratchPath("tessera_wds", tag); }

std::vector<TarMember> membersOf(const std::string& path) {
  TarReader tar(path);
  std::vector<TarMember> out;
  TarMember m;
  while (tar.next(m)) out.push_back(m);
  return out;
}

std::string fileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void writeBytes(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

TEST(TarFileTest, ReadsWhatPythonsTarfileWritesLongNamesIncluded) {
  const std::string dir = scratch("py");
  fs::create_directories(dir);
  const std::string tar = dir + "/a.tar";
  const std::string longName = std::string(150, 'k') + "/" + std::string(120, 'n') + ".png";
  const std::string script = dir + "/write.py";
  std::ofstream(script) << "import io, sys, tarfile\n"
                           "with tarfile.open(sys.argv[1], 'w', format=tarfile.PAX_FORMAT) as t:\n"
                           "    for name, data in [('x/0001.png', b'abc'), ('x/0001.cls', b'3'),\n"
                           "                       (sys.argv[2], b'z' * 1000), ('dir/', None)]:\n"
                           "        info = tarfile.TarInfo(name)\n"
                           "        if data is None:\n"
                           "            info.type = tarfile.DIRTYPE\n"
                           "            t.addfile(info)\n"
                           "        else:\n"
                           "            info.size = len(data)\n"
                           "            t.addfile(info, io.BytesIO(data))\n";
  const auto r = runCommand(strCat("/usr/bin/python3 ", script, " ", tar, " ", longName));
  ASSERT_EQ(r.status, 0) << r.output;
  const auto members = membersOf(tar);
  ASSERT_EQ(members.size(), 3u);  // the directory is passed over
  EXPECT_EQ(members[0].name, "x/0001.png");
  EXPECT_EQ(members[1].name, "x/0001.cls");
  EXPECT_EQ(members[2].name, longName);  // from the pax 'path' record
  EXPECT_EQ(members[2].size, 1000);
  TarReader reader(tar);
  EXPECT_EQ(reader.readData(members[0], 100), "abc");
  EXPECT_EQ(reader.readData(members[2], 1000), std::string(1000, 'z'));
  EXPECT_NE(errorOf([&] { reader.readData(members[2], 999); }).find("more than the 999"), std::string::npos);
}

TEST(TarFileTest, ReadsWhatGnuTarWritesLongNamesIncluded) {
  const std::string dir = scratch("gnu");
  const std::string longName = std::string(130, 'g') + ".cls";
  fs::create_directories(dir + "/in");
  writeBytes(dir + "/in/s1.png", "png bytes");
  writeBytes(dir + "/in/" + longName, "7");
  const auto r = runCommand(strCat("cd ", dir, "/in && tar --format=gnu -cf ../g.tar s1.png ", longName));
  ASSERT_EQ(r.status, 0) << r.output;
  const auto members = membersOf(dir + "/g.tar");
  ASSERT_EQ(members.size(), 2u);
  EXPECT_EQ(members[0].name, "s1.png");
  EXPECT_EQ(members[1].name, longName);  // from the GNU 'L' header
  EXPECT_EQ(readShardRange(dir + "/g.tar", members[0].offset, members[0].size), "png bytes");
}

TEST(TarFileTest, WhatItWritesGnuTarAndPythonReadBack) {
  const std::string dir = scratch("write");
  fs::create_directories(dir + "/out");
  const std::string tar = dir + "/w.tar";
  const std::string deep = std::string(120, 'd') + "/000001.png";  // beyond 100 bytes: ustar's prefix
  std::string binary(1500, '\0');
  for (size_t i = 0; i < binary.size(); ++i) binary[i] = static_cast<char>(i * 31);
  TarWriter writer(tar);
  writer.add("000000.png", binary);
  writer.add("000000.cls", "2");
  writer.add(deep, "");
  const int64_t size = writer.finish();
  EXPECT_EQ(size, static_cast<int64_t>(fs::file_size(tar)));
  EXPECT_EQ(size % 512, 0);
  const auto listed = runCommand(strCat("tar -tf ", tar));
  ASSERT_EQ(listed.status, 0) << listed.output;
  EXPECT_EQ(listed.output, strCat("000000.png\n000000.cls\n", deep, "\n"));
  ASSERT_EQ(runCommand(strCat("tar -xf ", tar, " -C ", dir, "/out")).status, 0);
  EXPECT_EQ(fileBytes(dir + "/out/000000.png"), binary);
  const auto py = runCommand(strCat("/usr/bin/python3 -c \"import tarfile,sys; t=tarfile.open(sys.argv[1]); "
                                    "print([(m.name, m.size) for m in t.getmembers()][2])\" ",
                                    tar));
  EXPECT_EQ(py.output, strCat("('", deep, "', 0)\n"));
  const auto members = membersOf(tar);
  ASSERT_EQ(members.size(), 3u);
  EXPECT_EQ(members[2].name, deep);
}

TEST(TarFileTest, DamageIsNamedWithTheFileAndByteOffset) {
  const std::string dir = scratch("damage");
  fs::create_directories(dir);
  const std::string tar = dir + "/d.tar";
  {
    TarWriter writer(tar);
    writer.add("a.png", std::string(700, 'a'));
    writer.add("b.png", std::string(10, 'b'));
    writer.finish();
  }
  const std::string good = fileBytes(tar);
  // Cut inside the first member's data.
  writeBytes(tar, good.substr(0, 900));
  std::string e = errorOf([&] { membersOf(tar); });
  EXPECT_NE(e.find(tar), std::string::npos) << e;
  EXPECT_NE(e.find("truncated: the member at byte 0 holds 700 bytes"), std::string::npos) << e;
  // Cut inside the second header.
  writeBytes(tar, good.substr(0, 1536 + 100));
  e = errorOf([&] { membersOf(tar); });
  EXPECT_NE(e.find("inside the header at byte 1536"), std::string::npos) << e;
  // Cut exactly at a member's boundary: no blocks end the archive.
  writeBytes(tar, good.substr(0, 1536));
  e = errorOf([&] { membersOf(tar); });
  EXPECT_NE(e.find("truncated: the file ends at byte 1536 without the blocks that end an archive"), std::string::npos)
      << e;
  writeBytes(tar, "");
  e = errorOf([&] { membersOf(tar); });
  EXPECT_NE(e.find("truncated: the file ends at byte 0"), std::string::npos) << e;
  // A flipped byte in the second header's name: its checksum no longer matches.
  std::string flipped = good;
  flipped[1536] ^= 1;
  writeBytes(tar, flipped);
  e = errorOf([&] { membersOf(tar); });
  EXPECT_NE(e.find("the header at byte 1536 is damaged"), std::string::npos) << e;
  // Not a tar file at all.
  writeBytes(tar, std::string(2048, 'x'));
  e = errorOf([&] { membersOf(tar); });
  EXPECT_NE(e.find("the header at byte 0 is damaged"), std::string::npos) << e;
  // A FIFO is refused, not waited on.
  const std::string fifo = dir + "/f.tar";
  ASSERT_EQ(runCommand("mkfifo " + fifo).status, 0);
  e = tessera::test::errorWithoutBlockingOn(fifo, [fifo] { TarReader t(fifo); });
  EXPECT_NE(e.find(fifo), std::string::npos) << e;
}

TEST(ShardPathsTest, DirectoriesGlobsAndBraceRanges) {
  const std::string dir = scratch("paths");
  fs::create_directories(dir + "/s");
  for (const char* name : {"train-000000.tar", "train-000001.tar", "train-000002.tar", "other.txt", "b.tar"}) {
    writeBytes(dir + "/s/" + name, "");
  }
  EXPECT_EQ(expandShardPaths(dir + "/s"),
            (std::vector<std::string>{dir + "/s/b.tar", dir + "/s/train-000000.tar", dir + "/s/train-000001.tar",
                                      dir + "/s/train-000002.tar"}));
  EXPECT_EQ(expandShardPaths(dir + "/s/train-*.tar").size(), 3u);
  EXPECT_EQ(expandShardPaths(dir + "/s/train-{000001..000002}.tar"),
            (std::vector<std::string>{dir + "/s/train-000001.tar", dir + "/s/train-000002.tar"}));
  EXPECT_EQ(expandShardPaths(dir + "/s/{b,train-000000}.tar"),
            (std::vector<std::string>{dir + "/s/b.tar", dir + "/s/train-000000.tar"}));
  const auto configError = [](const std::string& spec) {
    try {
      expandShardPaths(spec);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    } catch (const std::exception& e) {
      return std::string("not a ConfigError: ") + e.what();
    }
    return std::string("accepted");
  };
  EXPECT_NE(configError(dir + "/s/train-{000001..000003}.tar").find("train-000003.tar': no such file"),
            std::string::npos);
  EXPECT_NE(configError(dir + "/s/train-{000001..000003.tar").find("unmatched '{'"), std::string::npos);
  EXPECT_NE(configError(dir + "/s/x-{a..b}.tar").find("not a range of numbers"), std::string::npos);
  EXPECT_NE(configError(dir + "/s/none-*.tar").find("no file matches"), std::string::npos);
  fs::create_directories(dir + "/empty");
  EXPECT_NE(configError(dir + "/empty").find("holds no .tar file"), std::string::npos);
}

TEST(StreamOrderTest, EachEpochIsAPermutationTheSameFromAnyStart) {
  const std::vector<int64_t> counts{7, 0, 13, 5, 9, 11};  // 45 samples, one empty shard
  StreamOrder order(counts, 8, 3, true);
  ASSERT_EQ(order.samplesPerEpoch(), 45);
  std::vector<StreamOrder::Ref> all;
  for (int64_t p = 0; p < 3 * 45; ++p) all.push_back(order.at(p));
  for (int epoch = 0; epoch < 3; ++epoch) {
    std::set<std::pair<int64_t, int64_t>> seen;
    for (int64_t p = epoch * 45; p < (epoch + 1) * 45; ++p) {
      const auto& r = all[static_cast<size_t>(p)];
      ASSERT_LT(r.sample, counts[static_cast<size_t>(r.shard)]);
      seen.insert({r.shard, r.sample});
    }
    EXPECT_EQ(seen.size(), 45u) << "epoch " << epoch;  // every sample once
  }
  EXPECT_FALSE(std::equal(all.begin(), all.begin() + 45, all.begin() + 45));  // epochs differ
  // A fresh order (a resumed run, another rank) agrees at every position, read from anywhere.
  for (int64_t start : {0, 1, 17, 44, 45, 101}) {
    StreamOrder resumed(counts, 8, 3, true);
    for (int64_t p = start; p < std::min<int64_t>(start + 30, 135); ++p) {
      ASSERT_EQ(resumed.at(p), all[static_cast<size_t>(p)]) << "from " << start << " at " << p;
    }
  }
  // Reading back within the last 4096 positions (kept) and beyond them (replayed) agrees.
  {
    StreamOrder big(std::vector<int64_t>(30, 200), 50, 7, true), reference(std::vector<int64_t>(30, 200), 50, 7, true);
    std::vector<StreamOrder::Ref> expected;
    for (int64_t p = 0; p <= 5000; ++p) expected.push_back(reference.at(p));
    big.at(5000);  // emitted 5001: 905..5000 are the recent ones
    for (int64_t p : {5000, 4000, 905, 904, 0, 5000}) {
      EXPECT_EQ(big.at(p), expected[static_cast<size_t>(p)]) << p;
    }
  }
  // Reading back (a skipped row's lookahead) and jumping between epochs agree too.
  EXPECT_EQ(order.at(3), all[3]);
  EXPECT_EQ(order.at(100), all[100]);
  EXPECT_EQ(order.at(50), all[50]);
  // Another seed, another order; no shuffle: the file order.
  StreamOrder other(counts, 8, 4, true);
  int same = 0;
  for (int64_t p = 0; p < 45; ++p) same += other.at(p) == all[static_cast<size_t>(p)] ? 1 : 0;
  EXPECT_LT(same, 10);
  StreamOrder plain(counts, 8, 3, false);
  EXPECT_EQ(plain.at(0), (StreamOrder::Ref{0, 0}));
  EXPECT_EQ(plain.at(7), (StreamOrder::Ref{2, 0}));
  EXPECT_EQ(plain.at(20), (StreamOrder::Ref{3, 0}));
  EXPECT_EQ(plain.at(45 + 20), (StreamOrder::Ref{3, 0}));  // every epoch in file order
}

TEST(StreamOrderTest, TheBufferKeepsReadsLocalToAFewShards) {
  // 100 shards of 50: with a buffer of 20, the first 200 positions come from the shards
  // read first in the epoch's order (at most 200 + 20 samples in: 5 shards), never from all.
  StreamOrder order(std::vector<int64_t>(100, 50), 20, 9, true);
  std::set<int64_t> shards;
  for (int64_t p = 0; p < 200; ++p) shards.insert(order.at(p).shard);
  EXPECT_LE(shards.size(), 5u);
  EXPECT_GE(shards.size(), 4u);
}

// Shards of the tests' 96 IDX images, 10 a shard, with train and eval directories.
std::string writeShards(const std::string& dir) {
  const auto [images, labels] = tessera::test::writeIdxImages(dir + "/idx");
  DataOptions d;
  d.kind = "idx";
  d.path = images;
  d.labels = labels;
  d.eval_path = images;
  d.eval_labels = labels;
  const ShardWriteSummary s = writeImageShards(d, dir + "/shards", 10);
  EXPECT_EQ(s.train.shards.size(), 10u);
  EXPECT_EQ(s.train.shards.back().samples, 6);
  EXPECT_EQ(s.train.classes, 4);
  return dir + "/shards";
}

DataOptions webOptions(const std::string& shards) {
  DataOptions d;
  d.kind = "webdataset";
  d.path = shards + "/train";
  d.eval_path = shards + "/eval";
  d.shuffle_buffer = 16;
  return d;
}

TEST(WebDatasetTest, SamplesAreTheImagesAndLabelsWrittenInTheStreamOrder) {
  const std::string dir = scratch("data");
  const std::string shards = writeShards(dir);
  const auto [images, labels] = tessera::test::writeIdxImages(dir + "/idx");
  const at::Tensor pixels = readIdxImages(images), classes = readIdxLabels(labels);
  const auto data = makeDataset(webOptions(shards), {}, /*orderSeed=*/5);
  ASSERT_TRUE(data->streams());
  EXPECT_EQ(data->trainSamples(), 96);
  EXPECT_EQ(data->evalSamples(), 96);
  EXPECT_EQ(data->spec().inputShape, (std::vector<int64_t>{1, 8, 8}));
  EXPECT_EQ(data->spec().classes, 4);
  // Held-out samples in file order: sample i is IDX image i.
  const Batch eval = data->evalBatch(90, 6);
  for (int64_t i = 0; i < 6; ++i) {
    EXPECT_EQ(eval.targets[i].item<int64_t>(), classes[90 + i].item<int64_t>());
    EXPECT_TRUE(at::allclose(eval.inputs[i], pixels[90 + i].to(at::kFloat).div(127.5).sub(1.0), 1e-6, 1e-6));
  }
  // The stream order: sample k of shard s is IDX image 10 s + k.
  StreamOrder order(std::vector<int64_t>{10, 10, 10, 10, 10, 10, 10, 10, 10, 6}, 16, 5, true);
  std::vector<int64_t> positions;
  for (int64_t p = 90; p < 110; ++p) positions.push_back(p);  // across the epoch's end
  const Batch batch = data->trainBatch(positions);
  for (size_t i = 0; i < positions.size(); ++i) {
    const auto ref = order.at(positions[i]);
    const int64_t image = ref.shard * 10 + ref.sample;
    EXPECT_EQ(batch.targets[static_cast<int64_t>(i)].item<int64_t>(), classes[image].item<int64_t>());
    EXPECT_TRUE(at::allclose(batch.inputs[static_cast<int64_t>(i)],
                             pixels[image].to(at::kFloat).div(127.5).sub(1.0), 1e-6, 1e-6));
  }
  // A rank's rows are the same samples as the one-process batch's rows.
  DistributedSampler sampler(96, 24, 5, SampleOrder::kStream);
  const auto rows = sampler.indicesFor(4, 2, 3);
  EXPECT_EQ(rows.front(), 4 * 24 + 16);
  EXPECT_EQ(rows.size(), 8u);
  const Batch part = data->trainBatch(rows);
  const Batch whole = data->trainBatch(sampler.indicesFor(4, 0, 1));
  EXPECT_TRUE(at::equal(part.inputs, whole.inputs.slice(0, 16, 24)));
  EXPECT_EQ(data->skipped().samples, 0);
}

TEST(WebDatasetTest, ShardsWithoutAManifestAreScannedAndJsonLabelsRead) {
  const std::string dir = scratch("nomanifest");
  fs::create_directories(dir);
  const at::Tensor a = at::full({1, 4, 4}, 10, at::kByte), b = at::full({1, 4, 4}, 200, at::kByte);
  {
    TarWriter t(dir + "/one.tar");
    t.add("s/0.png", imaging::encodePng(a));
    t.add("s/0.json", R"({"label": 2, "caption": "dark"})");
    t.add("s/1.png", imaging::encodePng(b));
    t.add("s/1.cls", " 5\n");
    t.add("README", "not a sample");
    t.finish();
  }
  DataOptions d;
  d.kind = "webdataset";
  d.path = dir + "/one.tar";
  d.shuffle = false;
  const auto data = makeDataset(d, {});
  EXPECT_EQ(data->trainSamples(), 2);
  EXPECT_EQ(data->spec().classes, 6);
  EXPECT_NE(data->describe().find("1 shards without a manifest entry were scanned"), std::string::npos);
  const Batch batch = data->trainBatch({0, 1, 2});
  EXPECT_EQ(batch.targets[0].item<int64_t>(), 2);
  EXPECT_EQ(batch.targets[1].item<int64_t>(), 5);
  EXPECT_EQ(batch.targets[2].item<int64_t>(), 2);  // the next epoch
  EXPECT_EQ(data->evalSamples(), 0);
  // A sample without a label, or with a label that is not a class number, is named.
  {
    TarWriter t(dir + "/two.tar");
    t.add("k7.png", imaging::encodePng(a));
    t.add("k8.png", imaging::encodePng(a));
    t.add("k8.cls", "cat");
    t.finish();
  }
  d.path = dir + "/two.tar";
  const std::string e = errorOf([&] { makeDataset(d, {}); });
  EXPECT_NE(e.find("sample 'k7' of shard '" + dir + "/two.tar' (its header at byte 0): it holds no .cls or .json label"),
            std::string::npos)
      << e;
}

// Round 4, class 5: members that are no sample (a licence, a dataset description, hidden
// files) are passed over as WebDataset's readers do, not refused; class 2: text from a shard
// is quoted and escaped wherever a message shows it, so a member name holding a newline
// cannot forge a log line; a JSON label of 2^64-1 is shown as written.
TEST(WebDatasetTest, MembersThatAreNoSampleArePassedOverAndShardTextIsQuoted) {
  const std::string dir = scratch("extras");
  fs::create_directories(dir);
  const at::Tensor a = at::full({1, 4, 4}, 10, at::kByte);
  {
    TarWriter t(dir + "/one.tar");
    t.add("LICENSE.txt", "CC-BY 4.0");
    t.add("dataset_info.json", R"({"name": "tiny", "splits": ["train"]})");
    t.add(".hidden.png", imaging::encodePng(a));
    t.add("s/.DS_Store", "finder");
    t.add("s/0.png", imaging::encodePng(a));
    t.add("s/0.cls", "1");
    t.add("s/0.txt", "a caption");
    t.add("s/1.png", imaging::encodePng(a));
    t.add("s/1.cls", "2");
    t.finish();
  }
  DataOptions d;
  d.kind = "webdataset";
  d.path = dir + "/one.tar";
  d.shuffle = false;
  const auto data = makeDataset(d, {});
  EXPECT_EQ(data->trainSamples(), 2);
  EXPECT_EQ(data->spec().classes, 3);
  EXPECT_NE(data->describe().find("2 groups of members that are no sample (no image, no label) passed over"),
            std::string::npos)
      << data->describe();
  {
    TarWriter t(dir + "/forged.tar");
    t.add("x\ntessera-train: done: 300 steps.png", imaging::encodePng(a));
    t.finish();
  }
  d.path = dir + "/forged.tar";
  const std::string forged = errorOf([&] { makeDataset(d, {}); });
  EXPECT_EQ(forged.find('\n'), std::string::npos) << forged;
  EXPECT_NE(forged.find(R"('x\ntessera-train: done: 300 steps')"), std::string::npos) << forged;
  {
    TarWriter t(dir + "/forged_label.tar");
    t.add("s/0.png", imaging::encodePng(a));
    t.add("s/0.cls", "x\ntessera-train: done: 300 steps");
    t.finish();
  }
  d.path = dir + "/forged_label.tar";
  const std::string label = errorOf([&] { makeDataset(d, {}); });
  EXPECT_EQ(label.find('\n'), std::string::npos) << label;
  EXPECT_NE(label.find(R"(its .cls is not a class number ('x\ntessera-train: don)"), std::string::npos) << label;
  {
    TarWriter t(dir + "/huge_label.tar");
    t.add("k.png", imaging::encodePng(a));
    t.add("k.json", R"({"label": 18446744073709551615})");
    t.finish();
  }
  d.path = dir + "/huge_label.tar";
  const std::string huge = errorOf([&] { makeDataset(d, {}); });
  EXPECT_NE(huge.find("its .json label 18446744073709551615 is not a class number"), std::string::npos) << huge;
  EXPECT_EQ(huge.find("label -1"), std::string::npos) << huge;
}

// Round 4, class 3: held-out shards naming a class the training shards never do are
// refused (the model is sized by the training shards; IDX data refuses this too), and a
// shard replaced by another of the same name and sample count changes the fingerprint a
// resume compares.
TEST(WebDatasetTest, ForeignClassesInTheHeldOutShardsAndReplacedShardsAreNoticed) {
  const std::string dir = scratch("classes");
  fs::create_directories(dir + "/train");
  fs::create_directories(dir + "/eval");
  const at::Tensor a = at::full({1, 4, 4}, 10, at::kByte), b = at::full({1, 4, 4}, 90, at::kByte);
  const auto shard = [&](const std::string& path, const std::vector<std::pair<std::string, int>>& samples) {
    TarWriter t(path);
    for (const auto& [key, label] : samples) {
      t.add(key + ".png", imaging::encodePng(label % 2 == 0 ? a : b));
      t.add(key + ".cls", std::to_string(label));
    }
    t.finish();
  };
  shard(dir + "/train/0.tar", {{"a", 0}, {"b", 1}});
  shard(dir + "/eval/0.tar", {{"c", 0}, {"d", 7}});
  DataOptions d;
  d.kind = "webdataset";
  d.path = dir + "/train";
  d.eval_path = dir + "/eval";
  try {
    makeDataset(d, {});
    FAIL() << "held-out class 7 accepted";
  } catch (const DataFileError& e) {
    EXPECT_EQ(e.key(), "data.eval_path");
    EXPECT_NE(std::string(e.what()).find("the held-out shards name class 7, which the training shards"),
              std::string::npos)
        << e.what();
  }
  d.eval_path.clear();
  const std::string before = makeDataset(d, {})->fingerprint();
  shard(dir + "/train/0.tar", {{"e", 1}, {"f", 0}});  // the same name and count, other samples
  const std::string after = makeDataset(d, {})->fingerprint();
  EXPECT_NE(before, after);
  EXPECT_EQ(before.substr(0, before.find("; contents")), after.substr(0, after.find("; contents")))
      << "names and counts alone would not tell them apart";
}

TEST(WebDatasetTest, TruncatedOrChangedShardsAreNamedAndSkipCounts) {
  const std::string dir = scratch("bad");
  const std::string shards = writeShards(dir);
  const std::string victim = shards + "/train/train-000003.tar";
  const std::string good = fileBytes(victim);
  writeBytes(victim, good.substr(0, 5000));
  DataOptions d = webOptions(shards);
  std::string e = errorOf([&] { makeDataset(d, {}, 1); });
  EXPECT_NE(e.find("shard '" + victim + "' is 5000 bytes, its manifest says " + std::to_string(good.size()) +
                   ": truncated at byte 5000"),
            std::string::npos)
      << e;
  // skip: the shard is left out, and said so.
  d.on_error = "skip";
  auto data = makeDataset(d, {}, 1);
  EXPECT_EQ(data->trainSamples(), 86);
  EXPECT_NE(data->describe().find("data.on_error skip: shard '" + victim + "'"), std::string::npos);
  {
    // Held out from the same shards: sample 30 of the split is the first of shard 4 (IDX
    // image 40), the left-out shard 3 holding none.
    DataOptions heldOut = d;
    heldOut.eval_path = shards + "/train";
    const auto withEval = makeDataset(heldOut, {}, 1);
    ASSERT_EQ(withEval->evalSamples(), 86);
    const auto [images, labels] = tessera::test::writeIdxImages(dir + "/idx");
    const at::Tensor pixels = readIdxImages(images);
    const Batch eval = withEval->evalBatch(29, 2);
    EXPECT_TRUE(at::allclose(eval.inputs[0], pixels[29].to(at::kFloat).div(127.5).sub(1.0), 1e-6, 1e-6));
    EXPECT_TRUE(at::allclose(eval.inputs[1], pixels[40].to(at::kFloat).div(127.5).sub(1.0), 1e-6, 1e-6));
  }
  // Same size, other bytes: found by the checksum when the shard is first read.
  std::string changed = good;
  changed[3000] ^= 0x40;  // inside a PNG's data
  writeBytes(victim, changed);
  d.on_error = "fail";
  d.shuffle = false;
  data = makeDataset(d, {}, 1);
  std::vector<int64_t> shard3;
  for (int64_t p = 30; p < 40; ++p) shard3.push_back(p);
  e = errorOf([&] { data->trainBatch(shard3); });
  EXPECT_NE(e.find("shard '" + victim + "': its checksum is"), std::string::npos) << e;
  // skip: each unreadable row takes the next readable position and is counted.
  d.on_error = "skip";
  data = makeDataset(d, {}, 1);
  const Batch batch = data->trainBatch({29, 30});
  EXPECT_EQ(batch.size(), 2);
  EXPECT_EQ(data->skipped().samples, 10);  // position 30 passed over shard 3 to position 40
  EXPECT_NE(data->skipped().last.find(victim), std::string::npos);
  // Rows 31 and 32 pass over the same positions again: counted once.
  const Batch again = data->trainBatch({31, 32, 41});
  EXPECT_EQ(again.size(), 3);
  EXPECT_EQ(data->skipped().samples, 10);
  EXPECT_TRUE(at::equal(again.inputs[0], batch.inputs[1]));  // both took position 40
}

TEST(ShardManifestTest, MalformedManifestsAreNamed) {
  const std::string dir = scratch("manifest");
  fs::create_directories(dir);
  const std::string path = dir + "/manifest.json";
  EXPECT_FALSE(readShardManifest(dir).has_value());
  const auto errorFor = [&](const std::string& text) {
    writeBytes(path, text);
    return errorOf([&] { readShardManifest(dir); });
  };
  EXPECT_NE(errorFor("{").find("not a JSON object"), std::string::npos);
  EXPECT_NE(errorFor(R"({"format": "x", "classes": 1, "shards": []})").find("format is not"), std::string::npos);
  const std::string head = R"({"format": "tessera-webdataset-1", "classes": 3, "shards": [)";
  EXPECT_NE(errorFor(head + R"({"name": "../a.tar", "samples": 1, "bytes": 1, "xxh3": "0000000000000000"}]})")
                .find("shards[0]: \"name\" is not a file name"),
            std::string::npos);
  EXPECT_NE(errorFor(head + R"({"name": "a.tar", "samples": -1, "bytes": 1, "xxh3": "0000000000000000"}]})")
                .find("\"samples\" is not a count"),
            std::string::npos);
  EXPECT_NE(errorFor(head + R"({"name": "a.tar", "samples": 1, "bytes": 1, "xxh3": "xyz"}]})").find("16 hex digits"),
            std::string::npos);
  EXPECT_NE(errorFor(std::string(100, '[')).find("nested too deep"), std::string::npos);
  ShardManifest m;
  m.classes = 3;
  m.add({"a.tar", 4, 4096, 0x0123456789abcdefULL});
  writeShardManifest(dir, m);
  const auto back = readShardManifest(dir);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->classes, 3);
  ASSERT_EQ(back->shards.size(), 1u);
  EXPECT_EQ(back->shards[0].xxh3, 0x0123456789abcdefULL);
  EXPECT_EQ(back->shards[0].samples, 4);
  EXPECT_EQ(back->find("a.tar"), &back->shards[0]);
  EXPECT_NE(errorFor(head + R"({"name": "a.tar", "samples": 3, "bytes": 2048, "xxh3": "0000000000000000"}]})")
                .find("3 samples cannot fit in 2048 bytes"),
            std::string::npos);
  const std::string twice = R"({"name": "a.tar", "samples": 1, "bytes": 2048, "xxh3": "0000000000000000"})";
  EXPECT_NE(errorFor(head + twice + "," + twice + "]}").find("shard 'a.tar' is listed twice"), std::string::npos);
  EXPECT_NE(errorFor(R"({"format": "tessera-webdataset-1", "classes": 1000000000000, "shards": []})")
                .find("is above 1048576"),
            std::string::npos);
}

TEST(ShardWriterTest, ImageFoldersAreCopiedAsTheyAreAndAWrittenDirectoryIsNotOverwritten) {
  const std::string dir = scratch("folder");
  for (const char* cls : {"cat", "dog"}) fs::create_directories(dir + "/in/" + cls);
  const at::Tensor img = at::full({3, 5, 5}, 90, at::kByte);
  const std::string png = imaging::encodePng(img);
  writeBytes(dir + "/in/cat/a.png", png);
  writeBytes(dir + "/in/dog/b.PNG", png);
  writeBytes(dir + "/in/dog/c.png", png);
  DataOptions d;
  d.kind = "image_folder";
  d.path = dir + "/in";
  const auto s = writeImageShards(d, dir + "/out", 2);
  ASSERT_EQ(s.train.shards.size(), 2u);
  EXPECT_EQ(s.train.classes, 2);
  EXPECT_TRUE(s.evalDirectory.empty());
  const auto members = membersOf(dir + "/out/train/train-000000.tar");
  ASSERT_EQ(members.size(), 4u);
  EXPECT_EQ(members[0].name, "00000000.png");
  EXPECT_EQ(readShardRange(dir + "/out/train/train-000000.tar", members[0].offset, members[0].size), png);
  EXPECT_EQ(readShardRange(dir + "/out/train/train-000000.tar", members[3].offset, members[3].size), "1");
  const std::string e = errorOf([&] { writeImageShards(d, dir + "/out", 2); });
  EXPECT_NE(e.find("already holds shards"), std::string::npos) << e;
  d.kind = "text";
  EXPECT_NE(errorOf([&] { writeImageShards(d, dir + "/out2", 2); }).find("not text"), std::string::npos);
}

}  // namespace
}  // namespace tessera::datasets
