// Sharded initialisation of the built-in models: built deferred, materialised by a
// strategy on 1-4 ranks under all five strategies, the global parameters are bitwise the
// single-process initialisation (initializeModel) — no rank held the whole model under
// zero3 — and the declared distributions are the documented ones.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <string>

#include "checkpoint/exporter.h"
#include "checkpoint/safetensors.h"
#include "common/filesystem.h"
#include "distributed/communicator.h"
#include "sharding/fully_shard.h"
#include "dtensor/param_init.h"
#include "sharding/strategy.h"
#include "tests/support/multi_rank.h"
#include "models/layers.h"
#include "models/models.h"

namespace tessera::trainer {
namespace {

constexpr uint64_t kSeed = 1234;

models::ModelOptions gptOptions() {
  models::ModelOptions o;
  o.arch = "gpt";
  o.vocab_size = 29;
  o.context = 5;
  o.embed_dim = 12;
  o.layers = 2;
  o.heads = 3;
  return o;
}

models::ModelOptions mlpOptions() {
  models::ModelOptions o;
  o.context = 3;
  o.embed_dim = 5;
  o.hidden = {7, 3};  // rows that divide by none of 2, 3, 4
  return o;
}

std::map<std::string, at::Tensor> singleProcessInit(const models::ModelOptions& options) {
  auto model = models::makeModel(options);
  models::initializeModel(*model, kSeed);
  std::map<std::string, at::Tensor> out;
  for (const auto& item : model->named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

struct Case {
  std::string strategy;
  int world;
  int shardSize;  // hybrid
};

// `model` sharded by `strategy` (its own units; hybrid over groups of shardSize),
// its deferred parameters initialised from kSeed.
std::unique_ptr<sharding::ShardingStrategy> shardModel(torch::nn::Module& model, const models::ModelOptions& options,
                                                       const std::string& strategy, int shardSize,
                                                       test::RankContext& ctx) {
  sharding::StrategyOptions o;
  o.strategy = sharding::parseStrategyKind(strategy);
  o.fullyShard.shardSize = shardSize;
  o.initializer = models::layers::initializerOf(model, kSeed);
  return sharding::makeStrategy(model, ctx.comm(), o);
}

TEST(ShardedInitTest, EqualsSingleProcessInitAtEveryWorldSizeAndStrategy) {
  std::vector<Case> cases;
  for (const char* s : {"no_shard", "zero1", "zero2", "zero3"}) {
    for (int world = 1; world <= 4; ++world) cases.push_back({s, world, 0});
  }
  cases.push_back({"hybrid", 2, 1});
  cases.push_back({"hybrid", 4, 2});
  for (const models::ModelOptions& options : {gptOptions(), mlpOptions()}) {
    const auto want = singleProcessInit(options);
    for (const Case& c : cases) {
      test::runOnRanks(c.world, [&](test::RankContext& ctx) {
        at::set_num_threads(1);
        auto model = models::makeModel(options);
        for (const auto& p : model->parameters()) ASSERT_TRUE(dtensor::hasNoStorage(p)) << "built deferred";
        auto strategy = shardModel(*model, options, c.strategy, c.shardSize, ctx);
        const bool sharded = c.strategy == "zero3" || c.strategy == "hybrid";
        // One rank in the shard group (fp32): the parameter is a view of its master.
        const bool oneShard = (c.shardSize == 0 ? c.world : c.shardSize) == 1;
        for (const dtensor::ShardedParam& p : strategy->params()) {
          if (sharded && oneShard) {
            EXPECT_EQ(p.moduleParam.data_ptr(), p.master.data_ptr()) << p.name << ": the parameter is its master";
          } else if (sharded) {
            EXPECT_EQ(p.moduleParam.storage().nbytes(), 0u) << p.name << ": zero3 holds no full parameter";
          }
          const at::Tensor full = p.spec.fullTensor(p.master, strategy->stateComm());
          EXPECT_TRUE(full.equal(want.at(p.name))) << c.strategy << " world " << c.world << " " << p.name;
          if (!sharded) {
            EXPECT_TRUE(p.moduleParam.detach().equal(want.at(p.name))) << p.name;
          }
        }
      });
    }
  }
}

// model.init_from's path (trainer/run_setup.cpp): weights exported as one file and as a
// sharded export (index.json) load into a strategy's records at 1-4 ranks under all five
// strategies, each rank reading its rows; the gathered model is the file's, bitwise.
TEST(ShardedInitTest, InitFromAnExportAtEveryWorldSizeAndStrategy) {
  const models::ModelOptions options = gptOptions();
  std::map<std::string, at::Tensor> weights = singleProcessInit(options);
  for (auto& [name, w] : weights) w = w * 0.5 + 0.25;  // not the init: loading must show
  const auto dir = std::filesystem::temp_directory_path() / ("tessera_init_from_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string file = (dir / "model.safetensors").string();
  checkpoint::saveSafetensors(file, weights);
  std::vector<checkpoint::StateEntry> full;
  for (const auto& [name, w] : weights) full.push_back({"model/" + name, dtensor::ShardSpec(w.sizes().vec(), at::kFloat, 1, 0), w});
  checkpoint::ExportOptions ex;
  ex.what = "model";
  ex.maxShardBytes = 4096;
  const std::string index = checkpoint::exportOnline(full, {}, nullptr, (dir / "sharded").string(), ex).indexFile;
  ASSERT_FALSE(index.empty());
  std::vector<Case> cases;
  for (const char* s : {"no_shard", "zero1", "zero2", "zero3"}) {
    for (int world = 1; world <= 4; ++world) cases.push_back({s, world, 0});
  }
  cases.push_back({"hybrid", 4, 2});
  for (const std::string& from : {file, index}) {
    for (const Case& c : cases) {
      test::runOnRanks(c.world, [&](test::RankContext& ctx) {
        at::set_num_threads(1);
        auto model = models::makeModel(options);
        auto strategy = shardModel(*model, options, c.strategy, c.shardSize, ctx);
        checkpoint::ImportOptions io;
        io.stripPrefix = "model/";
        checkpoint::importSafetensors(from, strategy->stateEntries("model/"), io);
        strategy->publishParameters();
        for (const dtensor::ShardedParam& p : strategy->params()) {
          EXPECT_TRUE(p.spec.fullTensor(p.master, strategy->stateComm()).equal(weights.at(p.name)))
              << c.strategy << " world " << c.world << " " << p.name << " from " << from;
        }
      });
    }
  }
  removeTree(dir.string());
}

// A NaN in rows that only rank 1 reads: both ranks throw (rank 1 naming the file and the
// tensor, rank 0 naming rank 1) rather than rank 0 training on while rank 1 has left.
TEST(ShardedInitTest, InitFromFailsOnEveryRankWhenOneRankReadsABadRow) {
  const models::ModelOptions options = gptOptions();
  std::map<std::string, at::Tensor> weights = singleProcessInit(options);
  std::string poisoned;
  for (auto& [name, w] : weights) {
    if (w.dim() == 2 && w.size(0) >= 4) {
      w[w.size(0) - 1][0] = std::nan("");  // the last row: rank 1's of 2
      poisoned = name;
      break;
    }
  }
  ASSERT_FALSE(poisoned.empty());
  const auto dir = std::filesystem::temp_directory_path() / ("tessera_init_nan_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string file = (dir / "model.safetensors").string();
  checkpoint::saveSafetensors(file, weights);
  const test::MultiRankResult result = test::runRanks(2, [&](test::RankContext& ctx) {
    auto model = models::makeModel(options);
    auto strategy = shardModel(*model, options, "zero3", 0, ctx);
    checkpoint::ImportOptions io;
    io.stripPrefix = "model/";
    io.comm = ctx.comm().get();
    checkpoint::importSafetensors(file, strategy->stateEntries("model/"), io);
  });
  ASSERT_EQ(result.ranks.size(), 2u);
  for (const test::RankOutcome& r : result.ranks) {
    EXPECT_FALSE(r.ok) << "rank " << r.rank;
    EXPECT_FALSE(r.timedOut) << "rank " << r.rank;
  }
  EXPECT_NE(result.ranks[1].message.find(file + ": tensor '" + poisoned + "' holds NaN or Inf"), std::string::npos)
      << result.ranks[1].message;
  EXPECT_NE(result.ranks[0].message.find("importSafetensors: " + file + " failed on rank 1"), std::string::npos)
      << result.ranks[0].message;
  removeTree(dir.string());
}

// The distributions models.h documents, measured on tensors large enough for the moments.
TEST(ShardedInitTest, DeclaredDistributionsAreTheDocumentedOnes) {
  models::ModelOptions gpt = gptOptions();
  gpt.embed_dim = 96;
  gpt.heads = 4;
  gpt.layers = 8;
  const auto g = singleProcessInit(gpt);
  auto near = [](double got, double want, double rel) { return std::abs(got - want) <= rel * want; };
  EXPECT_TRUE(near(g.at("h.0.attn.c_attn.weight").std().item<double>(), 0.02, 0.03));
  EXPECT_TRUE(near(g.at("h.3.mlp.c_proj.weight").std().item<double>(), 0.02 / std::sqrt(16.0), 0.03))
      << g.at("h.3.mlp.c_proj.weight").std().item<double>();
  EXPECT_TRUE(near(g.at("wte.weight").std().item<double>(), 0.02, 0.05));
  EXPECT_TRUE(g.at("h.1.attn.c_attn.bias").eq(0).all().item<bool>());
  EXPECT_TRUE(g.at("ln_f.weight").eq(1).all().item<bool>());
  EXPECT_TRUE(g.at("ln_f.bias").eq(0).all().item<bool>());
  EXPECT_FALSE(g.at("h.0.mlp.c_fc.weight").equal(g.at("h.1.mlp.c_fc.weight"))) << "each tensor its own stream";

  models::ModelOptions mlp;
  mlp.context = 8;
  mlp.embed_dim = 32;
  mlp.hidden = {300};
  const auto m = singleProcessInit(mlp);
  const double bound = 1.0 / std::sqrt(256.0);  // fan_in of layers.0: context x embed_dim
  const at::Tensor w = m.at("layers.0.weight");
  EXPECT_LE(w.abs().max().item<double>(), bound);
  EXPECT_TRUE(near(w.std().item<double>(), bound / std::sqrt(3.0), 0.02));  // uniform(-b, b)
  EXPECT_LT(std::abs(w.mean().item<double>()), 0.01 * bound);
  EXPECT_TRUE(near(m.at("embed.weight").std().item<double>(), 1.0, 0.05));
  // Another seed, other values; the same seed, the same values.
  auto other = models::makeModel(mlp);
  models::initializeModel(*other, kSeed + 1);
  EXPECT_FALSE(other->named_parameters()["layers.0.weight"].equal(w));
  EXPECT_TRUE(singleProcessInit(mlp).at("layers.0.weight").equal(w));
}

// A deferred model needs an initializer; a model another live zero3 strategy holds is
// refused, not initialised again.
TEST(ShardedInitTest, DeferredWithoutInitializerAndHeldParametersAreErrors) {
  test::runOnRanks(1, [](test::RankContext& ctx) {
    auto model = models::makeModel(mlpOptions());
    sharding::StrategyOptions o;
    o.strategy = sharding::StrategyKind::kZero3;
    EXPECT_THROW(sharding::makeStrategy(*model, ctx.comm(), o), ConfigError);
    o.initializer = models::layers::initializerOf(*model, kSeed);
    auto strategy = sharding::makeStrategy(*model, ctx.comm(), o);
    o.strategy = sharding::StrategyKind::kNoShard;
    try {
      sharding::makeStrategy(*model, ctx.comm(), o);
      ADD_FAILURE() << "a second strategy over the same parameters";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("already sharded"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace tessera::trainer
