// The train loop of tessera-train: builds model, optimizer and data from a TrainConfig,
// trains data-parallel over a Communicator, records metrics and the loss curve.
//
// Gradient synchronisation is plain data parallelism (one flat all-reduce of the
// averaged gradients per step); the sharded strategies (zero1/2/3, hybrid) replace it
// as issues 4 and 5 land.
#pragma once

#include <memory>
#include <string>

#include "trainer/train_config.h"

namespace tessera::distributed {
class Communicator;
}

namespace tessera::trainer {

struct TrainSummary {
  int64_t steps = 0;
  double firstLoss = 0;  // mean train loss of the first logged window
  double finalLoss = 0;  // mean train loss of the last logged window
  double evalLoss = 0;   // held-out loss at the end (NaN when there is no held-out split)
  double samplesPerSec = 0;
  std::string runDir;
  std::string metricsPath;
  std::string lossCurvePath;
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
