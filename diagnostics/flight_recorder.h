// The flight recorder: every communicator of this process keeps its last N collectives in
// a ring (sequence number, op, dtype, element count, the caller's tag, the thread, issue /
// wait / end times, state), and the process writes them, with what each thread is doing
// now (common/trace.h's open spans and the step), to JSON when something goes wrong: a
// collective times out, an uncaught error ends the program (runMain's failure hook),
// SIGTERM, and SIGUSR1 (a live look; the run goes on). flight_verdict.h reads the dumps of
// every rank and says who is behind, who disagrees, or who died.
//
// Cost: one uncontended lock and a few string copies per collective (bench/
// flight_recorder_bench.cpp measures it against the step).
//
// Dump format (one file per process, "tessera.flight/1"):
//   {"format": "tessera.flight/1", "rank": R, "world_size": W, "reason": "...",
//    "pid": P, "time_unix_s": T, "step": S,
//    "threads": [{"thread": "main", "doing": ["step 5", "forward (micro-batch)"], "for_s": 1.2,
//                 "failed_in": [spans an exception unwound, when one did]}],
//    "groups": [{"group": "world", "backend": "gloo", "rank": r, "members": [global ranks],
//                "next_seq": n, "entries": [{"seq": k, "op": "all_reduce", "dtype": "float",
//                  "numel": 256, "bytes": 1024, "tag": "gradient norm", "thread": "main",
//                  "step": S, "state": "issued|waiting|completed|failed", "error": "...",
//                  "issued_s_ago": x, "wait_s_ago": y, "ended_s_ago": z}]}]}
// Times are "seconds before the dump" so that dumps of different machines compare without
// synchronised clocks; "time_unix_s" places the dump itself.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace tessera::diagnostics {

// One communicator's ring of its last collectives. Thread-safe.
class FlightRing {
 public:
  // `members`: the group's ranks as global ranks (member i is the group's rank i).
  FlightRing(std::string group, std::string backend, int rank, std::vector<int> members, int capacity);

  // Records a collective this rank issued; returns its sequence number (0, 1, ... per ring).
  int64_t issue(const char* op, const char* dtype, int64_t numel, int64_t bytes, const std::string& tag);
  // This rank started waiting for collective `seq`.
  void waiting(int64_t seq);
  // Collective `seq` ended: completed (error empty) or failed with `error`.
  void finish(int64_t seq, const std::string& error);

  // This ring as the dump's JSON object (see above), relative to `nowNs` (trace::nowNs()).
  std::string toJson(int64_t nowNs) const;

  FlightRing(const FlightRing&) = delete;
  FlightRing& operator=(const FlightRing&) = delete;

 private:
  enum class State { kIssued, kWaiting, kCompleted, kFailed };
  struct Record {
    int64_t seq = -1;
    const char* op = "";
    const char* dtype = "";
    int64_t numel = 0, bytes = 0, step = 0;
    std::string tag, thread, error;
    int64_t issuedNs = 0, waitNs = 0, endNs = 0;  // 0: not yet
    State state = State::kIssued;
  };
  Record* find(int64_t seq);  // nullptr when it has left the ring; call with mutex_ held

  const std::string group_, backend_;
  const int rank_;
  const std::vector<int> members_;
  mutable std::mutex mutex_;
  std::vector<Record> records_;  // records_[seq % capacity]
  int64_t next_ = 0;
};

// The process-wide recorder.
namespace flight {

// A ring of `capacity` entries for a new communicator (its CommOptions::flightEntries,
// diagnostics.flight_entries), registered for dumps while it lives; nullptr for a capacity
// of 0 (recording off).
std::shared_ptr<FlightRing> openRing(const std::string& group, const std::string& backend, int rank,
                                     const std::vector<int>& members, int capacity);

// Where dumps go: every path in `files` is (re)written on each dump. `rank` and
// `worldSize` label the dump. Until called, dumps are not written.
void setDumpFiles(std::vector<std::string> files, int rank, int worldSize);
// A count every later dump carries under "counters" (fault.survive's membership changes,
// which tessera-run reports at the end of a run).
void addToCounter(const std::string& name, int64_t delta);
// fault.survive's: the replica groups lost that the run went on without, and those that
// rejoined it.
inline constexpr const char* kGroupsLostCounter = "fault_survive_groups_lost";
inline constexpr const char* kGroupsRejoinedCounter = "fault_survive_groups_rejoined";
// The files set above: <run.dir>/flight/rank_<r>.json, plus $TESSERA_FLIGHT_DIR/rank_<r>.json
// when the launcher set that variable (tessera-run reads them there for its verdict).
std::vector<std::string> dumpFilesFor(const std::string& runDir, int rank);

// The dump's JSON text now.
std::string dumpJson(const std::string& reason);
// Writes the dump to every file set by setDumpFiles (atomically: a temporary file, then a
// rename). Never throws; returns the files written.
std::vector<std::string> dump(const std::string& reason) noexcept;

// Dumps on SIGUSR1 (and goes on) and on SIGTERM (then chains to the SIGTERM handler that
// was installed before, or later through onTerminateSignal), from a watcher thread (a
// signal handler may not lock or allocate). Also registers the dump as runMain's failure
// hook. Idempotent.
void installSignalHandlers();
// For a SIGTERM handler installed after installSignalHandlers() (the trainer's stop
// handler): asks the watcher thread for a dump. Async-signal-safe.
void onTerminateSignal() noexcept;

}  // namespace flight
}  // namespace tessera::diagnostics
