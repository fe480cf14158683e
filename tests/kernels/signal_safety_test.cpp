// Signals during oneDNN's products: with routeSignalsToOwnThread() (common/signal_thread.h)
// every handler runs on the signal thread, none on a thread in a product, and a process that
// takes thousands of SIGUSR1 while it multiplies survives. Without the routing, oneDNN's JIT
// GEMM (its stack pointer on a heap workspace) had its heap overwritten by the handler's
// frame: glibc aborted with "corrupted size vs. prev_size" (oneDNN issue #4845).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <thread>

#include "common/signal_thread.h"
#include "kernels/cpu_matmul.h"

namespace {

std::atomic<int64_t> g_handled{0};
std::atomic<int64_t> g_handledOffSignalThread{0};

extern "C" void countSignal(int) {
  g_handled.fetch_add(1);
  if (!tessera::onSignalThread()) g_handledOffSignalThread.fetch_add(1);
}

// In a child process (a heap overwritten there must not take the test binary down): routes
// the signals, counts SIGUSR1s sent by a thread of its own every 20 us while the main thread
// runs the models' products (the Linear layers' forward and backward, attention's batched
// products) through oneDNN for `seconds`. Exit status 0: every signal ran on the signal
// thread; 3: some ran elsewhere; 4: none arrived; 5: a product threw.
int productsUnderSignals(double seconds) {
  const pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    tessera::routeSignalsToOwnThread();
    at::set_num_threads(1);  // the parent's thread pool is not the child's
    struct sigaction action {};
    action.sa_handler = countSignal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    ::sigaction(SIGUSR1, &action, nullptr);
    std::atomic<bool> done{false};
    std::thread sender([&] {
      while (!done.load()) {
        ::kill(::getpid(), SIGUSR1);
        ::usleep(20);
      }
    });
    int failure = 0;
    try {
      at::manual_seed(1);
      const at::Tensor x = at::randn({64, 96}).requires_grad_(true), w = at::randn({136, 96}).requires_grad_(true);
      const at::Tensor b = at::randn({136}).requires_grad_(true);
      const at::Tensor q = at::randn({8, 33, 40}).requires_grad_(true), k = at::randn({8, 40, 33}).requires_grad_(true);
      const auto start = std::chrono::steady_clock::now();
      while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds) {
        const at::Tensor y = tessera::kernels::linear(x, w, b);
        const at::Tensor s = tessera::kernels::batchedMatmul(q, k);
        (y.square().sum() + s.square().sum()).backward();
        tessera::kernels::measureCpuSgemmFlops(tessera::kernels::CpuMatmulPath::kOnednn, 256, 0.0);
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "products failed: %s\n", e.what());
      failure = 5;
    }
    done = true;
    sender.join();
    ::_exit(failure != 0 ? failure : g_handled.load() == 0 ? 4 : g_handledOffSignalThread.load() != 0 ? 3 : 0);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

TEST(SignalSafetyTest, HandlersRunOnTheSignalThreadWhileOnednnMultiplies) {
  if (!tessera::kernels::haveOnednn()) GTEST_SKIP() << "built without libdnnl-dev";
  const int status = productsUnderSignals(2.0);
  ASSERT_FALSE(WIFSIGNALED(status)) << "the child was killed by " << strsignal(WTERMSIG(status));
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_NE(WEXITSTATUS(status), 4) << "no SIGUSR1 reached a handler";
  EXPECT_NE(WEXITSTATUS(status), 3) << "a handler ran on a thread other than the signal thread";
  EXPECT_NE(WEXITSTATUS(status), 5) << "a product threw (its message is above)";
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// The signal thread leaves a signal's default action alone: a SIGTERM with no handler still
// ends the process, as it would without the routing.
TEST(SignalSafetyTest, DefaultActionsStillEndTheProcess) {
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    tessera::routeSignalsToOwnThread();
    ::kill(::getpid(), SIGTERM);
    ::sleep(30);
    ::_exit(0);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  ASSERT_TRUE(WIFSIGNALED(status)) << status;
  EXPECT_EQ(WTERMSIG(status), SIGTERM);
}

}  // namespace
