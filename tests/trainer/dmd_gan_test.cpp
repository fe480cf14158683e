// DMD2's GAN term (recipes/dmd_recipe.h): the head on the critic's features, and where its
// two losses send gradients. The critic's classification loss trains the critic (the
// head and the blocks up to the one it reads) and nothing of the generator; the
// generator's GAN loss reaches the generator through the critic and leaves every
// gradient of the critic untouched, with the generator's gradient equal to plain
// backpropagation of softplus(-D) through both.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "common/errors.h"
#include "datasets/dataset.h"
#include "models/diffusion.h"
#include "models/models.h"
#include "recipes/dmd_recipe.h"

namespace tessera::recipes {
namespace {

using models::Denoiser;

// A class-conditional DiT (3 classes, 1x8x8 images, 2 blocks 16 wide) with weights drawn
// past adaLN-Zero's zeros, so that every path carries a gradient; a GAN head on block
// `headBlock` (-1: none).
std::shared_ptr<Denoiser> smallDit(uint64_t seed, int64_t headBlock) {
  models::ModelOptions o;
  o.arch = "dit";
  o.embed_dim = 16;
  o.layers = 2;
  o.heads = 2;
  o.patch_size = 4;
  o.timesteps = 50;
  o.gan_head_block = headBlock;
  datasets::DataSpec spec;
  spec.inputShape = {1, 8, 8};
  spec.classes = 3;
  auto model = std::dynamic_pointer_cast<Denoiser>(models::makeModel(o, spec));
  models::initializeModel(*model, seed);
  torch::NoGradGuard noGrad;
  torch::manual_seed(seed);
  for (auto& item : model->named_parameters()) item.value().normal_(0, 0.3);
  return model;
}

// The noise of the GAN term for n samples: timesteps, signal and spread shaped [n, 1, 1, 1].
struct Noise {
  at::Tensor t, signal, spread, eps, eps2;
};
Noise noiseFor(int64_t n) {
  torch::manual_seed(3);
  Noise out;
  out.t = at::tensor(std::vector<int64_t>{5, 20, 40}, at::kLong).narrow(0, 0, n);
  out.signal = torch::rand({n, 1, 1, 1}) * 0.8 + 0.1;
  out.spread = (1 - out.signal.square()).sqrt();
  out.eps = torch::randn({n, 1, 8, 8});
  out.eps2 = torch::randn({n, 1, 8, 8});
  return out;
}

// The generator's one-step samples for n noises, with their graph.
at::Tensor generated(Denoiser& generator, const at::Tensor& labels) {
  const int64_t n = labels.size(0);
  torch::manual_seed(9);
  return models::predictInUnits(generator, torch::randn({n, 1, 8, 8}), at::full({n}, 49, at::kLong), labels);
}

bool hasGradient(const at::Tensor& p) { return p.grad().defined() && p.grad().abs().sum().item<double>() > 0; }

// recipe.min_t/max_t and gan_min_t/gan_max_t as timesteps: floor(min T) to ceil(max T) - 1,
// never past the schedule's last timestep nor below the first one drawn.
TEST(DmdGanTest, TimestepFractionsSpanTheirTimesteps) {
  using Range = std::pair<int64_t, int64_t>;
  EXPECT_EQ(timestepRange(0.02, 0.98, 1000), (Range{20, 979}));
  EXPECT_EQ(timestepRange(0.02, 0.3, 1000), (Range{20, 299}));
  EXPECT_EQ(timestepRange(0.0, 1.0, 1000), (Range{0, 999}));
  EXPECT_EQ(timestepRange(0.5, 0.5001, 50), (Range{25, 25}));  // one timestep
  EXPECT_EQ(timestepRange(0.999, 1.0, 10), (Range{9, 9}));
  // Products that are integers but for their rounding: 0.07 * 100 = 7.000000000000001 and
  // 0.29 * 100 = 28.999999999999996 are the fractions 7/100 and 29/100.
  EXPECT_EQ(timestepRange(0.29, 0.5, 100), (Range{29, 49}));
  EXPECT_EQ(timestepRange(0.0, 0.07, 100), (Range{0, 6}));
}

TEST(DmdGanTest, TheHeadIsPartOfTheCriticOnlyWhenAsked) {
  const auto plain = smallDit(1, -1), withHead = smallDit(1, 0);
  EXPECT_FALSE(plain->hasGanHead());
  ASSERT_TRUE(withHead->hasGanHead());
  std::vector<std::string> head;
  for (const auto& item : withHead->named_parameters()) {
    if (item.key().rfind("gan_head.", 0) == 0) head.push_back(item.key());
  }
  EXPECT_EQ(head, (std::vector<std::string>{"gan_head.0.weight", "gan_head.0.bias", "gan_head.1.weight", "gan_head.1.bias",
                                            "gan_head.3.weight", "gan_head.3.bias"}));
  EXPECT_EQ(withHead->named_parameters().size(), plain->named_parameters().size() + head.size());
  // A prediction does not pass through the head: same weights, same outputs.
  {
    torch::NoGradGuard noGrad;
    for (const auto& item : plain->named_parameters()) withHead->named_parameters()[item.key()].copy_(item.value());
  }
  const Noise n = noiseFor(3);
  const at::Tensor labels = at::tensor(std::vector<int64_t>{0, 1, 2}, at::kLong);
  EXPECT_TRUE(at::equal(plain->predict(n.eps, n.t, labels), withHead->predict(n.eps, n.t, labels)));
  EXPECT_EQ(withHead->discriminate(n.eps, n.t, labels).sizes(), (std::vector<int64_t>{3}));
  EXPECT_THROW(plain->discriminate(n.eps, n.t, labels), Error);
}

TEST(DmdGanTest, TheCriticLossTrainsOnlyTheCriticUpToTheHeadsBlock) {
  const auto generator = smallDit(1, -1), critic = smallDit(2, 0);
  const at::Tensor labels = at::tensor(std::vector<int64_t>{0, 1, 2}, at::kLong);
  const Noise n = noiseFor(3);
  const at::Tensor fake = generated(*generator, labels);  // with the generator's graph
  ASSERT_TRUE(fake.requires_grad());
  torch::manual_seed(4);
  const at::Tensor real = torch::randn({3, 1, 8, 8}).clamp(-1, 1);
  const at::Tensor losses = ganCriticLosses(*critic, real, labels.flip(0), fake, labels, n.t, n.signal, n.spread,
                                            n.eps, n.eps2);
  ASSERT_EQ(losses.sizes(), (std::vector<int64_t>{3}));
  losses.mean().backward();
  for (const auto& item : generator->named_parameters()) EXPECT_FALSE(item.value().grad().defined()) << item.key();
  for (const auto& item : critic->named_parameters()) {
    const std::string& name = item.key();
    // The head reads block 0: block 1 and the final layer are not on the loss's path.
    const bool onPath = name.rfind("blocks.1.", 0) != 0 && name.rfind("final_layer.", 0) != 0;
    if (name == "y_embedder.embedding_table.weight") {
      EXPECT_TRUE(hasGradient(item.value())) << name;  // the classes asked for (rows 0-2), not "no class"
    } else if (onPath) {
      EXPECT_TRUE(hasGradient(item.value())) << name;
    } else {
      EXPECT_FALSE(hasGradient(item.value())) << name;
    }
  }
  // The loss itself: softplus(-D(real)) + softplus(D(fake)) at the same timesteps.
  torch::NoGradGuard noGrad;
  const at::Tensor dReal = critic->discriminate(n.signal * real + n.spread * n.eps, n.t, labels.flip(0));
  const at::Tensor dFake = critic->discriminate(n.signal * fake + n.spread * n.eps2, n.t, labels);
  EXPECT_TRUE(at::allclose(losses, at::softplus(-dReal) + at::softplus(dFake), 1e-5, 1e-6));
}

TEST(DmdGanTest, TheGeneratorLossReachesOnlyTheGeneratorWithPlainBackpropagationsGradient) {
  const auto generator = smallDit(1, -1), critic = smallDit(2, 1);
  const at::Tensor labels = at::tensor(std::vector<int64_t>{2, 0, 1}, at::kLong);
  const Noise n = noiseFor(3);

  // Plain backpropagation through critic and generator: the generator's gradient it gives.
  const at::Tensor x = generated(*generator, labels);
  const at::Tensor plainLoss = at::softplus(-critic->discriminate(n.signal * x + n.spread * n.eps, n.t, labels));
  plainLoss.mean().backward();
  std::vector<at::Tensor> expected;
  for (const auto& item : generator->named_parameters()) {
    ASSERT_TRUE(hasGradient(item.value())) << item.key();
    expected.push_back(item.value().grad().clone());
    item.value().mutable_grad().reset();
  }
  for (const auto& item : critic->named_parameters()) item.value().mutable_grad().reset();

  at::Tensor ganLoss;
  const at::Tensor y = generated(*generator, labels);
  const at::Tensor surrogate = ganGeneratorSurrogate(*critic, y, labels, n.t, n.signal, n.spread, n.eps, ganLoss);
  EXPECT_EQ(surrogate.abs().max().item<double>(), 0.0);  // no value of its own: the logged loss stays DMD's
  EXPECT_TRUE(at::allclose(ganLoss, plainLoss.detach(), 1e-6, 1e-7));
  surrogate.mean().backward();
  for (const auto& item : critic->named_parameters()) EXPECT_FALSE(item.value().grad().defined()) << item.key();
  size_t i = 0;
  for (const auto& item : generator->named_parameters()) {
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    EXPECT_TRUE(at::allclose(item.value().grad(), expected[i], 1e-5, 1e-7)) << item.key();
    ++i;
  }
}

}  // namespace
}  // namespace tessera::recipes
