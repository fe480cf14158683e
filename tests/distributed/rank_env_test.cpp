// RankEnv: the torchrun, SLURM, OpenMPI and single-process contracts, and every kind of
// missing or contradictory value naming the variable and the value.
#include <gtest/gtest.h>

#include <cstdlib>

#include "common/errors.h"
#include "distributed/rank_env.h"

namespace tessera::distributed {
namespace {

using Vars = std::map<std::string, std::string>;

// Expects fromMap(vars) to throw ConfigError whose message contains every fragment.
void expectConfigError(const Vars& vars, const std::vector<std::string>& fragments) {
  try {
    RankEnv::fromMap(vars);
    ADD_FAILURE() << "no ConfigError; expected one mentioning " << fragments.front();
  } catch (const ConfigError& e) {
    for (const auto& fragment : fragments) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
          << "message '" << e.what() << "' lacks '" << fragment << "'";
    }
  }
}

Vars torchrun() {
  return {{"RANK", "5"},
          {"LOCAL_RANK", "1"},
          {"WORLD_SIZE", "8"},
          {"LOCAL_WORLD_SIZE", "4"},
          {"GROUP_RANK", "1"},
          {"MASTER_ADDR", "10.1.2.3"},
          {"MASTER_PORT", "29511"},
          {"TORCHELASTIC_RESTART_COUNT", "2"},
          {"TORCHELASTIC_MAX_RESTARTS", "3"}};
}

TEST(RankEnvTest, TorchrunContract) {
  const RankEnv env = RankEnv::fromMap(torchrun());
  EXPECT_EQ(env.source, "torchrun");
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.group_rank, 1);
  EXPECT_EQ(env.master_addr, "10.1.2.3");
  EXPECT_EQ(env.master_port, 29511);
  EXPECT_EQ(env.restart_count, 2);
  EXPECT_EQ(env.max_restarts, 3);
  EXPECT_FALSE(env.use_agent_store);
  EXPECT_FALSE(env.singleNode());
  EXPECT_NE(env.describe().find("rank 5/8"), std::string::npos) << env.describe();
}

TEST(RankEnvTest, TorchrunAgentStoreAndDefaults) {
  // Only what PyTorch's env:// needs: the local values default to a single node.
  const RankEnv env = RankEnv::fromMap({{"RANK", "2"},
                                        {"WORLD_SIZE", "3"},
                                        {"MASTER_ADDR", "h"},
                                        {"MASTER_PORT", "1234"},
                                        {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  EXPECT_EQ(env.local_rank, 2);
  EXPECT_EQ(env.local_world_size, 3);
  EXPECT_EQ(env.group_rank, 0);
  EXPECT_EQ(env.restart_count, 0);
  EXPECT_TRUE(env.use_agent_store);
  EXPECT_TRUE(env.singleNode());
}

TEST(RankEnvTest, TorchrunSingleRankNeedsNoMaster) {
  const RankEnv env = RankEnv::fromMap({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.master_addr, "127.0.0.1");
}

TEST(RankEnvTest, TorchrunErrorsNameVariableAndValue) {
  Vars v = torchrun();
  v["RANK"] = "8";
  expectConfigError(v, {"RANK='8'", "WORLD_SIZE='8'"});
  v = torchrun();
  v["RANK"] = "abc";
  expectConfigError(v, {"RANK='abc'", "not an integer"});
  v = torchrun();
  v["WORLD_SIZE"] = "4x";
  expectConfigError(v, {"WORLD_SIZE='4x'", "not an integer"});
  v = torchrun();
  v.erase("WORLD_SIZE");
  expectConfigError(v, {"RANK='5'", "WORLD_SIZE is not"});
  v = torchrun();
  v.erase("RANK");
  expectConfigError(v, {"WORLD_SIZE='8'", "RANK is not"});
  v = torchrun();
  v["LOCAL_RANK"] = "4";
  expectConfigError(v, {"LOCAL_RANK='4'", "LOCAL_WORLD_SIZE='4'"});
  v = torchrun();
  v["LOCAL_WORLD_SIZE"] = "9";
  expectConfigError(v, {"LOCAL_WORLD_SIZE='9'"});
  v = torchrun();
  v["RANK"] = "-1";
  expectConfigError(v, {"RANK='-1'"});
  v = torchrun();
  v["WORLD_SIZE"] = "0";
  expectConfigError(v, {"WORLD_SIZE='0'"});
  v = torchrun();
  v["GROUP_RANK"] = "8";
  expectConfigError(v, {"GROUP_RANK='8'"});
  v = torchrun();
  v["MASTER_PORT"] = "70000";
  expectConfigError(v, {"MASTER_PORT='70000'"});
  v = torchrun();
  v["MASTER_PORT"] = "http";
  expectConfigError(v, {"MASTER_PORT='http'"});
  v = torchrun();
  v.erase("MASTER_ADDR");
  expectConfigError(v, {"MASTER_ADDR is not set", "WORLD_SIZE=8"});
  v = torchrun();
  v.erase("MASTER_PORT");
  expectConfigError(v, {"MASTER_PORT is not set"});
  v = torchrun();
  v["TORCHELASTIC_RESTART_COUNT"] = "-2";
  expectConfigError(v, {"TORCHELASTIC_RESTART_COUNT='-2'"});
  v = torchrun();
  v["TORCHELASTIC_MAX_RESTARTS"] = "many";
  expectConfigError(v, {"TORCHELASTIC_MAX_RESTARTS='many'"});
}

Vars slurm() {
  return {{"SLURM_PROCID", "5"},   {"SLURM_LOCALID", "1"},          {"SLURM_NTASKS", "7"},
          {"SLURM_NODEID", "2"},   {"SLURM_TASKS_PER_NODE", "2(x3),1"}, {"SLURM_JOB_NODELIST", "gpu[07-09,12],cpu1"},
          {"SLURM_JOB_ID", "123456"}};
}

TEST(RankEnvTest, SlurmContract) {
  const RankEnv env = RankEnv::fromMap(slurm());
  EXPECT_EQ(env.source, "slurm");
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.world_size, 7);
  EXPECT_EQ(env.group_rank, 2);
  EXPECT_EQ(env.local_world_size, 2);  // node 2's entry of 2,2,2,1
  EXPECT_EQ(env.master_addr, "gpu07");
  EXPECT_EQ(env.master_port, 20000 + 123456 % 20000);

  Vars v = slurm();
  v["SLURM_PROCID"] = "6";
  v["SLURM_LOCALID"] = "0";
  v["SLURM_NODEID"] = "3";
  EXPECT_EQ(RankEnv::fromMap(v).local_world_size, 1);  // the "1" after "2(x3)"

  v = slurm();
  v["SLURM_NTASKS_PER_NODE"] = "3";
  v["MASTER_ADDR"] = "login1";
  v["MASTER_PORT"] = "4000";
  const RankEnv explicitEnv = RankEnv::fromMap(v);
  EXPECT_EQ(explicitEnv.local_world_size, 3);
  EXPECT_EQ(explicitEnv.master_addr, "login1");
  EXPECT_EQ(explicitEnv.master_port, 4000);

  v = slurm();
  v["SLURM_JOB_NODELIST"] = "node1,node2";
  EXPECT_EQ(RankEnv::fromMap(v).master_addr, "node1");
}

TEST(RankEnvTest, SlurmErrors) {
  Vars v = slurm();
  v.erase("SLURM_NTASKS");
  expectConfigError(v, {"SLURM_NTASKS is not set"});
  v = slurm();
  v["SLURM_PROCID"] = "7";
  expectConfigError(v, {"SLURM_PROCID='7'", "SLURM_NTASKS='7'"});
  v = slurm();
  v["SLURM_TASKS_PER_NODE"] = "2(x";
  expectConfigError(v, {"SLURM_TASKS_PER_NODE='2(x'"});
  v = slurm();
  v["SLURM_NODEID"] = "9";
  expectConfigError(v, {"SLURM_NODEID='9'", "SLURM_TASKS_PER_NODE"});
  v = slurm();
  v["SLURM_LOCALID"] = "2";
  expectConfigError(v, {"SLURM_LOCALID='2'"});
  v = slurm();
  v.erase("SLURM_JOB_NODELIST");
  expectConfigError(v, {"MASTER_ADDR is not set", "SLURM_JOB_NODELIST"});
}

TEST(RankEnvTest, OpenMpiContract) {
  const RankEnv env = RankEnv::fromMap({{"OMPI_COMM_WORLD_RANK", "3"},
                                        {"OMPI_COMM_WORLD_SIZE", "4"},
                                        {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                        {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                        {"OMPI_COMM_WORLD_NODE_RANK", "1"},
                                        {"MASTER_ADDR", "node0"}});
  EXPECT_EQ(env.source, "openmpi");
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.group_rank, 1);
  EXPECT_EQ(env.master_addr, "node0");
  EXPECT_EQ(env.master_port, 29500);

  // One node: loopback by default.
  const RankEnv local = RankEnv::fromMap({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                                          {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}});
  EXPECT_EQ(local.master_addr, "127.0.0.1");
  EXPECT_EQ(local.local_world_size, 2);
}

TEST(RankEnvTest, OpenMpiErrors) {
  expectConfigError({{"OMPI_COMM_WORLD_RANK", "0"}}, {"OMPI_COMM_WORLD_SIZE is not set"});
  expectConfigError({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "2"}},
                    {"OMPI_COMM_WORLD_RANK='2'", "OMPI_COMM_WORLD_SIZE='2'"});
  // Several nodes and no MASTER_ADDR: the store host cannot be guessed.
  expectConfigError({{"OMPI_COMM_WORLD_RANK", "0"},
                     {"OMPI_COMM_WORLD_SIZE", "4"},
                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
                    {"MASTER_ADDR is not set", "mpirun -x"});
}

TEST(RankEnvTest, SingleProcessWhenNothingIsSet) {
  const RankEnv env = RankEnv::fromMap({{"HOME", "/root"}});
  EXPECT_EQ(env.source, "single");
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.local_world_size, 1);
  EXPECT_TRUE(env.singleNode());
}

TEST(RankEnvTest, TorchrunWinsOverSlurm) {
  Vars v = slurm();
  for (const auto& [key, value] : torchrun()) v[key] = value;
  EXPECT_EQ(RankEnv::fromMap(v).source, "torchrun");
}

TEST(RankEnvTest, EmptyValueCountsAsUnset) {
  EXPECT_EQ(RankEnv::fromMap({{"RANK", ""}, {"WORLD_SIZE", ""}}).source, "single");
}

TEST(RankEnvTest, FromEnvironmentReadsProcessEnvironment) {
  // Runs in its own process under ctest; restore what was there anyway.
  const char* names[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"};
  std::map<std::string, std::optional<std::string>> saved;
  for (const char* name : names) {
    const char* value = std::getenv(name);
    saved[name] = value ? std::optional<std::string>(value) : std::nullopt;
  }
  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("LOCAL_RANK", "1", 1);
  ::setenv("LOCAL_WORLD_SIZE", "2", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", "29999", 1);
  const RankEnv env = RankEnv::fromEnvironment();
  for (const auto& [name, value] : saved) {
    if (value) {
      ::setenv(name.c_str(), value->c_str(), 1);
    } else {
      ::unsetenv(name.c_str());
    }
  }
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 2);
  EXPECT_EQ(env.master_port, 29999);
}

}  // namespace
}  // namespace tessera::distributed
