// What a resumed run changes against the run that saved its checkpoint: the settings
// whose values differ (a new learning rate is legitimate: resuming warns with the list),
// and those the saved state cannot be used with (another model shape, optimizer, EMA set,
// global batch or seed: resuming refuses them, naming the keys).
#pragma once

#include <string>
#include <vector>

namespace tessera::trainer {

struct SettingChange {
  std::string key;    // "optim.lr", "models.critic.embed_dim"
  std::string saved;  // the value as YAML ("0.003"), "(absent)" when the key was not there
  std::string now;
};

struct ResumeCheck {
  std::vector<SettingChange> changed;  // differ, and resuming is fine with it
  std::vector<SettingChange> refused;  // differ, and the checkpoint's state cannot serve them
  std::string uncomparable;            // why the saved settings could not be read ("" when compared)
};

// Compares the resolved YAML a checkpoint was saved with (trainer_state.json) with the one
// of this run. Keys that only steer this invocation (run.dir, run.stop_after_steps,
// checkpoint.resume, log.*) are left out.
ResumeCheck compareWithSaved(const std::string& savedYaml, const std::string& currentYaml);

// "a -> b, c -> d" for messages.
std::string describeChanges(const std::vector<SettingChange>& changes);

}  // namespace tessera::trainer
