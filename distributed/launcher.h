// The core of tessera-run, a torchrun-like launcher: starts the local ranks of any
// program with torchrun's environment contract, prefixes and logs their output, and
// tears the whole group down (SIGTERM, grace period, SIGKILL, whole process groups)
// when one rank fails, restarting all ranks up to --max-restarts times.
//
// Pure POSIX + C++17 (no LibTorch), so the launcher builds and starts fast. Ranks meet at
// the c10d TCPStore that global rank 0 hosts at MASTER_ADDR:MASTER_PORT. Static: one
// launcher per node (--nnodes M --node-rank R) forms one world, like torchrun with a
// static rendezvous. Elastic (--rdzv-endpoint HOST:PORT, --nnodes MIN:MAX): the launchers
// meet at the endpoint (elastic_rendezvous.h), which assigns node ranks and the master for
// each round; after a failure the launchers that remain rendezvous again (a lost node
// does not come) and restart their ranks on the world that is left, and a node that joins
// later is admitted at a restart the others make for it. When no other node's ranks failed
// with this node's (their launchers sent no flight dumps within the failure report's wait)
// and nobody opened a new round, the others went on without this node (tessera-train's
// fault.survive): this launcher restarts its ranks into the running round instead
// (TESSERA_RESTARTED_INTO_LIVE_ROUND=1, common/app_main.h), where such a run takes them back;
// ranks that find none exit 76 and the launcher joins the next round (no failure counted).
//
// Output (console and --log-dir):
//   - Every line a rank writes to stdout (stderr) goes to the launcher's stdout (stderr)
//     as "[rank G]: line", G the global rank (torchrun --tee's "[rank]:" style). A last
//     line without a newline is printed with one at the rank's exit.
//   - --log-dir D: each rank's raw output, stdout and stderr interleaved as they arrive and
//     without prefixes, goes to D/rank_G.log (truncated once at start, appended to by
//     restarts, each restart preceded by a marker line). The console then shows rank
//     output only with --tee. The error files are D/rank_G.error.json.
//   - The launcher's own lines ("tessera-run: ...") go to stderr through common/logging.
//
// Exit status of launch(): 0 all ranks exited 0; a failed rank's own exit status (after
// the restarts; 1 when it was killed by a signal), so 2 means a rank refused its
// configuration or arguments, which is never restarted; 128+N the launcher got signal N
// (SIGINT, SIGTERM, SIGHUP, SIGQUIT), which it forwarded to every rank's process group (a
// second one kills them at once). Bad options throw tessera::UsageError (tessera-run exits 2).
// A run that survived lost replica groups (fault.survive) still exits 0: its last line says
// how many it went on without and took back, from the counters in the ranks' flight dumps.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace tessera::distributed {

struct LaunchOptions {
  int nprocPerNode = 1;
  int nnodes = 1;
  int nodeRank = 0;
  std::string masterAddr = "127.0.0.1";
  int masterPort = 29500;
  int maxRestarts = 0;
  std::string logDir;         // "" = no per-rank log files, output on the console
  bool tee = false;           // with logDir: also print rank output on the console
  bool standalone = false;    // single node: pick a free port on 127.0.0.1
  double gracePeriodS = 5.0;  // SIGTERM -> SIGKILL delay when stopping ranks
  std::string runId = "none"; // TORCHELASTIC_RUN_ID, and the elastic rendezvous's run id
  std::vector<std::string> command;  // PROGRAM [ARGS...], PROGRAM looked up in PATH
  // Elastic (rdzvEndpoint set): between minNodes and maxNodes nodes (nnodes is the count of
  // the current round); node ranks and the master come from the rendezvous.
  std::string rdzvEndpoint;   // HOST:PORT
  std::string rdzvBackend = "c10d";
  int minNodes = 1;
  int maxNodes = 1;
  double rdzvTimeoutS = 900;  // MIN nodes must join a round within this
  double rdzvLastCallS = 30;  // a round with MIN nodes waits this long for more
  bool elastic() const { return !rdzvEndpoint.empty(); }
};

// "N" or "MIN:MAX" (--nnodes) into options.minNodes/maxNodes (and nnodes = MIN); throws
// UsageError naming the option.
void parseNnodes(const std::string& text, LaunchOptions& options);
// torchrun's --rdzv-conf "key=value,...": join_timeout and last_call_timeout (seconds).
void parseRdzvConf(const std::string& text, LaunchOptions& options);

// Checks the options (ranges, combinations, PROGRAM present and found in PATH);
// throws tessera::UsageError naming the option that is wrong.
void validateLaunchOptions(const LaunchOptions& options);

// The environment variables the launcher sets for one local rank (on top of its own
// environment). OMP_NUM_THREADS=1 is included when more than one rank runs per node and
// `inheritedOmpThreads` (the launcher's OMP_NUM_THREADS) is unset or empty.
std::map<std::string, std::string> rankEnvironment(const LaunchOptions& options, int localRank, int restartCount,
                                                   const std::string& errorFile,
                                                   const char* inheritedOmpThreads = nullptr);

// The message a rank left in its TORCHELASTIC_ERROR_FILE: torchelastic's JSON
// {"message": {"message": "...", "extraInfo": {...}}} or {"message": "..."}, or else the
// file's text. std::nullopt when the file is missing or empty.
std::optional<std::string> readErrorFile(const std::string& path);

// The ranks' error messages (global rank -> message) as the launcher prints them: one line
// per distinct message, "rank 3 error: ..." or "ranks 0-2, 5 error: ...", the message of
// `firstRank` (the rank that failed first) before the others.
std::vector<std::string> foldRankErrors(const std::map<int, std::string>& messages, int firstRank);

// "SIGTERM", "SIGKILL", ... ("signal 42" for others).
std::string signalName(int signal);

// A TCP port that was free on `host` a moment ago (binds port 0, reads it, closes).
int pickFreePort(const std::string& host = "127.0.0.1");

// Runs the job described by `options` (validated first) and returns the launcher's exit
// status (see above). It installs signal handlers and reaps every child of this process,
// so call it once, from the launcher's main().
int launch(LaunchOptions options);

}  // namespace tessera::distributed
