// The library API as a user builds on it (docs/api.md): a model whose blocks are declared
// sharding::Unit (its forward untouched) sharded by fullyShard(), trained by a
// torch::optim optimizer over two parameter groups, equals the same model trained in one
// process; and a checkpoint of the Stateful components — the strategy, the optimizer
// (torch's or the fused one), the EMA and the user's counters — resumes on other world
// sizes where the uninterrupted run is.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "checkpoint/checkpointer.h"
#include "checkpoint/reader.h"
#include "checkpoint/state.h"
#include "common/errors.h"
#include "ema/ema_manager.h"
#include "ema/strategy_ema.h"
#include "sharding/fully_shard.h"
#include "sharding/torch_optimizer.h"
#include "tests/sharding/test_models.h"
#include "tests/support/multi_rank.h"
#include "tests/support/scratch_path.h"

namespace tessera {
namespace {

using sharding::testing::gatherFull;
using sharding::testing::makeBatches;
using sharding::testing::rankSlice;
using sharding::testing::relativeError;
using sharding::testing::seedCpu;

// A user's model: an input projection, three residual blocks (9 wide: 4 ranks hold 3, 3,
// 3 and 0 rows of a weight) and a head. The blocks are units by declaration.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t width)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        fc(register_module("fc", torch::nn::Linear(width, width))) {}
  at::Tensor forward(const at::Tensor& x) { return x + torch::tanh(fc(norm(x))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl() : input(register_module("input", torch::nn::Linear(5, 9))), head(register_module("head", torch::nn::Linear(9, 3))) {
    blocks = register_module("blocks", sharding::UnitList<Block>());
    for (int i = 0; i < 3; ++i) blocks->emplace_back(9);
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = input(x);
    for (auto& block : *blocks) h = block->forward(h);
    return head(h);
  }
  torch::nn::Linear input;
  sharding::UnitList<Block> blocks{nullptr};
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

// The model with the initial weights of seed 0, on any thread: ranks run as threads of
// one process and share its CPU generator, so its draws are taken one model at a time.
sharding::Unit<Net> makeNet() {
  static std::mutex generator;
  std::lock_guard<std::mutex> lock(generator);
  seedCpu(0);
  return sharding::Unit<Net>();
}

constexpr int kSteps = 5;
constexpr int64_t kBatch = 12;  // divides by 1-4 ranks

const sharding::testing::Batches& data() {
  static const sharding::testing::Batches batches = makeBatches(kSteps, kBatch, 5, 3, 21);
  return batches;
}

// Weights (2-D) decay at one learning rate, the rest (biases, norms) do not, at another.
std::unique_ptr<torch::optim::AdamW> twoGroupAdamW(const std::vector<at::Tensor>& weights,
                                                   const std::vector<at::Tensor>& others) {
  using namespace torch::optim;
  std::vector<OptimizerParamGroup> groups;
  groups.emplace_back(weights, std::make_unique<AdamWOptions>(AdamWOptions(1e-2).weight_decay(0.1)));
  groups.emplace_back(others, std::make_unique<AdamWOptions>(AdamWOptions(3e-2).weight_decay(0.0)));
  return std::make_unique<AdamW>(std::move(groups), AdamWOptions(1e-2));
}

std::unique_ptr<torch::optim::AdamW> twoGroupAdamW(sharding::ShardingStrategy& strategy) {
  std::vector<at::Tensor> weights, others;
  for (const auto& shard : strategy.shardedParameters()) {
    (strategy.param(shard.name).spec.globalShape().size() >= 2 ? weights : others).push_back(shard.tensor);
  }
  return twoGroupAdamW(weights, others);
}

// Steps [first, last) of one rank's training: its slice of each global batch.
void trainSteps(sharding::Unit<Net>& net, sharding::ShardingStrategy& strategy, torch::optim::Optimizer* optimizer,
           ema::ShardedModelEMAManager* ema, int first, int last, int rank, int world) {
  for (int t = first; t < last; ++t) {
    strategy.zeroGrad();
    const at::Tensor x = rankSlice(data().x[t], rank, world), y = rankSlice(data().y[t], rank, world);
    torch::mse_loss(net->forward(x), y).backward();
    if (optimizer != nullptr) {
      strategy.step(*optimizer);
    } else {
      strategy.step(1e-2);
    }
    if (ema != nullptr) ema->update(t + 1);
  }
}

// The model trained by torch AdamW in one process, without Tessera.
std::map<std::string, at::Tensor> referenceWeights() {
  seedCpu(0);
  Net net;
  std::vector<at::Tensor> weights, others;
  for (const auto& p : net->parameters()) (p.dim() >= 2 ? weights : others).push_back(p);
  auto adamw = twoGroupAdamW(weights, others);
  for (int t = 0; t < kSteps; ++t) {
    adamw->zero_grad();
    torch::mse_loss(net->forward(data().x[t]), data().y[t]).backward();
    adamw->step();
  }
  return sharding::testing::paramValues(*net);
}

void expectWeights(sharding::ShardingStrategy& strategy, const std::map<std::string, at::Tensor>& want,
                   const std::string& what) {
  for (const auto& [name, value] : want) {
    const dtensor::ShardedParam& p = strategy.param(name);
    EXPECT_LT(relativeError(gatherFull(p.spec, p.master, strategy.stateComm()), value), 1e-5) << what << ": " << name;
  }
}

TEST(LibraryApiTest, TorchAdamWOverTwoGroupsUnderFullyShardEqualsOneProcess) {
  const auto want = referenceWeights();
  for (int world = 1; world <= 4; ++world) {
    test::runOnRanks(world, [&](test::RankContext& ctx) {
      sharding::testing::useOneThread();
      sharding::Unit<Net> net = makeNet();
      auto fsdp = sharding::fullyShard(*net, ctx.comm());
      ASSERT_EQ(fsdp->unitCount(), 4u);  // three blocks and the root
      auto adamw = twoGroupAdamW(*fsdp);
      trainSteps(net, *fsdp, adamw.get(), nullptr, 0, kSteps, ctx.rank, ctx.world);
      expectWeights(*fsdp, want, "zero3 at " + std::to_string(world) + " ranks");
    });
  }
}

TEST(LibraryApiTest, TorchAdamWOverTwoGroupsUnderEveryStrategyEqualsOneProcess) {
  const auto want = referenceWeights();
  for (const char* strategy : {"no_shard", "zero1", "zero2", "hybrid"}) {
    test::runOnRanks(4, [&](test::RankContext& ctx) {
      sharding::testing::useOneThread();
      sharding::Unit<Net> net = makeNet();
      sharding::StrategyOptions options;
      options.strategy = sharding::parseStrategyKind(strategy);
      options.fullyShard.shardSize = 2;  // hybrid: two groups of two
      auto engine = sharding::makeStrategy(*net, ctx.comm(), options);
      auto adamw = twoGroupAdamW(*engine);
      trainSteps(net, *engine, adamw.get(), nullptr, 0, kSteps, ctx.rank, ctx.world);
      expectWeights(*engine, want, strategy);
    });
  }
}

// A block as a diffusion transformer has them: two tensor inputs (the tokens and a
// conditioning vector), a non-tensor argument, two tensor outputs.
struct CondBlockImpl : torch::nn::Module {
  explicit CondBlockImpl(int64_t width)
      : fc(register_module("fc", torch::nn::Linear(width, width))),
        mod(register_module("mod", torch::nn::Linear(width, width))) {}
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& cond, double gate) {
    const at::Tensor shift = mod(cond);
    return {x + gate * torch::tanh(fc(x) + shift), cond + 0.5 * shift};
  }
  torch::nn::Linear fc, mod;
};
TORCH_MODULE(CondBlock);

struct CondNetImpl : torch::nn::Module {
  CondNetImpl() : input(register_module("input", torch::nn::Linear(5, 7))), head(register_module("head", torch::nn::Linear(7, 3))) {
    blocks = register_module("blocks", sharding::UnitList<CondBlock>());
    for (int i = 0; i < 3; ++i) blocks->emplace_back(7);
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = input(x), cond = torch::sin(x.narrow(1, 0, 1)).expand({x.size(0), 7});
    for (auto& block : *blocks) std::tie(h, cond) = block->forward(h, cond, 0.7);
    return head(h + cond);
  }
  torch::nn::Linear input;
  sharding::UnitList<CondBlock> blocks{nullptr};
  torch::nn::Linear head;
};
TORCH_MODULE(CondNet);

// Units with two tensor inputs, a double and a tuple result, gathered, freed and
// recomputed in backward (activation checkpointing) under zero3 at 2 and 3 ranks, train
// as the plain module does with torch AdamW in one process: gradients reach both inputs
// through the recompute.
TEST(LibraryApiTest, UnitWithTwoTensorInputsAndTupleOutputUnderCheckpointingEqualsOneProcess) {
  auto makeCondNet = [] {
    static std::mutex generator;
    std::lock_guard<std::mutex> lock(generator);
    seedCpu(0);
    return sharding::Unit<CondNet>();
  };
  std::map<std::string, at::Tensor> want;
  {
    sharding::Unit<CondNet> net = makeCondNet();  // no strategy: a plain module
    torch::optim::AdamW adamw(net->parameters(), torch::optim::AdamWOptions(1e-2));
    for (int t = 0; t < kSteps; ++t) {
      adamw.zero_grad();
      torch::mse_loss(net->forward(data().x[t]), data().y[t]).backward();
      adamw.step();
    }
    want = sharding::testing::paramValues(*net);
  }
  for (int world : {2, 3}) {
    test::runOnRanks(world, [&](test::RankContext& ctx) {
      sharding::testing::useOneThread();
      sharding::Unit<CondNet> net = makeCondNet();
      sharding::StrategyOptions options;
      options.fullyShard.activationCheckpointing = true;
      auto fsdp = sharding::fullyShard(*net, ctx.comm(), options);
      ASSERT_EQ(fsdp->unitCount(), 4u);  // the root and three blocks
      std::vector<at::Tensor> shards;
      for (const auto& shard : fsdp->shardedParameters()) shards.push_back(shard.tensor);
      torch::optim::AdamW adamw(shards, torch::optim::AdamWOptions(1e-2));
      for (int t = 0; t < kSteps; ++t) {
        fsdp->zeroGrad();
        const at::Tensor x = rankSlice(data().x[t], ctx.rank, world), y = rankSlice(data().y[t], ctx.rank, world);
        torch::mse_loss(net->forward(x), y).backward();
        fsdp->step(adamw);
      }
      expectWeights(*fsdp, want, "world " + std::to_string(world));
    });
  }
}

// One run's components, built alike on every rank and in every run.
struct Parts {
  sharding::Unit<Net> net{nullptr};
  std::unique_ptr<sharding::FullyShardStrategy> fsdp;
  std::unique_ptr<torch::optim::AdamW> adamw;  // null: the fused optimizer
  std::unique_ptr<sharding::TorchOptimizerState> adamwState;
  std::unique_ptr<ema::ShardedModelEMAManager> ema;
  checkpoint::Counters counters;

  Parts(const std::shared_ptr<distributed::Communicator>& comm, bool torchOptimizer) {
    net = makeNet();
    fsdp = sharding::fullyShard(*net, comm);
    if (torchOptimizer) {
      adamw = twoGroupAdamW(*fsdp);
      adamwState = std::make_unique<sharding::TorchOptimizerState>(*adamw, *fsdp);
    }
    ema::EmaOptions o;
    o.decays = {0.9};
    ema = std::make_unique<ema::ShardedModelEMAManager>(o);
    ema::followStrategy(*ema, *fsdp);
    counters["step"] = 0;
  }
  checkpoint::StateMap states() {
    dtensor::Stateful& optimizer = adamw ? static_cast<dtensor::Stateful&>(*adamwState) : fsdp->optimizer();
    return {{"model", *fsdp}, {"optim", optimizer}, {"ema", *ema}, {"train", counters}};
  }
  void train(int first, int last, int rank, int world) {
    trainSteps(net, *fsdp, adamw.get(), ema.get(), first, last, rank, world);
    counters["step"] = last;
  }
};

// Weights and EMA of an uninterrupted run on one rank.
struct Finals {
  std::map<std::string, at::Tensor> weights, ema;
};

Finals uninterrupted(bool torchOptimizer) {
  Finals out;
  test::runOnRanks(1, [&](test::RankContext& ctx) {
    Parts parts(ctx.comm(), torchOptimizer);
    parts.train(0, kSteps, 0, 1);
    for (const auto& p : parts.fsdp->params()) out.weights[p.name] = gatherFull(p.spec, p.master, *ctx.comm());
    for (const auto& name : parts.ema->paramNames()) {
      out.ema[name] = gatherFull(parts.ema->spec(name), parts.ema->emaShard(0, name), *ctx.comm());
    }
  });
  return out;
}

// Saved at step 2 by `saveWorld` ranks with `saveTorch`'s optimizer, resumed by
// `loadWorld` ranks with `loadTorch`'s, finished: equal to the uninterrupted run.
void expectResumeEqualsUninterrupted(int saveWorld, int loadWorld, bool saveTorch, bool loadTorch, double tolerance) {
  const Finals want = uninterrupted(loadTorch);
  const std::string dir = test::scratchPath("tessera_library_api", "checkpoints");
  test::runOnRanks(saveWorld, [&](test::RankContext& ctx) {
    sharding::testing::useOneThread();
    Parts parts(ctx.comm(), saveTorch);
    parts.train(0, 2, ctx.rank, ctx.world);
    checkpoint::Checkpointer checkpointer(dir, ctx.comm());
    checkpointer.save(2, parts.states());
    checkpointer.finish();
  });
  test::runOnRanks(loadWorld, [&](test::RankContext& ctx) {
    sharding::testing::useOneThread();
    Parts parts(ctx.comm(), loadTorch);
    const auto loaded = checkpoint::load(dir + "/step_00000002", parts.states(), ctx.comm().get());
    EXPECT_EQ(parts.counters.at("step"), 2);
    EXPECT_EQ(parts.ema->updateCount(), 2);
    EXPECT_TRUE(loaded.missingOptional.empty());
    parts.train(2, kSteps, ctx.rank, ctx.world);
    const std::string what = "saved on " + std::to_string(saveWorld) + ", resumed on " + std::to_string(loadWorld);
    for (const auto& p : parts.fsdp->params()) {
      EXPECT_LT(relativeError(gatherFull(p.spec, p.master, *ctx.comm()), want.weights.at(p.name)), tolerance)
          << what << ": " << p.name;
    }
    for (const auto& name : parts.ema->paramNames()) {
      const at::Tensor got = gatherFull(parts.ema->spec(name), parts.ema->emaShard(0, name), *ctx.comm());
      EXPECT_LT(relativeError(got, want.ema.at(name)), tolerance) << what << ": EMA of " << name;
    }
  });
}

TEST(LibraryApiTest, StatefulCheckpointOfTorchOptimizerResumesOnOtherWorldSizes) {
  expectResumeEqualsUninterrupted(2, 3, true, true, 1e-6);
  expectResumeEqualsUninterrupted(4, 1, true, true, 1e-6);
}

TEST(LibraryApiTest, StatefulCheckpointOfFusedOptimizerResumesOnOtherWorldSizes) {
  expectResumeEqualsUninterrupted(3, 2, false, false, 1e-6);
}

// The fused AdamW and torch's keep the same state under the same names: a checkpoint of
// one loads into the other and back unchanged — fused -> torch -> fused gives the fused
// optimizer's moments and step counts bit for bit — and training goes on from it.
TEST(LibraryApiTest, FusedAndTorchOptimizerCheckpointsAreInterchangeable) {
  const std::string dir = test::scratchPath("tessera_library_api", "fused");
  test::runOnRanks(2, [&](test::RankContext& ctx) {
    Parts parts(ctx.comm(), false);
    parts.train(0, 2, ctx.rank, ctx.world);
    checkpoint::Checkpointer checkpointer(dir, ctx.comm());
    checkpointer.save(2, parts.states());
    checkpointer.finish();
  });
  test::runOnRanks(2, [&](test::RankContext& ctx) {
    Parts viaTorch(ctx.comm(), true);
    checkpoint::load(dir + "/step_00000002", viaTorch.states(), ctx.comm().get());
    for (auto& group : viaTorch.adamw->param_groups()) {
      for (const auto& p : group.params()) {
        auto& s = static_cast<torch::optim::AdamWParamState&>(
            *viaTorch.adamw->state().at(sharding::testing::optimizerStateKey<std::decay_t<decltype(
                                            viaTorch.adamw->state())>::key_type>(p)));
        EXPECT_EQ(s.step(), 2);
      }
    }
    checkpoint::Checkpointer checkpointer(dir + "/via_torch", ctx.comm());
    checkpointer.save(2, viaTorch.states());
    checkpointer.finish();

    Parts direct(ctx.comm(), false), roundTrip(ctx.comm(), false);
    checkpoint::load(dir + "/step_00000002", direct.states(), ctx.comm().get());
    checkpoint::load(dir + "/via_torch/step_00000002", roundTrip.states(), ctx.comm().get());
    const std::vector<dtensor::StateEntry> want = direct.fsdp->optimizer().stateEntries();
    const std::vector<dtensor::StateEntry> got = roundTrip.fsdp->optimizer().stateEntries();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(got[i].name, want[i].name);
      EXPECT_TRUE(torch::equal(got[i].local, want[i].local)) << "rank " << ctx.rank << ": " << want[i].name;
      if (want[i].name.find("exp_avg_sq") != std::string::npos && want[i].local.numel() > 0) {
        EXPECT_GT(want[i].local.abs().sum().item<double>(), 0.0) << want[i].name;  // a real moment, not zeros
      }
    }
    viaTorch.train(2, kSteps, ctx.rank, ctx.world);  // and torch's steps on from the fused state
  });
}

// An optimizer built over the module's own parameters (as FSDP2 users do, where the
// parameters are the shards) would find no gradient under fullyShard: refused, naming
// the fix, on every rank before any collective.
TEST(LibraryApiTest, OptimizerOverModuleParametersIsRefused) {
  test::runOnRanks(2, [&](test::RankContext& ctx) {
    Parts parts(ctx.comm(), false);
    torch::optim::AdamW wrong(parts.net->parameters(), torch::optim::AdamWOptions(1e-2));
    const at::Tensor x = rankSlice(data().x[0], ctx.rank, ctx.world), y = rankSlice(data().y[0], ctx.rank, ctx.world);
    torch::mse_loss(parts.net->forward(x), y).backward();
    try {
      parts.fsdp->step(wrong);
      ADD_FAILURE() << "step accepted an optimizer over model->parameters()";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("shardedParameters()"), std::string::npos) << e.what();
    }
  });
}

// A root that is not a Unit would compute from freed storage (nothing gathers its own
// parameters): fullyShard refuses it, saying how to declare it.
TEST(LibraryApiTest, FullyShardRefusesARootThatIsNotAUnit) {
  test::runOnRanks(1, [&](test::RankContext& ctx) {
    Net plain;
    try {
      sharding::fullyShard(*plain, ctx.comm());
      ADD_FAILURE() << "fullyShard accepted a plain root";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("sharding::Unit<YourModel>"), std::string::npos) << e.what();
    }
  });
}

// Two components whose entries end up with the same name would overwrite each other in
// the checkpoint: refused, naming the entry and both keys.
TEST(LibraryApiTest, TwoComponentsGivingTheSameEntryAreRefused) {
  checkpoint::Counters a, b;
  a["step"] = 1;
  b["step"] = 2;
  try {
    checkpoint::collectEntries({{"train", a}, {"train", b}});
    FAIL() << "duplicate entry accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("train/step"), std::string::npos) << e.what();
  }
  EXPECT_EQ(checkpoint::collectEntries({{"train", a}, {"other", b}}).size(), 2u);
}

// A load that fails on one rank (here: rank 1 is given a directory that is not there)
// throws on every rank, naming the failing one, instead of leaving the others in
// afterLoad's gathers.
TEST(LibraryApiTest, LoadFailingOnOneRankThrowsOnEveryRank) {
  const std::string dir = test::scratchPath("tessera_library_api", "one_rank_fails");
  test::runOnRanks(2, [&](test::RankContext& ctx) {
    Parts parts(ctx.comm(), false);
    parts.train(0, 1, ctx.rank, ctx.world);
    checkpoint::Checkpointer checkpointer(dir, ctx.comm());
    checkpointer.save(1, parts.states());
    checkpointer.finish();
  });
  test::runOnRanks(2, [&](test::RankContext& ctx) {
    Parts parts(ctx.comm(), false);
    const std::string where = ctx.rank == 1 ? dir + "/step_00000099" : dir + "/step_00000001";
    try {
      checkpoint::load(where, parts.states(), ctx.comm().get());
      ADD_FAILURE() << "rank " << ctx.rank << " loaded";
    } catch (const Error& e) {
      if (ctx.rank == 0) {
        EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
      }
    }
  });
}

}  // namespace
}  // namespace tessera
