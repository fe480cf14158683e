// Tests of the config schema machinery: loading, overrides, and every error kind,
// each checked for the key path and the YAML line:column it names.
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>

#include "common/config.h"
#include "common/errors.h"

namespace tessera::config {
namespace {

struct Options {
  std::string name = "demo";
  int64_t steps = 200;
  double lr = 3e-4;
  double decay = 0.999;
  bool shuffle = true;
  std::optional<std::string> initFrom;
  std::vector<int64_t> dims = {4, 8};
  std::vector<double> betas = {0.9, 0.999};
  std::vector<std::string> wrap = {"blocks"};
  std::string arch = "mlp";
  std::string path;
};

// Runs `fn`, expects a ConfigError, returns its message.
template <typename Fn>
std::string errorOf(Fn fn) {
  try {
    fn();
  } catch (const ConfigError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected ConfigError, got: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected ConfigError, nothing was thrown";
  return "";
}

class ConfigSchemaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    schema.add("run.name", &o.name, "name").nonEmpty();
    schema.add("run.steps", &o.steps, "steps").min(1);
    schema.add("optim.lr", &o.lr, "lr").greaterThan(0.0);
    schema.add("ema.decay", &o.decay, "decay").min(0.0).lessThan(1.0);
    schema.add("data.shuffle", &o.shuffle, "shuffle");
    schema.add("model.init_from", &o.initFrom, "init");
    schema.add("model.dims", &o.dims, "dims").min(1).nonEmpty();
    schema.add("optim.betas", &o.betas, "betas").min(0.0).lessThan(1.0).size(2);
    schema.add("sharding.wrap", &o.wrap, "wrap");
    schema.add("model.arch", &o.arch, "arch").oneOf({"mlp", "gpt"});
    schema.add("data.path", &o.path, "path").required();
  }


  Options o;
  ConfigSchema schema;
};

TEST_F(ConfigSchemaTest, DefaultsStayWhenKeysAreAbsent) {
  schema.loadString("run:\n  steps: 5\n", "a.yaml");
  EXPECT_EQ(o.steps, 5);
  EXPECT_EQ(o.name, "demo");
  EXPECT_DOUBLE_EQ(o.lr, 3e-4);
  EXPECT_EQ(schema.locationOf("run.steps").str(), "a.yaml:2:10");
  EXPECT_EQ(schema.locationOf("run.name").str(), "<default>");
}

// Writes `text` to a file in a fresh temporary directory and returns its path.
std::string writeConfig(const std::string& dir, const std::string& name, const std::string& text) {
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST_F(ConfigSchemaTest, BaseFileIsReadFirstAndOverridden) {
  const std::string dir = (std::filesystem::temp_directory_path() / "tessera_config_base").string();
  writeConfig(dir, "root.yaml", "run: {name: root, steps: 10}\noptim: {lr: 0.5}\ndata: {path: /tmp/x}\n");
  writeConfig(dir + "/sub", "mid.yaml", "base: ../root.yaml\nrun: {steps: 20}\n");
  const std::string leaf = writeConfig(dir + "/sub", "leaf.yaml", "base: mid.yaml\noptim:\n  lr: 0.25\n");
  schema.loadFile(leaf);
  EXPECT_EQ(o.name, "root");        // from root.yaml
  EXPECT_EQ(o.steps, 20);           // mid.yaml overrides root.yaml
  EXPECT_DOUBLE_EQ(o.lr, 0.25);     // leaf.yaml overrides both
  EXPECT_EQ(schema.locationOf("optim.lr").str(), leaf + ":3:7");
  EXPECT_EQ(schema.locationOf("run.name").str(), dir + "/root.yaml:1:13");

  const std::string a = writeConfig(dir, "a.yaml", "base: b.yaml\n");
  writeConfig(dir, "b.yaml", "base: a.yaml\n");
  EXPECT_NE(errorOf([&] { schema.loadFile(a); }).find("a cycle of base files"), std::string::npos);
  const std::string missing = writeConfig(dir, "missing.yaml", "base: nope.yaml\n");
  EXPECT_NE(errorOf([&] { schema.loadFile(missing); }).find(dir + "/nope.yaml: cannot read config file"),
            std::string::npos);
  const std::string bad = writeConfig(dir, "bad.yaml", "base: [x]\n");
  EXPECT_NE(errorOf([&] { schema.loadFile(bad); }).find("base: expected the path of a config file"), std::string::npos);
  EXPECT_NE(errorOf([&] { schema.loadString("base: root.yaml\n", "s.yaml"); }).find("only allowed in config files"),
            std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_F(ConfigSchemaTest, LoadsEveryType) {
  schema.loadString(
      "run: {name: x, steps: 7}\n"
      "optim: {lr: 1.5e-3, betas: [0.8, 0.95]}\n"
      "ema: {decay: 0.5}\n"
      "data: {shuffle: false, path: /tmp/t}\n"
      "model: {init_from: w.safetensors, dims: [3, 5, 2], arch: gpt}\n"
      "sharding: {wrap: [a, b]}\n",
      "t.yaml");
  EXPECT_EQ(o.name, "x");
  EXPECT_EQ(o.steps, 7);
  EXPECT_DOUBLE_EQ(o.lr, 1.5e-3);
  EXPECT_EQ(o.betas, (std::vector<double>{0.8, 0.95}));
  EXPECT_DOUBLE_EQ(o.decay, 0.5);
  EXPECT_FALSE(o.shuffle);
  EXPECT_EQ(o.path, "/tmp/t");
  EXPECT_EQ(o.initFrom, std::optional<std::string>("w.safetensors"));
  EXPECT_EQ(o.dims, (std::vector<int64_t>{3, 5, 2}));
  EXPECT_EQ(o.arch, "gpt");
  EXPECT_EQ(o.wrap, (std::vector<std::string>{"a", "b"}));
  schema.loadString("model: {init_from: null}\n", "u.yaml");
  EXPECT_FALSE(o.initFrom.has_value());
}

TEST_F(ConfigSchemaTest, UnknownKeySuggestsClosest) {
  std::string msg = errorOf([&] { schema.loadString("optim:\n  lrr: 0.1\n", "c.yaml"); });
  EXPECT_NE(msg.find("c.yaml:2:3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("optim.lrr"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unknown key"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean 'optim.lr'"), std::string::npos) << msg;
}

TEST_F(ConfigSchemaTest, UnknownSectionSuggestsClosest) {
  std::string msg = errorOf([&] { schema.loadString("optm:\n  lr: 0.1\n", "c.yaml"); });
  EXPECT_NE(msg.find("c.yaml:1:1: optm: unknown key (did you mean 'optim'?)"), std::string::npos) << msg;
}

TEST_F(ConfigSchemaTest, WrongTypeNamesKeyAndLine) {
  std::string msg = errorOf([&] { schema.loadString("run:\n  steps: 3\noptim:\n  lr: fast\n", "w.yaml"); });
  EXPECT_NE(msg.find("w.yaml:4:7: optim.lr: expected a number, got 'fast'"), std::string::npos) << msg;
  msg = errorOf([&] { schema.loadString("run:\n  steps: 2.5\n", "w.yaml"); });
  EXPECT_NE(msg.find("w.yaml:2:10: run.steps: expected an integer"), std::string::npos) << msg;
  msg = errorOf([&] { schema.loadString("data:\n  shuffle: maybe\n", "w.yaml"); });
  EXPECT_NE(msg.find("w.yaml:2:12: data.shuffle: expected true or false"), std::string::npos) << msg;
  msg = errorOf([&] { schema.loadString("model:\n  dims: 5\n", "w.yaml"); });
  EXPECT_NE(msg.find("model.dims: expected a list of integers"), std::string::npos) << msg;
  msg = errorOf([&] { schema.loadString("model:\n  dims: [1, x]\n", "w.yaml"); });
  EXPECT_NE(msg.find("w.yaml:2:13: model.dims[1]: expected an integer, got 'x'"), std::string::npos) << msg;
  msg = errorOf([&] { schema.loadString("run: 5\n", "w.yaml"); });
  EXPECT_NE(msg.find("w.yaml:1:1: run: is a section: expected a mapping"), std::string::npos) << msg;
  msg = errorOf([&] { schema.loadString("run:\n  name: [a]\n", "w.yaml"); });
  EXPECT_NE(msg.find("w.yaml:2:9: run.name: expected a string, got a list"), std::string::npos) << msg;
}

TEST_F(ConfigSchemaTest, OutOfRangeValues) {
  std::string msg = errorOf([&] { schema.loadString("run:\n  steps: -1\n", "r.yaml"); });
  EXPECT_NE(msg.find("r.yaml:2:10: run.steps: value -1 is out of range: must be >= 1"), std::string::npos) << msg;
  msg = errorOf([&] { schema.loadString("ema:\n  decay: 1.5\n", "r.yaml"); });
  EXPECT_NE(msg.find("r.yaml:2:10: ema.decay: value 1.5 is out of range: must be < 1"), std::string::npos) << msg;
  msg = errorOf([&] { schema.loadString("optim:\n  lr: 0\n", "r.yaml"); });
  EXPECT_NE(msg.find("optim.lr: value 0 is out of range: must be > 0"), std::string::npos) << msg;
  msg = errorOf([&] { schema.loadString("model:\n  arch: rnn\n", "r.yaml"); });
  EXPECT_NE(msg.find("r.yaml:2:9: model.arch: 'rnn' is not one of: mlp, gpt"), std::string::npos) << msg;
  msg = errorOf([&] { schema.loadString("optim:\n  betas: [0.9]\n", "r.yaml"); });
  EXPECT_NE(msg.find("optim.betas: expected 2 elements, got 1"), std::string::npos) << msg;
  msg = errorOf([&] { schema.loadString("model:\n  dims: []\n", "r.yaml"); });
  EXPECT_NE(msg.find("model.dims: must not be empty"), std::string::npos) << msg;
  msg = errorOf([&] { schema.loadString("model:\n  dims: [4, 0]\n", "r.yaml"); });
  EXPECT_NE(msg.find("r.yaml:2:13: model.dims[1]: value 0 is out of range"), std::string::npos) << msg;
}

TEST_F(ConfigSchemaTest, MissingRequiredKey) {
  schema.loadString("data:\n  shuffle: true\n", "m.yaml");
  std::string msg = errorOf([&] { schema.checkRequired(); });
  EXPECT_NE(msg.find("m.yaml:2:12: data.path: missing required key"), std::string::npos) << msg;
  ConfigSchema empty;
  std::string p;
  empty.add("data.path", &p, "p").required();
  msg = errorOf([&] { empty.checkRequired(); });
  EXPECT_NE(msg.find("data.path: missing required key"), std::string::npos) << msg;
}

TEST_F(ConfigSchemaTest, MalformedAndUnreadable) {
  std::string msg = errorOf([&] { schema.loadString("run:\n  steps: [1, 2\n", "bad.yaml"); });
  EXPECT_NE(msg.find("bad.yaml:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("malformed YAML"), std::string::npos) << msg;
  msg = errorOf([&] { schema.loadFile("/nonexistent/dir/x.yaml"); });
  EXPECT_NE(msg.find("/nonexistent/dir/x.yaml: cannot read config file"), std::string::npos) << msg;
  msg = errorOf([&] { schema.loadString("- a\n- b\n", "list.yaml"); });
  EXPECT_NE(msg.find("list.yaml:1:1: <root>: expected a mapping"), std::string::npos) << msg;
  msg = errorOf([&] { schema.loadString("run:\n  steps: 1\n  steps: 2\n", "dup.yaml"); });
  EXPECT_NE(msg.find("dup.yaml:3:3: run.steps: duplicate key"), std::string::npos) << msg;
}

TEST_F(ConfigSchemaTest, OverridesAreTypedLikeTheirKey) {
  schema.applyOverride("run.steps=12");
  schema.applyOverride("optim.lr=1e-2");
  schema.applyOverride("model.dims=[2,3]");
  schema.applyOverride("run.name=a: b");
  schema.applyOverride("data.shuffle=false");
  schema.applyOverride("model.init_from=null");
  EXPECT_EQ(o.steps, 12);
  EXPECT_DOUBLE_EQ(o.lr, 1e-2);
  EXPECT_EQ(o.dims, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(o.name, "a: b");
  EXPECT_FALSE(o.shuffle);
  EXPECT_EQ(schema.locationOf("run.steps").str(), "--set run.steps=12");

  std::string msg = errorOf([&] { schema.applyOverride("run.steps=abc"); });
  EXPECT_NE(msg.find("--set run.steps=abc: run.steps: expected an integer, got 'abc'"), std::string::npos) << msg;
  msg = errorOf([&] { schema.applyOverride("optim.lrate=1"); });
  EXPECT_NE(msg.find("optim.lrate: unknown key (did you mean 'optim.lr'?)"), std::string::npos) << msg;
  msg = errorOf([&] { schema.applyOverride("optim=1"); });
  EXPECT_NE(msg.find("optim: is a section"), std::string::npos) << msg;
  msg = errorOf([&] { schema.applyOverride("novalue"); });
  EXPECT_NE(msg.find("expected KEY=VALUE"), std::string::npos) << msg;
  msg = errorOf([&] { schema.applyOverride("ema.decay=1.5"); });
  EXPECT_NE(msg.find("ema.decay: value 1.5 is out of range"), std::string::npos) << msg;
}

TEST_F(ConfigSchemaTest, ResolvedYamlRoundTrips) {
  schema.loadString("run: {steps: 9}\ndata: {path: \"/x y\"}\noptim: {lr: 0.5}\n", "a.yaml");
  const std::string yaml = schema.toYaml();
  Options copy;
  ConfigSchema second;
  second.add("run.name", &copy.name, "");
  second.add("run.steps", &copy.steps, "");
  second.add("optim.lr", &copy.lr, "");
  second.add("ema.decay", &copy.decay, "");
  second.add("data.shuffle", &copy.shuffle, "");
  second.add("model.init_from", &copy.initFrom, "");
  second.add("model.dims", &copy.dims, "");
  second.add("optim.betas", &copy.betas, "");
  second.add("sharding.wrap", &copy.wrap, "");
  second.add("model.arch", &copy.arch, "");
  second.add("data.path", &copy.path, "");
  second.loadString(yaml, "resolved.yaml");
  EXPECT_EQ(copy.steps, 9);
  EXPECT_EQ(copy.path, "/x y");
  EXPECT_DOUBLE_EQ(copy.lr, 0.5);
  EXPECT_EQ(copy.betas, o.betas);
  EXPECT_EQ(copy.dims, o.dims);
  EXPECT_EQ(second.toYaml(), yaml);
}

// Keys that are not one plain variable: an enum through its name table, two numbers
// written as a list, a size written in MiB and held in bytes, an int, and a map. Each
// loads, overrides, prints back as written, and refuses a bad value naming the key.
TEST(ConfigTargetsTest, ChoicePairScaledIntAndMapBind) {
  enum class Kind { kAlpha, kBeta };
  constexpr std::array<EnumName<Kind>, 2> kKindNames = {{{"alpha", Kind::kAlpha}, {"beta", Kind::kBeta}}};
  Kind kind = Kind::kAlpha;
  double first = 0.9, second = 0.999;
  int64_t bytes = 25 * 1024 * 1024;
  int count = 1;
  std::map<std::string, double> scales;
  ConfigSchema schema;
  schema.add("a.kind", choiceOf(&kind, kKindNames), "kind");
  schema.add("a.betas", PairTarget{&first, &second}, "betas").min(0.0).lessThan(1.0);
  schema.add("a.bucket_mb", ScaledTarget{&bytes, 1024.0 * 1024.0}, "bucket").greaterThan(0.0);
  schema.add("a.count", &count, "count").min(0).max(16);
  schema.add("a.scales", &scales, "scales").greaterThan(0.0);
  EXPECT_NE(schema.toYaml().find("kind: alpha"), std::string::npos) << schema.toYaml();
  EXPECT_NE(schema.toYaml().find("bucket_mb: 25"), std::string::npos) << schema.toYaml();

  schema.loadString("a:\n  kind: beta\n  betas: [0.5, 0.75]\n  bucket_mb: 0.5\n  count: 3\n"
                    "  scales: {\"wte.*\": 0.1, head.weight: 2}\n",
                    "t.yaml");
  EXPECT_EQ(kind, Kind::kBeta);
  EXPECT_EQ(first, 0.5);
  EXPECT_EQ(second, 0.75);
  EXPECT_EQ(bytes, 512 * 1024);
  EXPECT_EQ(count, 3);
  EXPECT_EQ(scales, (std::map<std::string, double>{{"wte.*", 0.1}, {"head.weight", 2.0}}));
  const std::string yaml = schema.toYaml();
  EXPECT_NE(yaml.find("kind: beta"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("betas: [0.5, 0.75]"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("bucket_mb: 0.5"), std::string::npos) << yaml;
  schema.applyOverride("a.bucket_mb=0.1");  // 104857.6 bytes: rounds, and prints as written
  EXPECT_EQ(bytes, 104858);
  EXPECT_NE(schema.toYaml().find("bucket_mb: 0.1\n"), std::string::npos) << schema.toYaml();
  schema.applyOverride("a.bucket_mb=0.5");

  schema.applyOverride("a.kind=alpha");
  EXPECT_EQ(kind, Kind::kAlpha);
  schema.applyOverride("a.scales={x: 3}");
  EXPECT_EQ(scales, (std::map<std::string, double>{{"x", 3.0}}));

  EXPECT_NE(errorOf([&] { schema.applyOverride("a.kind=gamma"); }).find("a.kind: 'gamma' is not one of: alpha, beta"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { schema.applyOverride("a.betas=[0.5]"); }).find("a.betas: expected 2 elements, got 1"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { schema.applyOverride("a.betas=[0.5, 1.5]"); }).find("a.betas[1]: value 1.5 is out of range"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { schema.applyOverride("a.bucket_mb=0"); }).find("a.bucket_mb: value 0 is out of range"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { schema.applyOverride("a.count=17"); }).find("a.count: value 17 is out of range"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { schema.applyOverride("a.count=99999999999"); }).find("does not fit an int"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { schema.applyOverride("a.scales={x: -1}"); }).find("a.scales.x: value -1 is out of range"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { schema.applyOverride("a.scales=[1, 2]"); }).find("expected a mapping of names to numbers"),
            std::string::npos);

  // The docs name the closed set.
  for (const FieldInfo& f : schema.fields()) {
    if (f.path == "a.kind") {
      EXPECT_EQ(f.constraint, "one of: alpha, beta");
    }
  }
}

// An entry inherits a choice and a pair from the top level like any key.
TEST(ConfigTargetsTest, ChoicesAndPairsInherit) {
  enum class Kind { kAlpha, kBeta };
  constexpr std::array<EnumName<Kind>, 2> kKindNames = {{{"alpha", Kind::kAlpha}, {"beta", Kind::kBeta}}};
  Kind top = Kind::kBeta, entry = Kind::kAlpha;
  double t1 = 0.1, t2 = 0.2, e1 = 0, e2 = 0;
  ConfigSchema defaults, child;
  defaults.add("x.kind", choiceOf(&top, kKindNames), "kind");
  defaults.add("x.pair", PairTarget{&t1, &t2}, "pair");
  child.add("m.x.kind", choiceOf(&entry, kKindNames), "kind");
  child.add("m.x.pair", PairTarget{&e1, &e2}, "pair");
  defaults.loadString("x:\n  kind: beta\n", "d.yaml");
  child.inheritUnset(defaults, [](const std::string& key) { return key.substr(2); });
  EXPECT_EQ(entry, Kind::kBeta);
  EXPECT_EQ(e1, 0.1);
  EXPECT_EQ(e2, 0.2);
}

TEST(EditDistanceTest, Basics) {
  EXPECT_EQ(editDistance("", "abc"), 3u);
  EXPECT_EQ(editDistance("lr", "lrr"), 1u);
  EXPECT_EQ(editDistance("kitten", "sitting"), 3u);
}

TEST(ConfigSchemaRegistration, RejectsDuplicatesAndNesting) {
  ConfigSchema s;
  int64_t a = 0, b = 0;
  s.add("x.y", &a, "");
  EXPECT_THROW(s.add("x.y", &b, ""), Error);
  EXPECT_THROW(s.add("x.y.z", &b, ""), Error);
  EXPECT_THROW(s.add("x", &b, ""), Error);
}

// A section whose keys are names the user picks: each entry its own schema, inheriting
// what it does not set from the top level.
class NamedSectionTest : public ::testing::Test {
 protected:
  struct Entry {
    std::string name;
    double lr = 1.0;
    int64_t width = 8;
  };

  void SetUp() override {
    schema.add("optim.lr", &lr, "lr").greaterThan(0.0);
    schema.add("model.width", &width, "width").min(1);
    schema.addNamedSection("models", "models by name", [this](ConfigSchema& entry, const std::string& name) {
      entries.push_back({name});
      Entry& e = entries.back();
      entry.add("models." + name + ".optim.lr", &e.lr, "lr").greaterThan(0.0);
      entry.add("models." + name + ".width", &e.width, "width").min(1);
    });
  }

  // Entry keys inherit the top-level key of the same meaning.
  void inherit() {
    for (const auto& [name, entry] : schema.entries("models")) {
      const std::string prefix = "models." + name + ".";
      entry->inheritUnset(schema, [prefix](const std::string& key) {
        const std::string rest = key.substr(prefix.size());
        return rest.rfind("optim.", 0) == 0 ? rest : "model." + rest;
      });
    }
  }


  double lr = 0.5;
  int64_t width = 4;
  std::deque<Entry> entries;  // stable addresses for the bound keys
  ConfigSchema schema;
};

TEST_F(NamedSectionTest, EntriesLoadOverrideAndInherit) {
  schema.loadString("optim: {lr: 0.25}\nmodels:\n  g: {width: 16}\n  c: {optim: {lr: 2.0}}\n", "m.yaml");
  schema.applyOverride("models.c.width=32");
  // What an entry changed itself, before it inherits the rest.
  EXPECT_EQ(schema.entries("models")[1].second->changedKeys("models.c."),
            (std::vector<std::string>{"models.c.optim.lr", "models.c.width"}));
  EXPECT_TRUE(schema.entries("models")[0].second->changedKeys("models.g.optim.").empty());
  inherit();
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0].name, "g");
  EXPECT_EQ(entries[0].width, 16);
  EXPECT_DOUBLE_EQ(entries[0].lr, 0.25);  // inherited after the top level was read
  EXPECT_EQ(entries[1].width, 32);
  EXPECT_DOUBLE_EQ(entries[1].lr, 2.0);
  // Where an inherited value came from is where the top level set it.
  EXPECT_EQ(schema.entries("models")[0].second->locationOf("models.g.optim.lr").str(), "m.yaml:1:13");
  // The resolved YAML holds the entries and loads back to itself.
  const std::string yaml = schema.toYaml();
  EXPECT_NE(yaml.find("models:\n  g:\n    optim:\n      lr: 0.25\n    width: 16\n"), std::string::npos) << yaml;
  double lr2 = 0;
  int64_t width2 = 0;
  std::deque<Entry> entries2;
  ConfigSchema second;
  second.add("optim.lr", &lr2, "");
  second.add("model.width", &width2, "");
  second.addNamedSection("models", "", [&entries2](ConfigSchema& entry, const std::string& name) {
    entries2.push_back({name});
    entry.add("models." + name + ".optim.lr", &entries2.back().lr, "");
    entry.add("models." + name + ".width", &entries2.back().width, "");
  });
  second.loadString(yaml, "resolved.yaml");
  EXPECT_EQ(second.toYaml(), yaml);
}

TEST_F(NamedSectionTest, ErrorsNameTheEntryAndKey) {
  EXPECT_NE(errorOf([&] { schema.loadString("models:\n  g: {}\n  g: {}\n", "t.yaml"); }).find("t.yaml:3:3: models.g: named twice"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { schema.loadString("models:\n  g: {widht: 3}\n", "u.yaml"); })
                .find("u.yaml:2:7: models.g.widht: unknown key (did you mean 'models.g.width'?)"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { schema.loadString("models:\n  g: {width: 0}\n", "r.yaml"); }).find("models.g.width: value 0"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { schema.loadString("models:\n  2x: {}\n", "n.yaml"); }).find("models.2x: entry names are identifiers"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { schema.loadString("models: [a, b]\n", "l.yaml"); }).find("models: expected a mapping"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { schema.loadString("models:\n  g: 3\n", "s.yaml"); }).find("models.g: expected a mapping of keys"),
            std::string::npos);
  schema.loadString("models:\n  g: {}\n", "ok.yaml");
  EXPECT_NE(errorOf([&] { schema.applyOverride("models.h.width=3"); }).find("no entry 'h' (the config has: g)"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { schema.applyOverride("models=3"); }).find("is a section"), std::string::npos);
  EXPECT_NE(errorOf([&] { schema.applyOverride("models.g.width=x"); }).find("models.g.width: expected an integer"),
            std::string::npos);
}

TEST_F(NamedSectionTest, ABaseFileAndItsChildNameTheSameEntry) {
  const auto dir = std::filesystem::temp_directory_path() / ("tessera_named_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "base.yaml") << "models:\n  g: {width: 16, optim: {lr: 3.0}}\n";
  std::ofstream(dir / "child.yaml") << "base: base.yaml\nmodels:\n  g: {width: 24}\n  c: {}\n";
  schema.loadFile((dir / "child.yaml").string());
  std::filesystem::remove_all(dir);
  ASSERT_EQ(entries.size(), 2u);  // g once, merged
  EXPECT_EQ(entries[0].width, 24);
  EXPECT_DOUBLE_EQ(entries[0].lr, 3.0);
}

// A cross-field refusal names where the key it is about was set and, for each other key its
// text names, where that one was set (a file or a --set); keys left at their default, and
// longer keys that merely start with a named one, are not listed.
TEST_F(ConfigSchemaTest, CrossFieldErrorsNameWhereEveryNamedKeyWasSet) {
  schema.loadString("run:\n  steps: 5\ndata:\n  path: x.bin\n", "a.yaml");
  schema.applyOverride("optim.lr=0.5");
  const std::string message =
      schema.errorMessage("run.steps", "5 steps at optim.lr (0.5), ema.decay, model.dims.x and data.path.");
  EXPECT_EQ(message, "a.yaml:2:10: run.steps: 5 steps at optim.lr (0.5), ema.decay, model.dims.x and data.path. "
                     "(data.path: a.yaml:4:9; optim.lr: --set optim.lr=0.5)");
  // Kept once the schema is gone: the run's own checks use the same record.
  KeyOrigins origins = schema.origins();
  EXPECT_EQ(origins.of("optim.lr").str(), "--set optim.lr=0.5");
  EXPECT_TRUE(origins.of("ema.decay").isDefault());
  EXPECT_TRUE(origins.of("no.such.key").isDefault());
  EXPECT_EQ(origins.errorMessage("ema.decay", "needs run.stepsX"), "<default>: ema.decay: needs run.stepsX");
}

}  // namespace
}  // namespace tessera::config
