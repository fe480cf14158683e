// A model architecture (model.arch) as the rest of Tessera finds it by name: the model.*
// keys it reads, the checks of its options against each other and the data, what an
// export's metadata must agree with in the file, its twin in python/tessera_models.py,
// and how to build it. Each built-in architecture is one file, <arch>_spec.cpp, beside
// its model's code, and one line in architecture.cpp's list; nothing else compares
// model.arch (docs/design.md, "Adding a model architecture"). Free of LibTorch models, so
// that the config reader builds (and is fuzzed) without them.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tessera::datasets {
struct DataSpec;
}

namespace tessera::models {

class TrainModel;
struct ModelOptions;

// One thing wrong with a model's options: its key (without the prefix: "heads") and what.
struct KeyProblem {
  std::string key;
  std::string what;
  bool unread = false;  // a key the architecture does not read, set to other than its default
};

// What an architecture's checks see besides the options: the data's kind (data.kind) and
// how messages name the model's keys ("model." or "models.<name>.").
struct ArchitectureContext {
  std::string dataKind;
  std::string keyPrefix = "model.";
};

// One tensor a run of the architecture will allocate, as its sizes imply (in bytes, a
// double: sizes from outside may make it astronomical), with the keys that size it.
struct PlannedTensor {
  std::string what;   // "the attention scores of a micro-batch"
  double bytes = 0;
  std::string keys;   // "data.image_size, model.patch_size, data.micro_batch"
};

// The sizes an export file's tensors hold: metadata must describe a model they could fill.
struct FileShapes {
  int64_t tensors = 0;     // how many
  int64_t largestDim = 0;  // the largest dimension of any
  int64_t elements = 0;    // all their values (capped at kMaxCounter)
};

struct ArchitectureSpec {
  const char* name;         // model.arch
  const char* description;  // what it is and what it trains on, for the key's doc
  const char* pythonClass;  // its class in python/tessera_models.py (what an export loads into)
  // A denoiser (trained to predict the noise or the velocity, sampled, distilled).
  bool denoiser = false;
  // Trains on the next token of every position of a window (rather than of the window).
  bool predictsEveryPosition = false;
  // The model.* keys it reads besides arch and init_from: a key set to anything but its
  // default that the architecture does not read is a configuration error.
  std::vector<std::string> keys;
  // Problems with `options` for this architecture (their first is reported); null: none.
  std::vector<KeyProblem> (*check)(const ModelOptions& options, const ArchitectureContext& context) = nullptr;
  // Fills in what the data decides (dit: its classes) before the options are recorded in
  // an export's metadata; null: nothing.
  void (*resolve)(ModelOptions& options, const datasets::DataSpec& data) = nullptr;
  // What is wrong with metadata describing `options` for a file of `file`'s tensors ("" when
  // nothing is): checked before a model is built from an export's metadata.
  std::string (*fileProblem)(const ModelOptions& options, const datasets::DataSpec& data, const FileShapes& file) = nullptr;
  // Its largest tensors for `data` and a micro-batch of `microBatch` samples (the run checks
  // them against the memory there is before building anything); null: none worth checking.
  std::vector<PlannedTensor> (*planned)(const ModelOptions& options, const datasets::DataSpec& data,
                                        int64_t microBatch) = nullptr;
  // The model, sized for `data`, its parameters deferred on `device` (ConfigError when it
  // cannot train on the data). Null in builds of the config reader alone (the fuzzers').
  std::shared_ptr<TrainModel> (*make)(const ModelOptions& options, const datasets::DataSpec& data,
                                      c10::Device device) = nullptr;
};

// The factory a spec names: null where only the config reader is built (TESSERA_CONFIG_ONLY).
#ifdef TESSERA_CONFIG_ONLY
#define TESSERA_MODEL_FACTORY(function) nullptr
#else
#define TESSERA_MODEL_FACTORY(function) &function
#endif

// Every architecture, model.arch's choices, in the order docs list them.
const std::vector<const ArchitectureSpec*>& architectures();
// The architecture named `name`: ConfigError listing the names otherwise.
const ArchitectureSpec& architecture(const std::string& name);
// The same, or null for a name that is none.
const ArchitectureSpec* findArchitecture(const std::string& name);
// The names, as a message lists them ("mlp, gpt, diffusion, dit").
std::string architectureNames();

// Every problem with `options` for their architecture: its own checks, and each model.*
// key it does not read set to a value other than the default (`changedKeys`: the keys so
// set, without prefix). ConfigError for an unknown architecture.
std::vector<KeyProblem> architectureProblems(const ModelOptions& options, const ArchitectureContext& context,
                                             const std::vector<std::string>& changedKeys);

// The specs of the built-in architectures (each in its <arch>_spec.cpp).
const ArchitectureSpec& mlpArchitecture();
const ArchitectureSpec& gptArchitecture();
const ArchitectureSpec& diffusionArchitecture();
const ArchitectureSpec& ditArchitecture();
const ArchitectureSpec& convNetArchitecture();

// What every denoiser (diffusion, dit) reads and checks: the noise schedule, the loss,
// the sampler's timesteps (diffusion_spec.cpp).
std::vector<std::string> denoiserKeys();
void checkDenoiserOptions(const ModelOptions& options, const ArchitectureContext& context,
                          std::vector<KeyProblem>& problems);

}  // namespace tessera::models
