// tessera-run: starts the local ranks of PROGRAM with torchrun's environment contract.
//   tessera-run [--nproc-per-node N] [--nnodes M] [--node-rank R] [--master-addr A]
//               [--master-port P] [--max-restarts K] [--log-dir D] [--tee] [--standalone]
//               [--grace-period-s S] [--run-id ID] PROGRAM [ARGS...]
// Everything from PROGRAM on is passed to the ranks untouched. Exit status: 0 all ranks
// exited 0; a failed rank's own status (2: it refused its config; 1: killed by a signal);
// 2 bad arguments; 128+N stopped by signal N.
// Behaviour (output, teardown, restarts) is documented in distributed/launcher.h.
#include "common/app_main.h"
#include "common/command_line.h"
#include "common/errors.h"
#include "common/logging.h"
#include "distributed/launcher.h"

int main(int argc, char** argv) {
  return tessera::runMain("tessera-run", [&]() -> int {
    tessera::log::LogOptions logOptions;
    logOptions.rank = -1;  // the launcher is no rank: its lines carry no "[rank N]"
    tessera::log::init(logOptions);

    tessera::distributed::LaunchOptions o;
    CLI::App app{"tessera-run [OPTIONS] PROGRAM [ARGS...]: start the local ranks of PROGRAM with torchrun's "
                 "environment contract"};
    app.prefix_command();  // PROGRAM and everything after it (even --options) go to the ranks
    app.add_option("--nproc-per-node,--nproc_per_node", o.nprocPerNode, "Ranks to start on this node")
        ->capture_default_str();
    app.add_option("--nnodes", o.nnodes, "Number of nodes (one tessera-run per node)")->capture_default_str();
    app.add_option("--node-rank,--node_rank", o.nodeRank, "This node's index, 0..nnodes-1")->capture_default_str();
    auto* addr = app.add_option("--master-addr,--master_addr", o.masterAddr,
                                "Host of global rank 0, which hosts the TCPStore")
                     ->capture_default_str();
    auto* port = app.add_option("--master-port,--master_port", o.masterPort, "TCPStore port on --master-addr")
                     ->capture_default_str();
    app.add_option("--max-restarts,--max_restarts", o.maxRestarts,
                   "Restart all ranks up to K times after a failure")
        ->capture_default_str();
    app.add_option("--log-dir,--log_dir", o.logDir,
                   "Write each rank's output to DIR/rank_N.log (console only with --tee)");
    app.add_flag("--tee", o.tee, "With --log-dir: also print the ranks' output on the console");
    app.add_flag("--standalone", o.standalone, "Single node: use a free port on 127.0.0.1");
    app.add_option("--grace-period-s", o.gracePeriodS, "Seconds between SIGTERM and SIGKILL when stopping ranks")
        ->capture_default_str();
    app.add_option("--run-id,--rdzv-id,--rdzv_id", o.runId, "TORCHELASTIC_RUN_ID given to the ranks")
        ->capture_default_str();
    app.footer(
        "Each rank's output line is printed as \"[rank N]: line\". Exit status: 0 all ranks exited 0; "
        "a failed rank's own exit status (2 when it refused its configuration: not restarted; 1 when killed by a "
        "signal); 2 bad arguments; 128+N stopped by signal N (forwarded to the ranks; a second one kills them).");
    if (const auto done = tessera::parseCommandLine(app, argc, argv)) return *done;
    if (o.standalone && (addr->count() > 0 || port->count() > 0)) {
      throw tessera::UsageError("--standalone picks its own address and port; drop --master-addr/--master-port");
    }
    o.command = app.remaining();
    if (!o.command.empty() && o.command[0] == "--") o.command.erase(o.command.begin());  // "tessera-run -- PROGRAM"
    return tessera::distributed::launch(std::move(o));
  });
}
