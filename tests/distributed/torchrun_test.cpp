// Tessera under the real torchrun (Debian's python3-torch): tessera-comm-check reads
// torchrun's environment, rendezvouses and runs collectives on every rank. Skipped when
// no python3 with torch is installed. Also the same program without any launcher.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "common/errors.h"
#include "tests/support/free_port.h"

namespace tessera {
namespace {

const std::string kCommCheck = std::string(TESSERA_BIN_DIR) + "/tessera-comm-check";
// Clears any rank environment the test itself may run under.
const std::string kCleanEnv =
    "env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u GROUP_RANK -u MASTER_ADDR -u MASTER_PORT "
    "-u SLURM_PROCID -u OMPI_COMM_WORLD_RANK OMP_NUM_THREADS=1 ";

struct CommandResult {
  int status = -1;
  std::string output;
};

CommandResult run(const std::string& command) {
  CommandResult result;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return result;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) result.output.append(buf, n);
  const int status = ::pclose(pipe);
  result.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

// A python3 that can import torch: the one on PATH, else Debian's.
std::string pythonWithTorch() {
  for (const std::string candidate : {"python3", "/usr/bin/python3"}) {
    if (run(candidate + " -c 'import torch.distributed.run' >/dev/null").status == 0) return candidate;
  }
  return "";
}

using tessera::test::freePort;

// torchrun 1.13 on Python 3.11 cannot parse its default --redirects/--tee ("0"; an
// IntFlag iteration change), so pass values it can: stdout to a log file and the console.
const char* kTorchrunStreams = " --redirects 1 --tee 1 ";

void expectAllRanksOk(const CommandResult& result, int world) {
  EXPECT_EQ(result.status, 0) << result.output;
  for (int r = 0; r < world; ++r) {
    EXPECT_NE(result.output.find(strCat("rank ", r, "/", world, ": collectives OK")), std::string::npos)
        << "rank " << r << " did not report; output:\n" << result.output;
  }
}

TEST(TorchrunTest, CommCheckWithoutLauncher) {
  const auto result = run("timeout 60 " + kCleanEnv + kCommCheck);
  expectAllRanksOk(result, 1);
  EXPECT_NE(result.output.find("single environment"), std::string::npos) << result.output;
}

TEST(TorchrunTest, StaticRendezvousTwoRanks) {
  const std::string python = pythonWithTorch();
  if (python.empty()) GTEST_SKIP() << "no python3 with torch (apt install python3-torch)";
  // Static rendezvous: torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE).
  const auto result = run(strCat("timeout 120 ", kCleanEnv, python, " -m torch.distributed.run --nproc_per_node 2",
                                 " --master_port ", freePort(), kTorchrunStreams, "--no_python ", kCommCheck,
                                 " --timeout 60"));
  expectAllRanksOk(result, 2);
  EXPECT_NE(result.output.find("torchrun environment"), std::string::npos) << result.output;
}

TEST(TorchrunTest, StandaloneThreeRanks) {
  const std::string python = pythonWithTorch();
  if (python.empty()) GTEST_SKIP() << "no python3 with torch (apt install python3-torch)";
  // c10d rendezvous on a free port: rank 0 hosts Tessera's own store on MASTER_PORT.
  const auto result = run(strCat("timeout 120 ", kCleanEnv, python,
                                 " -m torch.distributed.run --standalone --nproc_per_node 3", kTorchrunStreams,
                                 "--no_python ", kCommCheck, " --timeout 60"));
  expectAllRanksOk(result, 3);
}

// The shared-memory backend under torchrun: ranks started by another launcher find each
// other's segment and processes.
TEST(TorchrunTest, StandaloneThreeRanksOverSharedMemory) {
  const std::string python = pythonWithTorch();
  if (python.empty()) GTEST_SKIP() << "no python3 with torch (apt install python3-torch)";
  const auto result = run(strCat("timeout 120 ", kCleanEnv, python,
                                 " -m torch.distributed.run --standalone --nproc_per_node 3", kTorchrunStreams,
                                 "--no_python ", kCommCheck, " --backend shm --timeout 60"));
  expectAllRanksOk(result, 3);
  EXPECT_NE(result.output.find("(shm backend"), std::string::npos) << result.output;
}

}  // namespace
}  // namespace tessera
