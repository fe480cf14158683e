// The train loop of tessera-train: builds model, optimizer and data from a TrainConfig,
// trains data-parallel over a Communicator, records metrics and the loss curve.
//
// The sharding strategy (sharding/strategy.h) owns gradient synchronisation, the
// sharded optimizer and parameter publication; the EMA follows its fp32 masters.
#pragma once

#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "trainer/train_config.h"

namespace tessera::distributed {
class Communicator;
}

namespace tessera::trainer {

struct TrainSummary {
  int64_t steps = 0;
  double firstLoss = 0;  // mean train loss of the first logged window
  double finalLoss = 0;  // mean train loss of the last logged window
  bool lossLogged = false;  // a window was logged (a run stopped before run.log_every steps has none)
  // The held-out loss of the last evaluation, live and EMA weights; NaN until one ran (a run
  // stopped by a signal before its first evaluation has none).
  double evalLoss = std::numeric_limits<double>::quiet_NaN();
  double evalLossEma = std::numeric_limits<double>::quiet_NaN();
  bool evaluated = false;
  double samplesPerSec = 0;
  std::string runDir;
  std::string metricsPath;
  std::string lossCurvePath;
  std::vector<std::string> exports;  // safetensors files written (rank 0)
  std::string samplesPath;           // diffusion samples (model.samples > 0; rank 0)
  std::vector<std::string> sampleGrids;  // the last sample grids (image denoisers; rank 0)
  std::string judgement;                 // eval.judge's line (rank 0)
  std::string tracePath;                 // profile: the merged timeline (rank 0)
  bool preempted = false;            // stopped early (SIGTERM or run.stop_after_steps), after a checkpoint
  // Stopped early because another rank had a stop signal and this one had none (its node
  // lost, say): tessera-train then exits kStoppedForAPeerStatus, so that a launcher
  // restarts it (and the run resumes) instead of taking the stop for the end of the run.
  bool stoppedForAPeer = false;
  // run.dir held a run already finished (its checkpoint is at run.steps): nothing was
  // trained, saved or exported.
  bool alreadyFinished = false;
  // fault.survive: this process was restarted to rejoin a run that finished before it could.
  bool finishedWithoutThisRank = false;
};

class Trainer {
 public:
  // `resolvedYaml` is saved as <run.dir>/config.resolved.yaml.
  Trainer(TrainConfig config, std::string resolvedYaml, std::shared_ptr<distributed::Communicator> comm);
  ~Trainer();

  TrainSummary run();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace tessera::trainer
