// compareWithSaved: the settings a resume lists as changed against its checkpoint's (in the
// warning, and as the likely cause when the checkpoint's state does not fit: that refusal
// comes from planning the load, tests/checkpoint and tests/apps/train_e2e_test.cpp).
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

using KeyList = std::vector<std::string>;

TEST(ResumeCheckTest, EveryChangedSettingIsListedWithBothValues) {
  const ResumeCheck check = compareWithSaved("model: {hidden: [32]}\noptim: {lr: 0.001}\n",
                                             "model: {hidden: [64]}\noptim: {lr: 0.002}\n");
  EXPECT_EQ(keysOf(check.changed), (KeyList{"model.hidden", "optim.lr"}));
  EXPECT_EQ(check.changed[0].saved, "[32]");
  EXPECT_EQ(check.changed[0].now, "[64]");
  EXPECT_TRUE(check.uncomparable.empty());
}

TEST(ResumeCheckTest, KeysThatSteerOnlyThisInvocationAreLeftOut) {
  const ResumeCheck check = compareWithSaved("run: {dir: a, stop_after_steps: 3}\nlog: {every_steps: 5}\n",
                                             "run: {dir: b}\ncheckpoint: {resume: none}\n");
  EXPECT_TRUE(check.changed.empty()) << describeChanges(check.changed);
}

// Which changes the saved state can follow is not this list's business (the load's plan
// decides): an optimizer change is listed like any other.
TEST(ResumeCheckTest, OptimizerChangesAreListed) {
  EXPECT_EQ(keysOf(compareWithSaved("optim: {name: adam}\n", "optim: {name: adamw}\n").changed), KeyList{"optim.name"});
  EXPECT_EQ(keysOf(compareWithSaved("optim: {name: sgd, momentum: 0}\n", "optim: {name: sgd, momentum: 0.9}\n").changed),
            KeyList{"optim.momentum"});
}

// A frozen model has no optimizer or EMA state: its optim. and ema. keys are not
// compared; its shape still is.
TEST(ResumeCheckTest, AFrozenModelsOptimizerAndEmaKeysAreNotCompared) {
  const std::string saved =
      "models:\n  student: {}\n  teacher: {trainable: false, optim: {name: adamw}, hidden: [32]}\n";
  const std::string now =
      "models:\n  student: {}\n  teacher: {trainable: false, optim: {name: sgd}, hidden: [64]}\n";
  const ResumeCheck check = compareWithSaved(saved, now);
  EXPECT_EQ(keysOf(check.changed), KeyList{"models.teacher.hidden"});
}

TEST(ResumeCheckTest, AModelOnlyOneSideHasIsOneChange) {
  const ResumeCheck check =
      compareWithSaved("models:\n  a: {}\n  b: {}\n", "models:\n  a: {}\n");
  EXPECT_EQ(keysOf(check.changed), KeyList{"models.b"});
  EXPECT_EQ(check.changed[0].now, "(absent)");
}

TEST(ResumeCheckTest, UnreadableSavedSettingsAreSaidSoNotCompared) {
  const ResumeCheck check = compareWithSaved("optim: {nmae: adam}\n", "optim: {name: adam}\n");
  EXPECT_NE(check.uncomparable.find("nmae"), std::string::npos) << check.uncomparable;
}

}  // namespace
}  // namespace tessera::trainer
