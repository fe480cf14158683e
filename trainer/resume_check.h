// What a resumed run changes against the run that saved its checkpoint: the settings
// whose values differ. A resume warns with the list (a new learning rate is legitimate);
// whether the saved state fits this run is not decided here but by planning the load
// against the checkpoint's metadata (checkpoint::planLoad), and when it does not fit, the
// refusal names these keys as the likely cause.
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
  std::vector<SettingChange> changed;  // differ between the saved settings and this run's
  std::string uncomparable;            // why the saved settings could not be read ("" when compared)
};

// Compares the resolved YAML a checkpoint was saved with (trainer_state.json) with the one
// of this run. Left out: keys that only steer this invocation (run.dir,
// run.stop_after_steps, checkpoint.resume, checkpoint.local.dir, log.*); the optim. and ema.
// keys of a model frozen on both sides (it has no such state); and in a models: run the
// top-level model., optim., sharding. and ema. keys (each entry's own are compared). A
// models: entry only one side has is one change.
ResumeCheck compareWithSaved(const std::string& savedYaml, const std::string& currentYaml);

// "a -> b, c -> d" for messages.
std::string describeChanges(const std::vector<SettingChange>& changes);

}  // namespace tessera::trainer
