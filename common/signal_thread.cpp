// The signal thread (see signal_thread.h).
#include "common/signal_thread.h"

#include <pthread.h>
#include <unistd.h>

#include <mutex>
#include <thread>

#include "common/errors.h"
#include "common/file_open.h"

namespace tessera {
namespace {

std::once_flag g_started;
thread_local bool t_isSignalThread = false;

}  // namespace

sigset_t routedSignals() {
  sigset_t set;
  sigemptyset(&set);
  for (const int sig : {SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2, SIGALRM, SIGCHLD}) sigaddset(&set, sig);
  return set;
}

void routeSignalsToOwnThread() {
  std::call_once(g_started, [] {
    const sigset_t set = routedSignals();
    sigset_t previous;
    if (const int rc = ::pthread_sigmask(SIG_BLOCK, &set, &previous); rc != 0) {
      throw Error(strCat("routeSignalsToOwnThread: pthread_sigmask failed: ", errnoText(rc)));
    }
    try {
      std::thread([set] {
        t_isSignalThread = true;
        ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
        // Handlers run here, between pauses; nothing else does.
        while (true) ::pause();
      }).detach();
    } catch (const std::exception& e) {
      ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
      throw Error(strCat("routeSignalsToOwnThread: cannot start the signal thread: ", e.what()));
    }
  });
}

bool onSignalThread() { return t_isSignalThread; }

}  // namespace tessera
