// Builds the parts of a training run and resumes it (see run_setup.h).
#include "trainer/run_setup.h"

#include <torch/cuda.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sys/stat.h>
#include <unistd.h>
#include <limits>

#include "checkpoint/format.h"
#include "checkpoint/reader.h"
#include "checkpoint/safetensors.h"
#include "common/counter_rng.h"
#include "common/errors.h"
#include "common/file_open.h"
#include "common/limits.h"
#include "common/logging.h"
#include "datasets/dataset.h"
#include "diagnostics/flight_recorder.h"
#include "distributed/communicator.h"
#include "kernels/cpu_matmul.h"
#include "ema/strategy_ema.h"
#include "sharding/mixed_precision.h"
#include "models/architecture.h"
#include "models/diffusion.h"
#include "models/layers.h"
#include "trainer/metrics.h"
#include "trainer/model_metadata.h"
#include "trainer/recipe_spec.h"
#include "trainer/replica_groups.h"
#include "trainer/resume_check.h"
#include "trainer/run_dir.h"

namespace tessera::trainer {
namespace fs = std::filesystem;

checkpoint::StateMap ModelPart::states() {
  checkpoint::StateMap states{{cfg.names.weights, *strategy}};
  if (cfg.trainable) states.emplace_back(cfg.names.optimizer, strategy->optimizer(), cfg.names.weights);
  if (ema) states.emplace_back(dtensor::kEmaKey, *ema, cfg.names.weights);
  return states;
}

std::pair<int64_t, int64_t> RunParts::samplePositions() const {
  const int64_t micro = cfg.data.micro_batch;
  if (plan) return {plan->begin(comm->rank()) * micro, plan->end(comm->rank()) * micro};
  return sampler->positionsOf(comm->rank(), comm->worldSize());
}

ModelPart& RunParts::model(const std::string& name) {
  for (ModelPart& m : models) {
    if (m.cfg.name == name) return m;
  }
  throw Error(strCat("RunParts: no model named '", name, "'"));
}

checkpoint::StateMap RunParts::states() {
  checkpoint::StateMap states;
  for (ModelPart& m : models) {
    for (const checkpoint::StateItem& item : m.states()) states.push_back(item);
  }
  return states;
}

std::string RunParts::strategies() const {
  auto name = [](const ModelPart& m) { return sharding::strategyKindName(m.cfg.sharding.strategy); };
  if (cfg.singleModelForm) return name(models.front());
  std::string out;
  for (const ModelPart& m : models) out += strCat(out.empty() ? "" : " ", m.cfg.name, ":", name(m));
  return out;
}

namespace {

// run.device: the CPU, or this rank's CUDA device (its local rank, as the launcher gave it:
// torchrun's LOCAL_RANK, srun's SLURM_LOCALID, mpirun's, modulo the devices visible, so
// ranks of a node spread over its GPUs and share them when there are fewer; the nccl
// communicator picks the same one).
at::Device trainingDevice(const TrainConfig& cfg) {
  if (cfg.run.device == "cpu") return at::kCPU;
  if (!torch::cuda::is_available()) {
    throw ConfigError(cfg.origins.errorMessage(
        "run.device", "cuda, but no CUDA device is usable here (a CPU-only LibTorch, or no GPU visible); "
                      "build with scripts/gpu-build.sh on a GPU machine, or set run.device: cpu"));
  }
  const int64_t index = distributed::RankEnv::fromEnvironment().local_rank % torch::cuda::device_count();
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
}

}  // namespace

void startFlightRecorder(const TrainConfig& cfg, const distributed::RankEnv& env) {
  if (cfg.diagnostics.runtime.flightEntries == 0) return;
  diagnostics::flight::setDumpFiles(diagnostics::flight::dumpFilesFor(cfg.run.dir, env.rank), env.rank, env.world_size);
  diagnostics::flight::installSignalHandlers();
}

distributed::RuntimeOptions runtimeOptions(const TrainConfig& cfg, const distributed::RankEnv& env) {
  distributed::RuntimeOptions options = cfg.diagnostics.runtime;
  // fault.survive: a rank stopped for fault.lost_after_s is lost, not waited for.
  if (cfg.fault.survive) options.lostWhenStoppedFor = cfg.fault.lost_after;
  const bool cuda = cfg.run.device == "cuda";
  const int64_t gpus = cuda && torch::cuda::is_available() ? static_cast<int64_t>(torch::cuda::device_count()) : 0;
  const bool gpuPerRank = gpus >= env.local_world_size;
  if (cfg.run.backend == "nccl") {
    auto refuse = [&](const std::string& why) { throw ConfigError(cfg.origins.errorMessage("run.backend", why)); };
    if (!cuda) refuse(strCat("nccl moves CUDA tensors; run.device is ", cfg.run.device));
    if (!distributed::ncclAvailable()) refuse("nccl, but this build has no nccl backend (build with scripts/gpu-build.sh)");
    if (!gpuPerRank) {
      refuse(strCat("nccl needs a GPU per rank: ", env.local_world_size, " ranks on this node, ", gpus,
                    " GPUs visible (NCCL refuses two ranks on one GPU; use gloo)"));
    }
    options.backend = "nccl";
  } else if (cfg.run.backend == "shm") {
    auto refuse = [&](const std::string& why) { throw ConfigError(cfg.origins.errorMessage("run.backend", why)); };
    if (cuda) refuse("shm moves CPU tensors; run.device is cuda (use auto, nccl or gloo)");
    if (!env.singleNode()) {
      refuse(strCat("shm needs every rank on one host: ", env.local_world_size, " of ", env.world_size,
                    " ranks run on this one (use gloo or auto)"));
    }
    options.backend = "shm";
  } else if (cfg.run.backend == "auto") {
    // On the CPU: shm on one host (gloo if it cannot be set up), gloo across hosts.
    options.backend = cuda ? (distributed::ncclAvailable() && gpuPerRank ? "nccl" : "gloo") : "cpu";
  } else {
    options.backend = "gloo";
  }
  return options;
}

namespace {

// sharding.param_dtype against what this LibTorch computes on the run's device: LibTorch
// 1.13 has no fp16 matrix product on the CPU, so an fp16 CPU run would fail at its first
// forward with LibTorch's backtrace. Probed, not assumed: newer LibTorch builds have it.
void checkComputeDtypes(const TrainConfig& cfg, at::Device device) {
  for (const ModelEntry& m : cfg.models) {
    const at::ScalarType dtype = m.sharding.paramDtype;
    if (dtype == at::kFloat) continue;
    try {
      const at::Tensor a = at::ones({2, 2}, at::TensorOptions().dtype(dtype).device(device));
      (void)at::mm(a, a);
    } catch (const c10::Error&) {
      throw ConfigError(cfg.origins.errorMessage(
          m.sectionKeys + "sharding.param_dtype",
          strCat(enumName(sharding::kFloatDtypeNames, dtype), " compute is not available on ", device,
                 " with this LibTorch (no matrix product in that dtype); use ",
                 device.is_cpu() ? "bf16, or run.device: cuda" : "another dtype")));
    }
  }
}

// run.matmul_dtype: the dtype fp32 Linear products multiply in on the CPU, for this process
// (finishTrainConfig refused it for other devices). A CPU model whose parameters are bf16
// computes in bf16 (its products are LibTorch's bf16 ones; the built-in models' norms and GELU
// widen to fp32 inside, kernels/): faster than fp32 on a core with bf16 instructions, and not
// measured so elsewhere, where the log says so.
void setCpuMatmulDtype(const TrainConfig& cfg, at::Device device) {
  kernels::setCpuLinearDtype(cfg.run.matmul_dtype == "bf16" ? at::kBFloat16 : at::kFloat);
  if (!device.is_cpu() || kernels::coreHasBf16Instructions()) return;
  for (const ModelEntry& m : cfg.models) {
    if (m.sharding.paramDtype == at::kBFloat16) {
      TLOG_WARN0(m.sectionKeys << "sharding.param_dtype bf16 on the CPU: this core has no bf16 instructions "
                                  "(AVX512-BF16 or AMX), so its bf16 products are emulated or LibTorch's own loops, "
                                  "slower than fp32 below AVX-512 (docs/benchmarks.md); sharding.param_dtype: fp32 "
                                  "may well be faster here");
      return;
    }
  }
}

// The seed a model's initial values are drawn with: run.seed, mixed with the model's salt
// when it has one (ModelEntry::seedSalt).
uint64_t initSeed(const TrainConfig& cfg, const ModelEntry& m) {
  const auto seed = static_cast<uint64_t>(cfg.run.seed);
  if (m.seedSalt.empty()) return seed;
  return mix64(seed ^ checkpoint::checksum(m.seedSalt.data(), m.seedSalt.size()));
}

// The config's strategy options, with the initial values of the model's deferred
// parameters: each rank initialises only what it holds, with values that depend on the
// seed and the parameter names alone. An empty sharding.wrap leaves the units to the
// model's own sharding::Unit members.
sharding::StrategyOptions strategyOptions(const TrainConfig& cfg, const ModelEntry& m, const models::TrainModel& model) {
  sharding::StrategyOptions o = m.sharding;
  o.initializer = models::layers::initializerOf(model, initSeed(cfg, m));
  // fault.survive: no_shard's EMA, zero1/zero2's masters and optimizer state sharded inside
  // each replica group (a node), not over every rank, so that the groups that go on hold all
  // of it.
  if (cfg.fault.survive && o.strategy != sharding::StrategyKind::kZero3 && o.strategy != sharding::StrategyKind::kHybrid) {
    o.stateGroupSize = std::max(1, distributed::RankEnv::fromEnvironment().local_world_size);
  }
  return o;
}

std::unique_ptr<ema::ShardedModelEMAManager> makeEma(const ModelEntry& m, const sharding::ShardingStrategy& strategy) {
  if (!m.hasEma()) return nullptr;
  auto manager = std::make_unique<ema::ShardedModelEMAManager>(m.ema.options);
  ema::followStrategy(*manager, strategy);
  return manager;
}

// One model: built deferred (nothing allocated), then its strategy materialises this
// rank's part; a frozen model's parameters stop requiring gradients first, so the
// strategy shards them without an optimizer slot. An allocation that fails
// (model.vocab_size 2^31) is reported with the keys that size the model, without
// LibTorch's C++ backtrace.
ModelPart buildModel(RunParts& run, const ModelEntry& entry) {
  const models::ModelOptions& m = entry.model;
  ModelPart part;
  part.cfg = entry;
  const std::string modelKeys = strCat(entry.modelKeys.empty() ? "model" : entry.modelKeys.substr(0, entry.modelKeys.size() - 1),
                                       " (arch ", m.arch, ", vocab_size ", m.vocab_size, ", context ", m.context,
                                       ", embed_dim ", m.embed_dim, ", layers ", m.layers, ")");
  try {
    part.model = models::makeModel(m, run.data->spec(), run.device);
    if (!entry.trainable) {
      for (auto& p : part.model->parameters()) p.set_requires_grad(false);
    }
    part.strategy = sharding::makeStrategy(*part.model, run.comm, strategyOptions(run.cfg, entry, *part.model));
  } catch (const c10::Error& e) {
    throw ConfigError(strCat(modelKeys, ": this rank's part cannot be built: ", e.what_without_backtrace()));
  } catch (const std::bad_alloc&) {
    throw ConfigError(strCat(modelKeys, ": this rank's part does not fit in memory"));
  }
  if (run.plan) part.strategy->setDeterministic(*run.plan);
  if (entry.trainable) part.schedule = std::make_unique<optim::LrSchedule>(entry.schedule);
  part.ema = makeEma(entry, *part.strategy);
  int64_t numParams = 0;
  for (const auto& p : part.model->parameters()) numParams += p.numel();
  TLOG_INFO0("run " << run.cfg.run.name << ": " << entry.displayName << " "
                    << m.arch << ": " << numParams << " parameters" << (entry.trainable ? "" : " (frozen)")
                    << "; strategy " << sharding::strategyKindName(entry.sharding.strategy) << " over "
                    << run.comm->worldSize() << " ranks ("
                    << (run.comm->worldSize() > 1 ? run.comm->backendName() : std::string("one process"))
                    << "); resident " << part.strategy->residentBytes().str() << "; peak RSS so far "
                    << peakRssMiB() << " MiB");
  return part;
}

// checkpoint.local.dir, or /dev/shm/tessera-<uid>/<hash of run.dir's absolute path> (the
// system's temporary directory where there is no /dev/shm): one directory per run, the
// same path on every node.
std::string localTierDir(const TrainConfig& cfg) {
  if (!cfg.checkpoint.local.tier.dir.empty()) return cfg.checkpoint.local.tier.dir;
  std::error_code ec;
  const std::string runDir = fs::weakly_canonical(fs::absolute(cfg.run.dir), ec).string();
  const fs::path shm = fs::is_directory("/dev/shm", ec) ? fs::path("/dev/shm") : fs::temp_directory_path(ec);
  return (shm / strCat("tessera-", ::getuid()) / checkpoint::checksumHex(checkpoint::checksum(runDir.data(), runDir.size())))
      .string();
}

// The node-local tier's options: checkpoint.local's, its directory resolved, and the run
// as the owner of the steps it writes (run.dir as it resolves: one run per run.dir).
checkpoint::LocalTierOptions localTierOptions(const TrainConfig& cfg) {
  checkpoint::LocalTierOptions tier = cfg.checkpoint.local.tier;
  tier.dir = localTierDir(cfg);
  std::error_code ec;
  tier.owner = fs::weakly_canonical(fs::absolute(cfg.run.dir), ec).string();
  return tier;
}

// The tier's directory is one of its own: never a link, never in a checkpoints directory
// (checkpoint::checkLocalTierDirectory), nor where this run keeps its checkpoints and
// post-hoc snapshots; the default's parent is this user's own and private, or another
// user could read the shards or plant a step to be promoted. ConfigError on every rank.
void checkLocalTierDir(const TrainConfig& cfg, const checkpoint::LocalTierOptions& tier,
                       distributed::Communicator& comm) {
  distributed::runOnEveryRank(&comm, "checkpoint.local.dir", [&] {
    if (cfg.checkpoint.local.tier.dir.empty()) {
      const std::string parent = fs::path(tier.dir).parent_path().string();
      ::mkdir(parent.c_str(), 0700);
      struct stat st {};
      const bool ours = ::lstat(parent.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == ::getuid() &&
                        (st.st_mode & 077) == 0;
      if (!ours) {
        throw ConfigError(strCat("checkpoint.local.dir: the default's parent ", parent,
                                 " is not a private directory of this user (a link, another owner, or group/other "
                                 "access): remove it, or set checkpoint.local.dir"));
      }
    }
    checkpoint::checkLocalTierDirectory(tier.dir, "checkpoint.local.dir");
    std::error_code ec;
    const fs::path dir = fs::weakly_canonical(fs::absolute(tier.dir), ec);
    for (const char* kept : {"checkpoints", "posthoc"}) {
      const fs::path runs = fs::weakly_canonical(fs::absolute(cfg.run.dir) / kept, ec);
      const auto mismatch = std::mismatch(runs.begin(), runs.end(), dir.begin(), dir.end());
      if (mismatch.first == runs.end()) {
        throw ConfigError(cfg.origins.errorMessage(
            "checkpoint.local.dir", strCat(quote(tier.dir), " is in ", runs.string(), ", where this run keeps its ",
                                           kept, ": give the local tier a directory of its own")));
      }
    }
  });
}

// checkpoint.local: a step the node-local tier holds for this run that is newer than the
// persistent tier's newest (a run that lost a node, or crashed, between persistent saves)
// becomes a persistent checkpoint now, before run.dir is claimed, so that it is the
// checkpoint this start resumes. Only for resume auto into a run.dir that holds that run (a
// run.dir made anew must not resume the steps of a deleted one). Nothing is deleted here:
// the tier is emptied of the run's steps once the run has been accepted (setUpRun).
void promoteFromLocalTier(const TrainConfig& cfg, const checkpoint::LocalTierOptions& tier,
                          distributed::Communicator& comm) {
  const fs::path runDir = cfg.run.dir;
  const distributed::TimeoutScope timeout(cfg.diagnostics.checkpoint_timeout);  // copies wait for the disk
  bool earlier = false;
  if (comm.rank() == 0) {
    std::error_code ec;
    earlier = !findEarlierRun(runDir).empty() || fs::exists(runDir / "config.resolved.yaml", ec);
  }
  const bool sameRun = distributed::lowestFailingRank(&comm, earlier) == 0;  // rank 0's answer, on every rank
  if (cfg.checkpoint.resume != "auto" || !sameRun) return;
  try {
    if (const auto promoted = checkpoint::promoteLocalStep(tier.dir, tier.owner, (runDir / "checkpoints").string(), &comm)) {
      TLOG_INFO0("checkpoint.local: step " << promoted->step << " of the node-local tier (held on "
                                           << promoted->nodesHolding << " of the nodes now running) copied to "
                                           << promoted->dir << " (" << promoted->bytes << " bytes in "
                                           << promoted->seconds << " s): the run resumes from it");
    }
  } catch (const Error& e) {
    // Its steps stay where they are for the next start to try again.
    TLOG_WARN0(e.what() << "; resuming from the persistent tier, the local one left as it was");
  }
}

// Checkpoints are written over the group the state is sharded over, by the ranks holding
// a full set of it (hybrid: the first replica group; the others skip). Every model of a
// models: run is sharded over all ranks (hybrid is refused there), so the first model's
// group is every model's.
void setUpCheckpointer(RunParts& run) {
  const ModelPart& first = run.models.front();
  if (!first.strategy->firstReplica()) return;
  checkpoint::CheckpointOptions options = run.cfg.checkpoint.writer;
  options.commitTimeout = run.cfg.diagnostics.checkpoint_timeout;
  run.checkpointer.emplace((run.runDir / "checkpoints").string(), first.strategy->stateCommPtr()->host(), options);
  const LocalTierSection& local = run.cfg.checkpoint.local;
  if (local.every_steps > 0) {
    const checkpoint::LocalTierOptions tier = localTierOptions(run.cfg);
    run.localCheckpointer.emplace(tier, first.strategy->stateCommPtr()->host());
    TLOG_INFO0("checkpoint.local: every " << local.every_steps << " steps to " << tier.dir << " on each of "
                                          << run.localCheckpointer->layout().nodes.size() << " nodes, "
                                          << run.localCheckpointer->replicas() << " replica(s) on other nodes");
  }
  if (first.ema && !first.cfg.ema.options.powerStds.empty()) {
    // Post-hoc EMA snapshots (single-model form): every one kept (keep_last 0), written
    // synchronously (an async writer would keep a second staging copy of the profiles).
    checkpoint::CheckpointOptions posthoc;
    posthoc.commitTimeout = options.commitTimeout;
    run.posthocWriter.emplace((run.runDir / "posthoc").string(), first.strategy->stateCommPtr()->host(), posthoc);
  }
}

// How the data this run's models are sized for differs from the data the models of
// checkpoint `dir` were trained on (its trainer_state.json's model metadata: their
// classes and sample shape), "" when it does not or cannot be told: a resume onto data with
// more classes is said so, not as a tensor's shape.
std::string dataAgainst(const RunParts& run, const std::string& dir) {
  std::map<std::string, std::string> saved;
  try {
    saved = modelMetadataFromJson(checkpoint::CheckpointReader(dir).trainerState(), dir + "/trainer_state.json");
  } catch (const std::exception&) {
    return "";
  }
  for (const auto& [prefix, mine] : run.counters.modelMetadata) {
    const auto it = saved.find(prefix);
    if (it == saved.end()) continue;
    try {
      const ModelDescription before = parseModelMetadata(it->second, dir);
      const ModelDescription now = parseModelMetadata(mine, "this run");
      if (before.data.classes != now.data.classes) {
        return strCat("the data has ", now.data.classes, " classes (data.path), the checkpoint's ", prefix,
                      " was trained on ", before.data.classes);
      }
      if (before.data.inputShape != now.data.inputShape) {
        return strCat("the data's samples are ", at::IntArrayRef(now.data.inputShape), " (data.path, data.image_size), "
                      "the checkpoint's ", prefix, " was trained on ", at::IntArrayRef(before.data.inputShape));
      }
    } catch (const std::exception&) {
    }
  }
  return "";
}

// The settings of this run that differ from those checkpoint `dir` was saved with (its
// trainer_state.json's resolved config); uncomparable says why when they cannot be read.
ResumeCheck settingsAgainst(const RunParts& run, const std::string& dir) {
  std::string savedYaml;
  try {
    checkpoint::CheckpointReader reader(dir);
    savedYaml = countersFromJson(reader.trainerState(), dir + "/trainer_state.json").resolvedConfig;
  } catch (const std::exception& e) {
    ResumeCheck unread;
    unread.uncomparable = e.what();
    return unread;
  }
  return compareWithSaved(savedYaml, run.resolvedYaml);
}

// A checkpoint whose state does not fit this run (checkpoint::planLoad: other tensors,
// shapes or dtypes) refused as a configuration error, before any weights were read: the
// tensors that differ, and the settings that differ from the checkpoint's, which are
// what the user changed to get there (model.patch_size, data.image_size, ema.decays, ...).
[[noreturn]] void refuseLayout(const RunParts& run, const checkpoint::LoadPlanError& e) {
  const ResumeCheck check = settingsAgainst(run, e.dir());
  const std::string data = dataAgainst(run, e.dir());
  std::string cause;
  if (!check.uncomparable.empty()) {
    cause = strCat("its settings could not be read (", check.uncomparable, ")");
  } else if (!data.empty()) {
    cause = strCat(data, check.changed.empty() ? std::string()
                                              : strCat("; settings differ too: ", describeChanges(check.changed)));
  } else if (check.changed.empty()) {
    cause = "no setting differs from the checkpoint's (was it written by another version of the model's code?)";
  } else {
    cause = strCat("settings differ from the checkpoint's: ", describeChanges(check.changed));
  }
  const std::string tensors =
      e.mismatches().empty() ? std::string(e.what()) : checkpoint::describeMismatches(e.mismatches(), 3);
  throw ConfigError(strCat("resume from ", e.dir(), ": ", cause, "; the checkpoint's state does not fit this run: ",
                           tensors, ". Set them back, or start afresh in another run.dir"));
}

// The counts a checkpoint restored, checked against its step: optimizer steps (at most the
// recipe's updates per run step, each), and each EMA's update count (at most one per step;
// a checkpoint older than the EMA's own count entry has it in trainer_state.json).
void checkLoadedCounts(RunParts& run, const checkpoint::LoadResult& loaded, const TrainerCounters& saved) {
  const std::string stateFile = loaded.dir + "/trainer_state.json";
  const RecipeSpec& recipe = recipeSpec(run.cfg.run.recipe);
  for (ModelPart& m : run.models) {
    const int64_t maxUpdates =
        boundedProduct(saved.step, recipe.maxUpdatesPerRunStep(m.cfg.name), std::numeric_limits<int64_t>::max());
    if (m.cfg.trainable) {
      m.strategy->optimizer().checkLoadedStepCounts(maxUpdates, loaded.dir, dtensor::statePrefix(m.cfg.names.optimizer));
    }
    if (!m.ema) continue;
    const std::string countEntry = dtensor::statePrefix(dtensor::kEmaKey) + m.ema->updateCountName();
    const auto& missing = loaded.missingOptional;
    if (std::find(missing.begin(), missing.end(), countEntry) != missing.end()) {
      const checkpoint::FormerEmaCounts& former = saved.formerEmaCounts;
      const bool single = run.models.size() == 1 && former.single.has_value();
      auto of = former.byName.find(m.cfg.names.ema);
      TESSERA_CHECK(single || of != former.byName.end(), loaded.dir, ": no update count of ",
                    m.cfg.names.ema, " (neither the tensor ", countEntry, " nor ", stateFile, "'s ema_updates)");
      m.ema->setUpdateCount(single ? *former.single : of->second);
    }
    TESSERA_CHECK(m.ema->updateCount() <= saved.step, loaded.dir, ": ", countEntry, " is ", m.ema->updateCount(),
                  ", more updates than the checkpoint's ", saved.step, " steps");
  }
}

// A loaded checkpoint's trainer_state.json on its own terms: its counters parse and are in
// range, and the EMA update counts it keeps by name (ema_updates_of, older checkpoints)
// name EMAs the checkpoint holds. Throws Error naming the file and the key.
void checkTrainerState(const checkpoint::LoadResult& loaded) {
  const std::string file = loaded.dir + "/trainer_state.json";
  const TrainerCounters saved = countersFromJson(loaded.trainerState, file);
  if (saved.formerEmaCounts.byName.empty()) return;
  checkpoint::checkFormerEmaCountsHeld(saved.formerEmaCounts, checkpoint::CheckpointReader(loaded.dir).metadata(), file);
}

// checkpoint.resume: loads the newest complete checkpoint ("auto", falling back to older
// ones when one fails verification on any rank) or the one named, into the run's state
// in place, and continues its counters. The load is planned against the checkpoint's
// metadata first: a state that does not fit (another model shape, optimizer or EMA set)
// is a configuration error naming the tensors and the changed settings, never a reason to
// fall back. The data position is step x global batch, so the global batch and the seed
// must be the checkpoint's. Returns whether it resumed.
bool resume(RunParts& run) {
  const TrainConfig& cfg = run.cfg;
  if (cfg.checkpoint.resume == "none") return false;
  const std::string checkpointsDir = (run.runDir / "checkpoints").string();
  const checkpoint::StateMap states = run.states();
  const distributed::TimeoutScope timeout(cfg.diagnostics.checkpoint_timeout);
  checkpoint::LoadOptions options;
  options.check = checkTrainerState;  // a step whose trainer state fails is passed over like a damaged one
  options.strict = true;              // every saved tensor is state this run has (another EMA set, optimizer: refused)
  std::optional<checkpoint::LoadResult> loaded;
  try {
    if (cfg.checkpoint.resume == "auto") {
      loaded = checkpoint::resumeLatest(checkpointsDir, states, run.hostComm.get(), options);
    } else {
      std::error_code missing;
      if (!fs::exists(cfg.checkpoint.resume, missing)) {
        throw ConfigError(cfg.origins.errorMessage(
            "checkpoint.resume",
            strCat("no checkpoint directory at '", cfg.checkpoint.resume, "'", relativePathNote(cfg.checkpoint.resume))));
      }
      loaded = checkpoint::load(cfg.checkpoint.resume, states, run.hostComm.get(), options);
    }
  } catch (const checkpoint::LoadPlanError& e) {
    refuseLayout(run, e);
  }
  if (!loaded) return false;
  const TrainerCounters saved =
      countersFromJson(loaded->trainerState, (std::filesystem::path(loaded->dir) / "trainer_state.json").string());
  if (saved.globalBatch != cfg.data.global_batch) {
    throw ConfigError(cfg.origins.errorMessage(
        "data.global_batch", strCat(cfg.data.global_batch, " differs from the ", saved.globalBatch, " that checkpoint ",
                                    loaded->dir, " was trained with; the data position cannot be converted")));
  }
  if (saved.seed != cfg.run.seed) {
    throw ConfigError(cfg.origins.errorMessage("run.seed", strCat(cfg.run.seed, " differs from the ", saved.seed,
                                                                  " of checkpoint ", loaded->dir,
                                                                  "; the data order would change")));
  }
  checkLoadedCounts(run, *loaded, saved);
  const ResumeCheck check = compareWithSaved(saved.resolvedConfig, run.resolvedYaml);
  if (!check.uncomparable.empty()) {
    TLOG_WARN0("resume from " << loaded->dir << ": its settings could not be compared with this run's: "
                              << check.uncomparable);
  } else if (!check.changed.empty()) {
    TLOG_WARN0("resume from " << loaded->dir << ": settings differ from the checkpoint's (this run's apply): "
                              << describeChanges(check.changed));
  }
  // A checkpoint written before the shards' contents were fingerprinted holds the part
  // before "; " alone (Dataset::fingerprint): it is compared so far.
  const std::string& now = run.counters.dataFingerprint;
  const bool sameData = saved.dataFingerprint == now || now.rfind(saved.dataFingerprint + "; ", 0) == 0;
  if (!saved.dataFingerprint.empty() && !sameData) {
    // Legitimate (shards added, a damaged one replaced), but the order from here is not the
    // one the uninterrupted run would have read.
    TLOG_WARN0("resume from " << loaded->dir << ": the data differs from what it was trained on ("
                              << saved.dataFingerprint << " then; "
                              << (run.counters.dataFingerprint.empty() ? std::string("other data")
                                                                       : run.counters.dataFingerprint)
                              << " now): the samples from here are not the ones an uninterrupted run would read");
  }
  run.startStep = saved.step;
  run.counters.skippedSteps = saved.skippedSteps;
  if (saved.worldSize != run.comm->worldSize()) {
    TLOG_WARN0("world " << saved.worldSize << " -> " << run.comm->worldSize() << " ranks, resumed from step " << saved.step
                        << " with the same global batch (" << cfg.data.global_batch << ")");
  }
  TLOG_INFO0("resumed from " << loaded->dir << " (step " << saved.step << ", saved by " << saved.worldSize
                             << " ranks with " << saved.strategy << "; now " << run.comm->worldSize()
                             << " ranks with " << run.strategies() << "), read " << loaded->bytesRead << " bytes in "
                             << loaded->seconds << " s");
  return true;
}

// Imports `file` into `entries` (names without `stripPrefix`); any failure — a missing
// file, names or shapes that do not fit, integers, NaN — is a config error naming `key`.
void importInto(RunParts& run, const std::string& key, const std::string& file,
                const std::vector<checkpoint::StateEntry>& entries, const std::string& stripPrefix,
                std::vector<std::string> mayBeMissing = {}) {
  checkpoint::ImportOptions options;
  options.stripPrefix = stripPrefix;
  options.mayBeMissing = std::move(mayBeMissing);
  options.comm = run.hostComm.get();
  try {
    checkpoint::importSafetensors(file, entries, options);
  } catch (const std::exception& e) {
    throw ConfigError(run.cfg.origins.errorMessage(key, strCat(e.what(), relativePathNote(file))));
  }
}

// A denoiser started from an export with another parameterisation (say v where the
// export predicts eps) would read its outputs otherwise than it learnt them: a frozen one
// (a DMD teacher) is refused naming the keys; a trainable one is fine-tuned into the new
// parameterisation (as Stable Diffusion 2 was from eps to v), with a warning.
void checkInitFromParameterisation(const RunParts& run, const ModelEntry& e) {
  std::optional<ModelDescription> exported;
  try {
    exported = exportedModelDescription(*e.model.init_from);
  } catch (const std::exception& error) {
    // A file that cannot be opened is importInto's to name; metadata that does not parse
    // leaves a frozen model's parameterisation unknown.
    if (e.trainable) return;
    throw ConfigError(run.cfg.origins.errorMessage(e.modelKeys + "init_from", error.what()));
  }
  if (!exported || !exported->model.isDenoiser()) return;
  const std::vector<std::string> differences = diffusionDifferences(exported->model, e.model);
  if (differences.empty()) return;
  std::string list;
  for (const std::string& d : differences) list += (list.empty() ? "" : "; ") + e.modelKeys + d;
  if (!e.trainable) {
    throw ConfigError(run.cfg.origins.errorMessage(
        e.modelKeys + "init_from",
        strCat(*e.model.init_from, " was trained otherwise than this frozen model reads it (", list,
               "): give the export's values")));
  }
  TLOG_WARN0(e.displayName << " starts from " << *e.model.init_from << ", trained with other diffusion settings ("
                           << list << "): it is fine-tuned into this run's");
}

// When init_from's tensors do not fit: the model settings its export was made with that
// differ from this model's ("" when it records none, or none differ).
std::string initFromDifferences(const RunParts& run, const ModelEntry& e) {
  std::optional<ModelDescription> exported;
  try {
    exported = exportedModelDescription(*e.model.init_from);
  } catch (const std::exception&) {
    return "";  // the import's own error already names what is wrong with the file
  }
  if (!exported) return "";
  std::string list;
  for (const std::string& d : modelDifferences(*exported, e.model, run.data->spec())) {
    list += (list.empty() ? "" : "; ") + e.modelKeys + d;
  }
  return list.empty() ? "" : strCat("\nthe file was exported from a model with other settings: ", list);
}

// A fresh run's start from files, model by model: init_from into the strategy's records
// (each rank reads the rows it holds), the EMA then starting from those weights;
// ema.init_from into every EMA profile. Both strict: names, shapes, floating point,
// finite (importSafetensors), and agreed: a bad row that one rank reads fails every rank.
void initializeFromFiles(RunParts& run) {
  for (ModelPart& m : run.models) {
    const ModelEntry& e = m.cfg;
    if (e.model.init_from) {
      if (e.model.isDenoiser()) checkInitFromParameterisation(run, e);
      const std::string prefix = dtensor::statePrefix(e.names.weights);
      try {
        // A GAN head (a DMD critic's) starts fresh when the file's model had none.
        importInto(run, e.modelKeys + "init_from", *e.model.init_from, m.strategy->stateEntries(prefix), prefix,
                   {std::string(models::kGanHeadModule) + "."});
      } catch (const ConfigError& error) {
        throw ConfigError(strCat(error.what(), initFromDifferences(run, e)));
      }
      m.strategy->publishParameters();
      if (m.ema) m.ema->resetFromLive();
      TLOG_INFO0(e.displayName << " initialised from " << *e.model.init_from);
    }
    if (m.ema && e.ema.initFrom) {
      // Fine-tuning: every EMA profile starts from given weights (names as the module's).
      for (size_t d = 0; d < m.ema->numProfiles(); ++d) {
        const std::string emaPrefix = dtensor::statePrefix(dtensor::kEmaKey);
        importInto(run, e.sectionKeys + "ema.init_from", *e.ema.initFrom, m.ema->profileEntries(d, emaPrefix),
                   emaPrefix + m.ema->stateName(d) + "/");
      }
      TLOG_INFO0(m.cfg.names.ema << " initialised from " << *e.ema.initFrom);
    }
  }
}

// The file data key `key` names.
const std::string& dataPath(const TrainConfig& cfg, const std::string& key) {
  if (key == "data.labels") return cfg.data.labels;
  if (key == "data.eval_path") return cfg.data.eval_path;
  if (key == "data.eval_labels") return cfg.data.eval_labels;
  return cfg.data.path;
}

// The data of the run: data.path opened as data.kind (errors name the key and, for a
// relative path, the directory it was resolved against), the sampler that splits each
// step's global batch over the ranks, and the micro-batches per rank and step.
void setUpData(RunParts& run) {
  const TrainConfig& cfg = run.cfg;
  const int world = run.comm->worldSize();
  std::error_code missing;
  // webdataset's data.path may be a glob or brace list: the dataset names a missing shard itself.
  if (cfg.data.kind != "webdataset" && !fs::exists(cfg.data.path, missing)) {
    throw ConfigError(
        cfg.origins.errorMessage("data.path", strCat("no file at '", cfg.data.path, "'", relativePathNote(cfg.data.path))));
  }
  try {
    run.data = datasets::makeDataset(cfg.data, models::tokenWindows(cfg.defaults.model), cfg.run.seed);
  } catch (const datasets::DataFileError& e) {  // data.labels, data.eval_path, ...: at that key's line
    const std::string message = cfg.origins.errorMessage(e.key(), strCat(e.what(), relativePathNote(dataPath(cfg, e.key()))));
    if (e.configError()) throw ConfigError(message);
    throw Error(message);
  } catch (const ConfigError& e) {
    throw ConfigError(cfg.origins.errorMessage("data.path", strCat(e.what(), relativePathNote(cfg.data.path))));
  } catch (const std::exception& e) {  // a file that is there but not usable: not the config's fault
    throw Error(cfg.origins.errorMessage("data.path", strCat(e.what(), relativePathNote(cfg.data.path))));
  }
  if (run.data->trainSamples() < cfg.data.global_batch) {
    throw ConfigError(cfg.origins.errorMessage("data.global_batch", strCat(cfg.data.global_batch, " is more than the ",
                                                                           run.data->trainSamples(),
                                                                           " training samples of data.path ",
                                                                           run.data->describe())));
  }
  const datasets::SampleOrder order = run.data->streams() ? datasets::SampleOrder::kStream
                                      : cfg.data.shuffle   ? datasets::SampleOrder::kShuffled
                                                           : datasets::SampleOrder::kFileOrder;
  run.sampler = std::make_unique<datasets::DistributedSampler>(run.data->trainSamples(), cfg.data.global_batch,
                                                              cfg.run.seed, order);
  if (cfg.run.deterministic) {
    run.plan = sharding::MicroBatchPlan{cfg.data.global_batch / cfg.data.micro_batch, world};
    run.microBatches = run.plan->passes();
    run.lossDivisor = run.plan->count;
    const int64_t fewest = run.plan->count / world;
    TLOG_INFO0("run.deterministic: " << run.plan->count << " micro-batches of " << cfg.data.micro_batch
               << " per step over " << world << (world == 1 ? " rank" : " ranks")
               << (run.plan->count % world == 0
                       ? strCat(", ", fewest, " each")
                       : strCat(", ", fewest, " or ", fewest + 1, " each (the ranks with ", fewest,
                                " run a padding pass whose gradients are dropped)"))
               << "; one intra-op thread per rank");
  } else {
    run.microBatches = cfg.data.global_batch / world / cfg.data.micro_batch;
    run.lossDivisor = run.microBatches;
  }
  if (cfg.data.micro_batch_asked > 0) {
    TLOG_WARN0("data.micro_batch " << cfg.data.micro_batch_asked << " does not divide the " << cfg.data.global_batch / world
               << " samples each of " << world << " ranks gets per step (data.global_batch " << cfg.data.global_batch
               << "): micro-batches of " << cfg.data.micro_batch << " instead, the largest that does");
  }
  if (!run.plan) {
    TLOG_INFO0("data " << run.data->describe() << "; " << run.sampler->stepsPerEpoch() << " steps per epoch; "
                       << run.microBatches << " micro-batches of " << cfg.data.micro_batch << " per rank per step");
  } else {
    TLOG_INFO0("data " << run.data->describe() << "; " << run.sampler->stepsPerEpoch() << " steps per epoch");
  }
}

// Sizes from outside (the data's classes and image size, the config's widths and batches)
// are checked against the memory a rank of this node may use before anything is built: a
// million classes or 16384-pixel images are a ConfigError naming the keys, not an
// allocator's message at the end of a run. The largest tensors each model's architecture
// plans (models::ArchitectureSpec::planned), a micro-batch of inputs, and the pictures an
// image denoiser draws (the sample grids, the judge's samples).
void checkPlannedMemory(const RunParts& run) {
  const TrainConfig& cfg = run.cfg;
  const datasets::DataSpec data = run.data->spec();
  const double pages = static_cast<double>(::sysconf(_SC_PHYS_PAGES)), pageBytes = static_cast<double>(::sysconf(_SC_PAGE_SIZE));
  if (pages <= 0 || pageBytes <= 0) return;
  const int localRanks = std::max(1, distributed::RankEnv::fromEnvironment().local_world_size);
  const double budget = pages * pageBytes / localRanks;
  double sample = 4.0;  // an fp32 input
  for (int64_t dim : data.inputShape) sample *= static_cast<double>(dim);
  const double micro = static_cast<double>(cfg.data.micro_batch);
  std::vector<models::PlannedTensor> planned{
      {"a micro-batch of inputs", micro * sample, "data.image_size, data.micro_batch"}};
  for (const ModelEntry& m : cfg.models) {
    const models::ArchitectureSpec& spec = models::architecture(m.model.arch);
    if (spec.planned) {
      for (models::PlannedTensor& p : spec.planned(m.model, data, cfg.data.micro_batch)) planned.push_back(std::move(p));
    }
  }
  const ModelEntry& first = cfg.models.front();
  if (first.model.isDenoiser() && data.inputShape.size() == 3) {
    const double rows = static_cast<double>(data.classes > 0 ? data.classes : 10);
    planned.push_back({"a sample grid", rows * static_cast<double>(cfg.eval.sample_per_class) * sample,
                       "eval.sample_per_class, data.path (its classes)"});
    if (!cfg.eval.judge.empty()) {
      planned.push_back({"the judge's samples", rows * static_cast<double>(cfg.eval.judge_per_class) * sample,
                         "eval.judge_per_class, data.path (its classes)"});
    }
  }
  for (const models::PlannedTensor& p : planned) {
    if (p.bytes <= budget) continue;
    const std::string key = p.keys.substr(0, p.keys.find_first_of(", ("));
    throw ConfigError(cfg.origins.errorMessage(
        key, strCat(p.what, " would take ", std::llround(p.bytes / (1 << 20)), " MiB, more than the ",
                    std::llround(budget / (1 << 20)), " MiB of memory each of the ", localRanks,
                    " ranks of this machine has (sized by ", p.keys, "; data: ", run.data->describe(), ")")));
  }
}

}  // namespace

// fault.survive: `run` takes this rank's state from `previous`, its parts before a lost
// replica group left, entry by entry; each must have the same layout in both (hybrid keeps
// its shard groups, no_shard holds everything on every rank).
void adoptState(RunParts& run, RunParts& previous, int64_t stepsDone) {
  const std::vector<checkpoint::StateEntry> from = checkpoint::collectEntries(previous.states());
  std::map<std::string, const checkpoint::StateEntry*> byName;
  for (const checkpoint::StateEntry& e : from) byName[e.name] = &e;
  const checkpoint::StateMap states = run.states();
  for (const checkpoint::StateEntry& e : checkpoint::collectEntries(states)) {
    const auto it = byName.find(e.name);
    if (it == byName.end()) {
      throw Error(strCat("fault.survive: state '", e.name, "' of the new world is not among this rank's state"));
    }
    // The same rows of the same tensor (a replicated one's world does not matter).
    const dtensor::ShardSpec& was = it->second->spec;
    if (was.placement() != e.spec.placement() || was.globalShape() != e.spec.globalShape() ||
        was.dtype() != e.spec.dtype() || was.localRowRange() != e.spec.localRowRange() ||
        it->second->local.numel() != e.local.numel()) {
      throw Error(strCat("fault.survive: state '", e.name, "' is ", it->second->spec.str(), " on this rank but ",
                         e.spec.str(), " in the world that goes on: its layout changed"));
    }
    e.local.copy_(it->second->local);
  }
  checkpoint::afterLoad(states);
  run.counters = previous.counters;
  run.counters.worldSize = run.comm->worldSize();
  run.counters.strategy = run.strategies();
  run.counters.step = stepsDone;
  run.startStep = stepsDone;
}

// How buildRun's parts get their state.
enum class StateFrom {
  kFiles,     // the run.dir's claim, the local tier, a resume or an initialisation from files
  kPrevious,  // fault.survive: this rank's parts before the world changed
  kPeer,      // fault.survive: a rank rejoining; shareState() fills it afterwards
};

// The parts of a run, their state from `from` (kPrevious: `previous`'s, after `stepsDone`
// steps).
std::unique_ptr<RunParts> buildRun(TrainConfig config, std::string resolvedYaml,
                                   std::shared_ptr<distributed::Communicator> comm, StateFrom from,
                                   RunParts* previous, int64_t stepsDone) {
  auto run = std::make_unique<RunParts>();
  run->cfg = std::move(config);
  run->resolvedYaml = std::move(resolvedYaml);
  run->comm = std::move(comm);
  run->hostComm = run->comm->host();
  const TrainConfig& cfg = run->cfg;
  const int rank = run->comm->rank();
  for (const std::string& warning : cfg.warnings) TLOG_WARN0(warning);
  const int world = run->comm->worldSize();
  run->runDir = cfg.run.dir;
  const bool localTier = cfg.checkpoint.local.every_steps > 0 && from == StateFrom::kFiles;
  if (localTier) {
    checkLocalTierDir(cfg, localTierOptions(cfg), *run->hostComm);
    promoteFromLocalTier(cfg, localTierOptions(cfg), *run->hostComm);
  }
  // One run per run.dir: decided on rank 0 before anything is written, agreed by all.
  if (from == StateFrom::kFiles) {
    distributed::runOnEveryRank(run->hostComm.get(), "checking run.dir for an earlier run", [&] {
      if (rank == 0) claimRunDir(cfg);
    });
  }
  makeWritableRunDir(run->runDir);
  if (rank == 0) replaceFile((run->runDir / "config.resolved.yaml").string(), run->resolvedYaml);

  // torch's generator starts from run.seed on every rank (whatever draws from it); the
  // models' initial values do not come from it but from the strategies' initializers,
  // keyed by the seed and parameter names, so every rank agrees on them by construction.
  torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
  run->device = trainingDevice(cfg);
  checkComputeDtypes(cfg, run->device);
  setCpuMatmulDtype(cfg, run->device);
  // run.deterministic: a kernel's bits may depend on how many threads split its work (a
  // matrix product's blocking); one per rank leaves none that do.
  if (cfg.run.deterministic) at::set_num_threads(1);
  setUpData(*run);
  checkPlannedMemory(*run);
  for (const ModelEntry& entry : cfg.models) run->models.push_back(buildModel(*run, entry));

  // Checkpointer and resume.
  setUpCheckpointer(*run);
  run->counters.globalBatch = cfg.data.global_batch;
  run->counters.seed = cfg.run.seed;
  run->counters.strategy = run->strategies();
  run->counters.worldSize = world;
  run->counters.resolvedConfig = run->resolvedYaml;
  run->counters.dataFingerprint = run->data->fingerprint();
  // The names the config gives the run's exports are those its components answer to: the
  // config's checks and the exports at the end read one list (runExportNames).
  std::map<std::string, std::string> exportNames;
  for (const ExportName& n : runExportNames(cfg)) exportNames[n.name] = n.prefix;
  const std::map<std::string, std::string> components = checkpoint::collectExportNames(run->states());
  TESSERA_CHECK(exportNames == components, "setUpRun: the run's export names (", exportNames.size(),
                ") differ from its components' (", components.size(), "): runExportNames is out of date");
  for (const ModelPart& part : run->models) {
    const std::string metadata = modelMetadataJson(part.cfg.model, run->data->spec(), &cfg.data);
    const ModelStateNames& names = part.cfg.names;
    run->counters.modelMetadata[dtensor::statePrefix(names.weights)] = metadata;
    for (const std::string& ema : {names.ema, names.formerEma}) {
      if (!ema.empty()) run->counters.modelMetadata[dtensor::statePrefix(dtensor::kEmaKey) + ema] = metadata;
    }
  }
  if (from == StateFrom::kPrevious) {
    adoptState(*run, *previous, stepsDone);
    return run;
  }
  if (from == StateFrom::kPeer) {
    run->counters.step = run->startStep = stepsDone;
    return run;
  }
  if (!resume(*run)) initializeFromFiles(*run);  // a resumed run keeps the checkpoint's weights
  if (run->startStep > cfg.run.steps) {
    throw ConfigError(cfg.origins.errorMessage(
        "run.steps", strCat(cfg.run.steps, " is below the step the run resumes from (", run->startStep, ")")));
  }
  if (localTier) {
    // The run is accepted and resumed: what the tier holds of it is superseded by the
    // persistent tier (a promoted step is there now). Another run's steps stay.
    const checkpoint::LocalTierOptions tier = localTierOptions(cfg);
    checkpoint::clearLocalTier(tier.dir, tier.owner, run->hostComm.get());
  }
  return run;
}

std::unique_ptr<RunParts> setUpRun(TrainConfig config, std::string resolvedYaml,
                                   std::shared_ptr<distributed::Communicator> comm) {
  return buildRun(std::move(config), std::move(resolvedYaml), std::move(comm), StateFrom::kFiles, nullptr, 0);
}

std::unique_ptr<RunParts> setUpRunFrom(RunParts& previous, int64_t stepsDone,
                                       std::shared_ptr<distributed::Communicator> comm) {
  TrainConfig cfg = previous.cfg;
  fitBatchToWorld(cfg, comm->worldSize());
  return buildRun(std::move(cfg), previous.resolvedYaml, std::move(comm), StateFrom::kPrevious, &previous, stepsDone);
}

std::unique_ptr<RunParts> setUpRunToJoin(TrainConfig config, std::string resolvedYaml, int64_t stepsDone,
                                         int64_t skippedSteps, std::shared_ptr<distributed::Communicator> comm) {
  fitBatchToWorld(config, comm->worldSize());
  std::unique_ptr<RunParts> run =
      buildRun(std::move(config), std::move(resolvedYaml), std::move(comm), StateFrom::kPeer, nullptr, stepsDone);
  run->counters.skippedSteps = skippedSteps;
  return run;
}

void shareState(RunParts& run, distributed::Communicator& counterparts, int root) {
  const checkpoint::StateMap states = run.states();
  const std::vector<checkpoint::StateEntry> entries = checkpoint::collectEntries(states);
  // Both sides list the same entries (one config, one layout): checked before anything moves.
  int64_t elements = 0;
  for (const checkpoint::StateEntry& e : entries) elements += e.local.numel();
  const at::Tensor mine = at::tensor({static_cast<int64_t>(entries.size()), elements}, at::kLong);
  const at::Tensor theirs = mine.clone();
  counterparts.broadcast(theirs, root);
  if (!at::equal(mine, theirs)) {
    throw Error(strCat("fault.survive: the rank sending this rank's state holds ", theirs[0].item<int64_t>(),
                       " entries of ", theirs[1].item<int64_t>(), " elements, this one ", entries.size(), " of ",
                       elements, ": their runs differ"));
  }
  for (const checkpoint::StateEntry& e : entries) {
    if (e.local.is_contiguous()) {
      counterparts.broadcast(e.local, root);
    } else {
      const at::Tensor buffer = e.local.contiguous();
      counterparts.broadcast(buffer, root);
      e.local.copy_(buffer);
    }
  }
  if (counterparts.rank() != root) checkpoint::afterLoad(states);
}

}  // namespace tessera::trainer
