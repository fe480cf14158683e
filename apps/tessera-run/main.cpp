// tessera-run: starts the local ranks of PROGRAM with torchrun's environment contract.
//   tessera-run [--nproc-per-node N] [--nnodes M] [--node-rank R] [--master-addr A]
//               [--master-port P] [--max-restarts K] [--log-dir D] [--tee] [--standalone]
//               [--grace-period-s S] [--run-id ID] PROGRAM [ARGS...]
//   elastic:    tessera-run --nnodes MIN:MAX --rdzv-endpoint HOST:PORT --rdzv-id ID
//               [--rdzv-backend c10d] [--rdzv-timeout S] [--rdzv-conf last_call_timeout=S]
//               [--max-restarts K] ... PROGRAM [ARGS...]
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
    std::string nnodes = "1";
    app.add_option("--nnodes", nnodes,
                   "Number of nodes (one tessera-run per node), or MIN:MAX for an elastic run (with --rdzv-endpoint)")
        ->capture_default_str();
    auto* nodeRank = app.add_option("--node-rank,--node_rank", o.nodeRank, "This node's index, 0..nnodes-1")
                         ->capture_default_str();
    app.add_option("--rdzv-endpoint,--rdzv_endpoint", o.rdzvEndpoint,
                   "HOST:PORT where the launchers of an elastic run meet (the one that can bind it hosts it)");
    app.add_option("--rdzv-backend,--rdzv_backend", o.rdzvBackend, "c10d (the only one)")->capture_default_str();
    app.add_option("--rdzv-timeout,--rdzv_timeout", o.rdzvTimeoutS,
                   "Seconds a rendezvous round waits for MIN nodes")
        ->capture_default_str();
    std::string rdzvConf;
    app.add_option("--rdzv-conf,--rdzv_conf", rdzvConf,
                   "join_timeout=S,last_call_timeout=S (a round with MIN nodes waits S for more; default 30)");
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
    tessera::distributed::parseNnodes(nnodes, o);
    if (!rdzvConf.empty()) tessera::distributed::parseRdzvConf(rdzvConf, o);
    if (o.minNodes != o.maxNodes && o.rdzvEndpoint.empty()) {
      // As torchrun: an elastic run without an endpoint meets on this machine.
      o.rdzvEndpoint = "127.0.0.1:29400";
      TLOG_INFO("tessera-run: --nnodes " << nnodes << " without --rdzv-endpoint: the launchers meet at "
                << o.rdzvEndpoint << " (this machine; give --rdzv-endpoint HOST:PORT for several)");
    }
    if (!o.rdzvEndpoint.empty() && nodeRank->count() > 0) {
      throw tessera::UsageError("--node-rank: an elastic run (--rdzv-endpoint) assigns node ranks at the rendezvous");
    }
    if (o.standalone && (addr->count() > 0 || port->count() > 0)) {
      throw tessera::UsageError("--standalone picks its own address and port; drop --master-addr/--master-port");
    }
    o.command = app.remaining();
    if (!o.command.empty() && o.command[0] == "--") o.command.erase(o.command.begin());  // "tessera-run -- PROGRAM"
    return tessera::distributed::launch(std::move(o));
  });
}
