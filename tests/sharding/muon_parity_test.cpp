// Muon (optim/muon.h) on every strategy against a single-process reference written from the
// paper's algorithm in plain LibTorch: no_shard, zero1, zero2, zero3 and hybrid at 1-4 ranks
// (ranks as threads), on UnevenMlp (fc1 [7,5]: taller than wide, transposed; fc2 [3,7];
// rows that do not divide by 2, 3 or 4, a rank with no row of fc2), with weight decay,
// Nesterov and plain momentum, and an AdamW group (biases, the head, the 0-d scale) at its
// own learning rate. Parameters and the momentum buffers, gathered, must match to the fp32
// tolerance of the other strategies' parity tests (1e-5 relative). Plus: the orthogonalised
// update is orthogonal, owners balance the work, and the parameter split follows the names.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>

#include "optim/muon.h"
#include "sharding/strategy.h"
#include "tests/sharding/test_models.h"
#include "tests/support/multi_rank.h"

// Named: the sharding tests are one unity build, where anonymous namespaces meet.
namespace tessera::sharding::muon_parity_test {

using test::RankContext;
using test::runOnRanks;
using namespace tessera::sharding::testing;

constexpr int kSteps = 12;
constexpr int64_t kGlobalBatch = 24;
constexpr double kTolerance = 1e-5;
constexpr double kLr = 0.02;
constexpr double kAdamwLr = 0.005;
constexpr double kWeightDecay = 0.1;

optim::OptimizerOptions muonOptions(bool nesterov) {
  optim::OptimizerOptions o;
  o.kind = optim::OptimizerKind::kMuon;
  o.weightDecay = kWeightDecay;
  o.muon.nesterov = nesterov;
  o.muon.adamwLrScale = kAdamwLr / kLr;
  return o;
}

// ---- The reference: Muon as the paper writes it, on whole tensors in one process ----

// Newton-Schulz, quintic, (a, b, c) = (3.4445, -4.7750, 2.0315), on the normalised matrix
// (transposed while taller than wide).
at::Tensor referenceOrthogonalize(const at::Tensor& g, int steps) {
  at::Tensor x = g.size(0) > g.size(1) ? g.t() : g;
  x = x / (x.norm() + 1e-7);
  for (int i = 0; i < steps; ++i) {
    const at::Tensor a = at::matmul(x, x.t());
    const at::Tensor b = -4.7750 * a + 2.0315 * at::matmul(a, a);
    x = 3.4445 * x + at::matmul(b, x);
  }
  return g.size(0) > g.size(1) ? x.t() : x;
}

struct Reference {
  std::map<std::string, at::Tensor> params, momentum;
};

const Batches& data() {
  static const Batches batches = makeBatches(kSteps, kGlobalBatch, 5, 1, 11);
  return batches;
}

const std::map<std::string, at::Tensor>& initialParams() {
  static const std::map<std::string, at::Tensor> init = [] {
    seedCpu(5);
    UnevenMlp model;
    return paramValues(*model);
  }();
  return init;
}

const Reference& reference(bool nesterov) {
  static std::map<bool, Reference> cache;
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = cache.find(nesterov); it != cache.end()) return it->second;
  UnevenMlp model;
  loadParamValues(*model, initialParams());
  const optim::MuonOptions muon = muonOptions(nesterov).muon;
  // AdamW (torch::optim) for everything Muon does not take: no decay below 2 dimensions.
  std::vector<at::Tensor> decay, noDecay, hidden;
  std::vector<std::string> hiddenNames;
  for (const auto& item : model->named_parameters()) {
    const auto shape = item.value().sizes().vec();
    if (optim::takesMuon(muon, item.key(), shape)) {
      hidden.push_back(item.value());
      hiddenNames.push_back(item.key());
    } else {
      (shape.size() >= 2 ? decay : noDecay).push_back(item.value());
    }
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(kAdamwLr).weight_decay(kWeightDecay)));
  groups.emplace_back(noDecay, std::make_unique<torch::optim::AdamWOptions>(
                                   torch::optim::AdamWOptions(kAdamwLr).weight_decay(0.0)));
  torch::optim::AdamW adamw(groups, torch::optim::AdamWOptions(kAdamwLr));
  Reference ref;
  for (const std::string& name : hiddenNames) ref.momentum[name] = at::zeros_like(initialParams().at(name));
  for (int t = 0; t < kSteps; ++t) {
    adamw.zero_grad();
    for (at::Tensor& p : hidden) p.mutable_grad() = at::Tensor();
    torch::mse_loss(model->forward(data().x[t]), data().y[t]).backward();
    adamw.step();
    c10::NoGradGuard noGrad;
    for (size_t i = 0; i < hidden.size(); ++i) {
      at::Tensor& w = hidden[i];
      const at::Tensor g = w.grad();
      at::Tensor& m = ref.momentum[hiddenNames[i]];
      m = muon.momentum * m + g;
      const at::Tensor u = nesterov ? g + muon.momentum * m : m;
      const at::Tensor x = referenceOrthogonalize(u, muon.nsSteps);
      w.mul_(1 - kLr * kWeightDecay);
      w.add_(x, -kLr * 0.2 * std::sqrt(static_cast<double>(std::max(w.size(0), w.size(1)))));
    }
  }
  ref.params = paramValues(*model);
  return cache.emplace(nesterov, std::move(ref)).first->second;
}

// ---- Tessera: the same training on `world` ranks under `strategy` ----

struct RankOutput {
  std::map<std::string, at::Tensor> params, momentum;
  std::map<std::string, bool> muon;
};

std::vector<RankOutput> train(const std::string& strategy, int world, bool nesterov) {
  (void)data();
  (void)initialParams();
  std::vector<RankOutput> outputs(static_cast<size_t>(world));
  runOnRanks(world, [&](RankContext& ctx) {
    UnevenMlp model;
    loadParamValues(*model, initialParams());
    StrategyOptions o;
    o.strategy = parseStrategyKind(strategy);
    o.optimizer = muonOptions(nesterov);
    o.wrap = UnevenMlpImpl::units();
    if (strategy == "hybrid") o.fullyShard.shardSize = world % 2 == 0 ? 2 : 1;
    auto engine = makeStrategy(*model, ctx.comm(), o);
    for (int t = 0; t < kSteps; ++t) {
      engine->zeroGrad();
      torch::mse_loss(model->forward(rankSlice(data().x[t], ctx.rank, world)), rankSlice(data().y[t], ctx.rank, world))
          .backward();
      ASSERT_FALSE(engine->step(kLr).skipped);
    }
    RankOutput& out = outputs[static_cast<size_t>(ctx.rank)];
    for (const dtensor::ShardedParam& p : engine->params()) {
      distributed::Communicator& group = engine->stateComm();
      out.params[p.name] = gatherFull(p.spec, p.master, group);
      out.muon[p.name] = engine->optimizer().takesMuon(p);
      if (out.muon[p.name]) out.momentum[p.name] = gatherFull(p.spec, engine->optimizer().state(p, "momentum_buffer"), group);
      EXPECT_EQ(engine->optimizer().stepCount(p), kSteps) << p.name;
    }
  });
  return outputs;
}

using ParityParam = std::tuple<std::string, int, bool>;  // strategy, world, nesterov

class MuonParityTest : public ::testing::TestWithParam<ParityParam> {};

TEST_P(MuonParityTest, MatchesTheSingleProcessReference) {
  useOneThread();
  const auto& [strategy, world, nesterov] = GetParam();
  const Reference& ref = reference(nesterov);
  const auto outputs = train(strategy, world, nesterov);
  for (int r = 0; r < world; ++r) {
    const RankOutput& out = outputs[static_cast<size_t>(r)];
    ASSERT_EQ(out.params.size(), ref.params.size());
    EXPECT_TRUE(out.muon.at("fc1.weight") && out.muon.at("fc2.weight"));
    EXPECT_FALSE(out.muon.at("head.weight") || out.muon.at("fc1.bias") || out.muon.at("scale"));
    for (const auto& [name, want] : ref.params) {
      EXPECT_LE(relativeError(out.params.at(name), want), kTolerance) << "rank " << r << " " << name;
      // Every rank of a group ends with the same bits (one owner computed each update).
      EXPECT_TRUE(out.params.at(name).equal(outputs[0].params.at(name))) << "rank " << r << " " << name;
    }
    for (const auto& [name, want] : ref.momentum) {
      EXPECT_LE(relativeError(out.momentum.at(name), want), kTolerance) << "rank " << r << " momentum of " << name;
    }
  }
}

std::vector<ParityParam> cases() {
  std::vector<ParityParam> out;
  for (const char* s : {"no_shard", "zero1", "zero2", "zero3", "hybrid"}) {
    for (int world : {1, 2, 3, 4}) out.emplace_back(s, world, true);
  }
  out.emplace_back("zero3", 3, false);
  out.emplace_back("no_shard", 2, false);
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllStrategies, MuonParityTest, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<ParityParam>& info) {
                           return std::get<0>(info.param) + "_world" + std::to_string(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_nesterov" : "_plain");
                         });

// ---- The pieces ----

TEST(MuonTest, TheUpdateIsNearlyOrthogonal) {
  seedCpu(1);
  for (const auto& shape : std::vector<std::vector<int64_t>>{{16, 48}, {48, 16}, {32, 32}}) {
    const at::Tensor x = optim::orthogonalize(at::randn(shape), 5);
    ASSERT_EQ(x.sizes().vec(), shape);
    // Quintic Newton-Schulz leaves the singular values in about [0.7, 1.2], not exactly 1.
    const at::Tensor s = at::linalg_svdvals(x);
    EXPECT_GT(s.min().item<double>(), 0.5) << shape;
    EXPECT_LT(s.max().item<double>(), 1.3) << shape;
  }
}

TEST(MuonTest, OwnersBalanceTheWork) {
  const std::vector<int> owners = optim::ownersBySize({8, 1, 4, 4, 2, 1}, 3);
  std::vector<double> load(3, 0);
  const std::vector<double> costs = {8, 1, 4, 4, 2, 1};
  for (size_t i = 0; i < owners.size(); ++i) load[static_cast<size_t>(owners[i])] += costs[i];
  EXPECT_EQ(owners[0], 0);  // the largest first, to the first rank
  EXPECT_LE(*std::max_element(load.begin(), load.end()) - *std::min_element(load.begin(), load.end()), 8.0);
  EXPECT_EQ(load[0] + load[1] + load[2], 20.0);
  EXPECT_EQ(optim::ownersBySize({3, 3}, 1), (std::vector<int>{0, 0}));
}

TEST(MuonTest, HiddenMatricesAreMuonsTheRestAdamws) {
  optim::MuonOptions o;
  o.exclude = {"blocks.0.*"};
  EXPECT_TRUE(optim::takesMuon(o, "blocks.1.mlp.fc1.weight", {64, 16}));
  EXPECT_TRUE(optim::takesMuon(o, "t_embedder.mlp.0.weight", {64, 16}));  // a hidden layer of an embedder
  EXPECT_FALSE(optim::takesMuon(o, "blocks.0.mlp.fc1.weight", {64, 16}));  // excluded
  EXPECT_FALSE(optim::takesMuon(o, "blocks.1.mlp.fc1.bias", {64}));
  EXPECT_FALSE(optim::takesMuon(o, "x_embedder.proj.weight", {64, 1, 4, 4}));
  for (const char* name : {"embed.weight", "wte.weight", "wpe.weight", "y_embedder.embedding_table.weight",
                           "head.weight", "lm_head.weight", "final_layer.linear.weight"}) {
    EXPECT_FALSE(optim::takesMuon(o, name, {64, 16})) << name;
  }
}

}  // namespace tessera::sharding::muon_parity_test
