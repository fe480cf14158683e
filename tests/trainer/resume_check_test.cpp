// compareWithSaved: which setting changes a resume accepts (with a warning) and which it
// refuses because the checkpoint's state cannot serve them.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "trainer/resume_check.h"

namespace tessera::trainer {
namespace {

std::vector<std::string> keysOf(const std::vector<SettingChange>& changes) {
  std::vector<std::string> keys;
  for (const SettingChange& c : changes) keys.push_back(c.key);
  return keys;
}

using Keys = std::vector<std::string>;

TEST(ResumeCheckTest, ALearningRateChangeIsAcceptedAShapeChangeRefused) {
  const ResumeCheck check = compareWithSaved("model: {hidden: [32]}\noptim: {lr: 0.001}\n",
                                             "model: {hidden: [64]}\noptim: {lr: 0.002}\n");
  EXPECT_EQ(keysOf(check.changed), Keys{"optim.lr"});
  EXPECT_EQ(keysOf(check.refused), Keys{"model.hidden"});
  EXPECT_EQ(check.refused[0].saved, "[32]");
  EXPECT_TRUE(check.uncomparable.empty());
}

TEST(ResumeCheckTest, KeysThatSteerOnlyThisInvocationAreLeftOut) {
  const ResumeCheck check = compareWithSaved("run: {dir: a, stop_after_steps: 3}\nlog: {every_steps: 5}\n",
                                             "run: {dir: b}\ncheckpoint: {resume: none}\n");
  EXPECT_TRUE(check.changed.empty()) << describeChanges(check.changed);
  EXPECT_TRUE(check.refused.empty()) << describeChanges(check.refused);
}

// adam and adamw keep the same moments (exp_avg, exp_avg_sq, step): a change. sgd's
// state is another, and so is sgd with momentum against sgd without.
TEST(ResumeCheckTest, OptimizerChangesAreRefusedOnlyWhereTheStateDiffers) {
  EXPECT_EQ(keysOf(compareWithSaved("optim: {name: adam}\n", "optim: {name: adamw}\n").changed), Keys{"optim.name"});
  EXPECT_EQ(keysOf(compareWithSaved("optim: {name: adamw}\n", "optim: {name: sgd}\n").refused), Keys{"optim.name"});
  EXPECT_EQ(keysOf(compareWithSaved("optim: {name: sgd, momentum: 0}\n", "optim: {name: sgd, momentum: 0.9}\n").refused),
            Keys{"optim.momentum"});
  EXPECT_EQ(keysOf(compareWithSaved("optim: {name: sgd, momentum: 0.8}\n", "optim: {name: sgd, momentum: 0.9}\n").changed),
            Keys{"optim.momentum"});
}

// A frozen model has no optimizer or EMA state: its optim. and ema. keys are not
// compared; its shape still is.
TEST(ResumeCheckTest, AFrozenModelsOptimizerAndEmaKeysAreNotCompared) {
  const std::string saved =
      "models:\n  student: {}\n  teacher: {trainable: false, optim: {name: adamw}, hidden: [32]}\n";
  const std::string now =
      "models:\n  student: {}\n  teacher: {trainable: false, optim: {name: sgd}, hidden: [64]}\n";
  const ResumeCheck check = compareWithSaved(saved, now);
  EXPECT_TRUE(check.changed.empty()) << describeChanges(check.changed);
  EXPECT_EQ(keysOf(check.refused), Keys{"models.teacher.hidden"});
}

TEST(ResumeCheckTest, AModelOnlyOneSideHasIsOneRefusal) {
  const ResumeCheck check =
      compareWithSaved("models:\n  a: {}\n  b: {}\n", "models:\n  a: {}\n");
  EXPECT_EQ(keysOf(check.refused), Keys{"models.b"});
}

TEST(ResumeCheckTest, UnreadableSavedSettingsAreSaidSoNotCompared) {
  const ResumeCheck check = compareWithSaved("optim: {nmae: adam}\n", "optim: {name: adam}\n");
  EXPECT_NE(check.uncomparable.find("nmae"), std::string::npos) << check.uncomparable;
}

}  // namespace
}  // namespace tessera::trainer
