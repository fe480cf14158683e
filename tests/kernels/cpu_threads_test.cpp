// Tessera's CPU loops run on LibTorch's threads (kernels/cpu_threads.h): a library compiled
// without OpenMP runs every at::parallel_for on one thread whatever the thread count says.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "kernels/cpu_threads.h"

namespace tessera::kernels {
namespace {

TEST(CpuThreadsTest, LoopsRunOnLibTorchsThreads) {
  const int before = at::get_num_threads();
  at::set_num_threads(3);  // more than this machine's cores is fine: OpenMP starts them
  EXPECT_EQ(parallelLoopThreads(), 3) << "at::parallel_for ran serially: is the library built with OpenMP "
                                         "(tessera_parallel_loops)?";
  at::set_num_threads(1);
  EXPECT_EQ(parallelLoopThreads(), 1);
  at::set_num_threads(before);
}

}  // namespace
}  // namespace tessera::kernels
