// tessera-train: runs one YAML-configured training job on this rank.
//   tessera-train --config FILE [--set key=value ...] [--resume auto|none|DIR] [--print-config]
// Started once per rank by tessera-run or torchrun (reads their environment); with no
// launcher it runs as a single process. Exit status: 0 ok, 2 bad config/arguments,
// 1 run-time failure (message also in $TORCHELASTIC_ERROR_FILE when set), 75 stopped
// with a checkpoint because another rank was stopped (restart to resume), 76 restarted into
// a running elastic round (tessera-run) where no run takes it back.

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <sstream>

#include "common/app_main.h"
#include "common/command_line.h"
#include "common/errors.h"
#include "common/signal_thread.h"
#include "common/logging.h"
#include "distributed/rank_env.h"
#include "distributed/runtime.h"
#include "recipes/recipes.h"
#include "sharding/host_allocator.h"
#include "trainer/run_dir.h"
#include "trainer/run_setup.h"
#include "trainer/replica_groups.h"
#include "trainer/trainer.h"

int main(int argc, char** argv) {
  tessera::sharding::useCachingHostAllocator();
  return tessera::runMain("tessera-train", [&]() -> int {
    tessera::routeSignalsToOwnThread();  // before any thread starts: no handler runs inside a oneDNN product
    CLI::App app{"Tessera: run one YAML-configured training job on this rank"};
    std::string configFile;
    std::vector<std::string> overrides;
    bool printConfig = false;
    std::string resume;
    app.add_option("--config", configFile, "YAML run configuration")->required();
    app.add_option("--set", overrides, "Override one key: --set optim.lr=1e-4 (repeatable)")->take_all();
    app.add_option("--resume", resume, "auto (latest complete checkpoint of run.dir), none, or a checkpoint directory "
                   "(overrides checkpoint.resume)");
    app.add_flag("--print-config", printConfig, "Print the resolved configuration and exit");
    if (const auto done = tessera::parseCommandLine(app, argc, argv)) return *done;

    if (!resume.empty()) overrides.push_back("checkpoint.resume=" + resume);
    const auto env = tessera::distributed::RankEnv::fromEnvironment();
    tessera::recipes::addBuiltinRecipes();
    auto loaded = tessera::trainer::loadTrainConfig(configFile, overrides, env.world_size);
    if (printConfig) {
      std::cout << loaded.resolvedYaml;
      return 0;
    }
    const auto& cfg = loaded.config;
    tessera::log::LogOptions logOptions;
    logOptions.rank = env.rank;
    logOptions.level = cfg.log.level;
    tessera::trainer::makeWritableRunDir(cfg.run.dir);  // a clear refusal before the log file opens
    if (cfg.log.per_rank_files) {
      logOptions.file = (std::filesystem::path(cfg.run.dir) / "logs" / ("rank_" + std::to_string(env.rank) + ".log")).string();
    }
    tessera::log::init(logOptions);
    tessera::trainer::startFlightRecorder(cfg, env);

    // fault.survive: a rank restarted into a run that lives on rejoins it (the Trainer without
    // a communicator) instead of starting a world of its own.
    std::shared_ptr<tessera::distributed::Runtime> runtime;
    if (!cfg.fault.survive || !tessera::trainer::ReplicaGroups::rejoins(env, std::chrono::seconds(10))) {
      const char* intoLiveRound = std::getenv(tessera::kRestartedIntoLiveRoundEnv);
      if (intoLiveRound && std::string(intoLiveRound) == "1") {
        // The launcher tries the running round first; the next one starts a world as usual.
        TLOG_WARN("restarted into the running rendezvous round, but no run there takes this rank back ("
                  << (cfg.fault.survive ? "its store says none lives on" : "fault.survive is off")
                  << "); the launcher starts the next round");
        return tessera::kNothingToRejoinStatus;
      }
      runtime = tessera::distributed::Runtime::init(env, tessera::trainer::runtimeOptions(cfg, env));
      TLOG_INFO0("rendezvous of " << env.world_size << " ranks done in " << runtime->startupSeconds() << " s; "
                                  << runtime->comm()->backendName() << " moves parameters and gradients");
    }
    tessera::trainer::Trainer trainer(loaded.config, loaded.resolvedYaml, runtime ? runtime->comm() : nullptr);
    const auto summary = trainer.run();
    if (summary.finishedWithoutThisRank) return 0;  // said so
    if (summary.alreadyFinished) {  // said so, nothing trained; the exports it lacked written
      for (const auto& file : summary.exports) TLOG_INFO0("export: " << file);
      return 0;
    }
    std::ostringstream heldOut;
    if (summary.evaluated) {
      heldOut << "held-out loss " << summary.evalLoss << " (EMA " << summary.evalLossEma << ")";
    } else {
      heldOut << "no held-out loss (the run stopped before its first evaluation)";
    }
    std::ostringstream loss;
    if (summary.lossLogged) {
      loss << "loss " << summary.firstLoss << " -> " << summary.finalLoss;
    } else {
      loss << "no loss logged (it stopped before a run.log_every window ended)";
    }
    TLOG_INFO0("done: " << summary.steps << " steps, " << loss.str() << ", " << heldOut.str() << ", "
                        << summary.samplesPerSec << " samples/s");
    if (!summary.metricsPath.empty()) {  // rank 0 writes them; the line is in every rank's log file
      TLOG_INFO0("metrics: " << summary.metricsPath << "; loss curve: " << summary.lossCurvePath);
    }
    for (const auto& file : summary.exports) TLOG_INFO0("export: " << file);
    if (!summary.samplesPath.empty()) TLOG_INFO0("samples: " << summary.samplesPath);
    for (const auto& grid : summary.sampleGrids) TLOG_INFO0("sample grid: " << grid);
    if (!summary.judgement.empty()) TLOG_INFO0(summary.judgement);
    if (summary.preempted) TLOG_WARN0("stopped early after step " << summary.steps << " (checkpoint saved; resume to continue)");
    if (summary.stoppedForAPeer) {
      tessera::writeErrorFile(tessera::strCat("stopped at step ", summary.steps,
                                              " with a checkpoint because another rank was asked to stop; restart to "
                                              "resume"));
      return tessera::kResumableStopStatus;
    }
    return 0;
  });
}
