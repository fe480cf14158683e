// Asynchronous signals (SIGINT, SIGTERM, SIGUSR1, ...) delivered on one thread of their own,
// never on a thread that computes.
//
// Why: oneDNN's JIT GEMM kernels (Debian's libdnnl 2.7, which kernels/cpu_matmul.cpp and
// LibTorch's mkldnn operators call) point the stack pointer at a heap workspace while they
// run. A signal handler that runs on such a thread writes its frame over the heap, and glibc
// later aborts in a free() with "corrupted size vs. prev_size" (oneDNN issue #4845, fixed
// upstream by PR #4855; Debian's build has the bug). Ctrl-C, a preemption's SIGTERM or a
// SIGUSR1 look at a running rank then killed a healthy rank now and then.
//
// Handlers are still installed with sigaction() where they were; only the thread they run on
// changes. Programs that compute call routeSignalsToOwnThread() first in main(), before any
// other thread starts: a thread inherits the blocked set of the thread that creates it.
#pragma once

#include <csignal>

namespace tessera {

// The asynchronous signals a Tessera program handles or forwards: SIGHUP, SIGINT, SIGQUIT,
// SIGTERM, SIGUSR1, SIGUSR2, SIGALRM, SIGCHLD. Synchronous ones (SIGSEGV, SIGPIPE, ...) go to
// the thread that caused them and cannot be routed.
sigset_t routedSignals();

// Blocks routedSignals() in the calling thread (so in every thread it creates from now on)
// and starts a detached thread with them unblocked that only waits for them: every handler of
// these signals runs there, and a signal with its default action still ends the process.
// Idempotent. Throws tessera::Error when the thread cannot be started (the mask is restored).
void routeSignalsToOwnThread();

// Whether the calling thread is the signal thread (tests).
bool onSignalThread();

}  // namespace tessera
