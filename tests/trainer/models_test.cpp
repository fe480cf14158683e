// The built-in models: shapes, parameter names (nanoGPT's for the GPT), causality of the
// GPT's attention, the tied head, and option errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>
#include <string>

#include "common/errors.h"
#include "trainer/models.h"

namespace tessera::trainer {
namespace {

ModelOptions gptOptions(bool tied = false) {
  ModelOptions o;
  o.arch = "gpt";
  o.vocab_size = 50;
  o.context = 6;
  o.embed_dim = 12;
  o.layers = 2;
  o.heads = 3;
  o.tie_head = tied;
  return o;
}

std::set<std::string> names(torch::nn::Module& m) {
  std::set<std::string> out;
  for (const auto& item : m.named_parameters()) out.insert(item.key());
  return out;
}

TEST(GptTest, ParameterNamesFollowNanoGpt) {
  torch::manual_seed(0);
  auto model = makeModel(gptOptions());
  const auto got = names(*model);
  for (const char* name : {"wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.ln_1.bias", "h.0.attn.c_attn.weight",
                           "h.0.attn.c_attn.bias", "h.0.attn.c_proj.weight", "h.1.ln_2.bias", "h.1.mlp.c_fc.weight",
                           "h.1.mlp.c_proj.bias", "ln_f.weight", "lm_head.weight"}) {
    EXPECT_TRUE(got.count(name)) << name;
  }
  EXPECT_FALSE(got.count("lm_head.bias"));
  EXPECT_EQ(got.size(), 2u + 2 * 12 + 2 + 1);  // wte, wpe; 12 per block; ln_f; lm_head
  EXPECT_FALSE(names(*makeModel(gptOptions(/*tied=*/true))).count("lm_head.weight"));
  EXPECT_EQ(defaultUnits(gptOptions()), std::vector<std::string>{"h.*"});
}

TEST(GptTest, AttentionIsCausalAndNextTokenIsTheLastPosition) {
  torch::manual_seed(1);
  auto model = std::make_shared<Gpt>(gptOptions());
  const at::Tensor tokens = torch::randint(0, 50, {3, 6}, at::kLong);
  const at::Tensor logits = model->forward(tokens);
  EXPECT_EQ(logits.sizes(), (c10::IntArrayRef{3, 6, 50}));
  // Changing token 4 changes positions 4 and 5 only.
  at::Tensor changed = tokens.clone();
  changed.select(1, 4).fill_(7);
  changed.select(1, 4).masked_fill_(tokens.select(1, 4) == 7, 8);
  const at::Tensor after = model->forward(changed);
  EXPECT_TRUE(after.narrow(1, 0, 4).allclose(logits.narrow(1, 0, 4)));
  EXPECT_FALSE(after.narrow(1, 4, 2).allclose(logits.narrow(1, 4, 2)));
  EXPECT_TRUE(model->nextTokenLogits(tokens).equal(logits.select(1, 5)));
  // A shorter window is a prefix of the longer one's computation.
  EXPECT_TRUE(model->forward(tokens.narrow(1, 0, 3)).allclose(logits.narrow(1, 0, 3), 1e-5, 1e-6));
}

TEST(GptTest, TiedHeadUsesTheTokenEmbedding) {
  torch::manual_seed(2);
  auto model = std::make_shared<Gpt>(gptOptions(/*tied=*/true));
  const at::Tensor tokens = torch::randint(0, 50, {2, 6}, at::kLong);
  const at::Tensor before = model->forward(tokens);
  {
    torch::NoGradGuard noGrad;
    for (auto& item : model->named_parameters()) {
      // Not a constant shift: LayerNorm output sums to ~0, so a constant would cancel.
      if (item.key() == "wte.weight") item.value().select(0, 3).add_(torch::randn({12}));
    }
  }
  EXPECT_FALSE(model->forward(tokens).select(2, 3).allclose(before.select(2, 3)));
}

TEST(GptTest, BadOptionsAreErrors) {
  ModelOptions o = gptOptions();
  o.heads = 5;  // does not divide 12
  EXPECT_THROW(makeModel(o), ConfigError);
  o.arch = "rnn";
  EXPECT_THROW(makeModel(o), ConfigError);
  auto model = std::make_shared<Gpt>(gptOptions());
  EXPECT_THROW(model->forward(torch::zeros({1, 7}, at::kLong)), Error);  // longer than the context
}

TEST(ContextMlpTest, NamesAndShape) {
  ModelOptions o;
  o.hidden = {8};
  auto model = makeModel(o);
  EXPECT_EQ(names(*model), (std::set<std::string>{"embed.weight", "layers.0.weight", "layers.0.bias", "head.weight",
                                                   "head.bias"}));
  EXPECT_EQ(model->nextTokenLogits(torch::zeros({2, o.context}, at::kLong)).sizes(), (c10::IntArrayRef{2, 256}));
}

}  // namespace
}  // namespace tessera::trainer
