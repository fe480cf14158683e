// Communicator: the project-owned seam every sharded component talks through.
//
// Collectives over the ranks of one group, on LibTorch tensors only (no c10d, gloo or
// NCCL type appears here). Backends: gloo (CPU tensors, c10d ProcessGroupGloo; see
// gloo_communicator.h), shm (CPU tensors, ranks on one host, shared memory; see
// shm_communicator.h) and nccl (CUDA tensors, NCCL called directly; see
// nccl_communicator.h). Contracts common to every call below:
//
// - Collective: every rank of the group calls the same operations in the same order,
//   with the same sizes and dtypes. A rank that does not shows up as a TimeoutError on
//   the others after CommOptions::timeout, never as a hang.
// - Buffers are contiguous, on the backend's device (CPU for gloo and shm, the communicator's
//   CUDA device for nccl), of any dtype (reductions: see ReduceOp). Shapes are free:
//   only element counts matter ("flat" = any shape, numel N x chunk).
// - Equal sizes: all-gather, reduce-scatter and gather move equal-size chunks; chunk r
//   belongs to rank r. Padding a ragged tensor to chunk size c = ceil(rows / N) is the
//   caller's job (ShardSpec does it); a chunk may be empty (numel 0) on every rank.
// - Async: each xAsync() returns a CommHandle at once; the result is defined only after
//   handle->wait(). Do not touch the buffers in between. The sync form is async + wait.
//   Wait every handle: gloo's composite operations (reduce-scatter's local reduction,
//   AVG's division) finish inside wait().
// - Streams (nccl): the operation is ordered after all work already queued on the
//   caller's current CUDA stream, and runs on the communicator's own stream (one for
//   all-gathers, one for reduce-scatters, one for everything else); wait() orders the
//   current stream after it. gloo: CPU, no streams.
// - Errors: bad arguments throw tessera::UsageError before anything is sent; a timeout
//   throws tessera::TimeoutError naming the operation, rank, world size and bytes; a
//   transport failure throws tessera::Error. After a timeout or transport failure the
//   communicator is broken (ranks disagree on what was sent): every later call throws.
// - Byte counters: stats() counts, per operation kind, the bytes this rank sends under
//   the bandwidth-optimal (ring) algorithm, in the tensor's dtype, whatever the
//   transport does on the wire:
//     all-gather       (N-1)/N x flat_out bytes   ((N-1) x local chunk)
//     reduce-scatter   (N-1)/N x flat_in bytes    ((N-1) x local chunk)
//     all-reduce       2(N-1)/N x tensor bytes
//     broadcast        tensor bytes on the root, 0 elsewhere
//     gather           local bytes on non-root ranks, 0 on the root
//     barrier          0 (counted in calls only)
//   A world of one sends nothing.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace tessera::diagnostics {
class FlightRing;
}

namespace tessera::distributed {

class Store;
struct CommHealth;  // shared by a communicator and its handles (communicator.cpp)

enum class ReduceOp {
  kSum,
  kAvg,  // sum / N; floating-point dtypes only
  kMax,
  kMin,
};
const char* reduceOpName(ReduceOp op);

enum class CommOp { kAllGather = 0, kReduceScatter, kAllReduce, kBroadcast, kGather, kBarrier };
constexpr int kNumCommOps = 6;
const char* commOpName(CommOp op);

struct CommOptions {
  // Every operation (and wait()) gives up after this long with TimeoutError.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  // Unique name of the group in the store; key namespace of its rendezvous.
  std::string name = "world";
  // A group of one rank answers every operation locally (a copy or nothing) without the
  // backend. Off: the backend runs it anyway (tests of the nccl backend on one GPU).
  bool singleRankShortcut = true;
  // Before every operation, the ranks all-gather what each is about to issue (op, dtype,
  // element count, root) and every rank throws Error naming the ranks that disagree, instead
  // of handing the backend mismatched calls (gloo aborts a process on them). One more small
  // collective per operation: for debugging (diagnostics.check_collectives; PyTorch's
  // TORCH_DISTRIBUTED_DEBUG=DETAIL).
  bool checkCollectives = false;
  // Operations the flight recorder remembers for a dump (diagnostics/flight_recorder.h;
  // diagnostics.flight_entries); 0: none recorded.
  int flightEntries = 2000;
  // shm: a peer whose process stays stopped (state T: SIGSTOP) this long fails the wait with
  // PeerLostError, as one that exited (fault.survive: fault.lost_after_s, default 1 s); 0: a stopped peer is
  // waited for.
  std::chrono::milliseconds lostWhenStoppedFor{0};
  // The abortCommunicators() generation this group belongs to (commAbortGeneration() when
  // its caller decided to build it, e.g. a replica group's membership change); building it
  // and its operations fail with PeerLostError once this process's generation moves past
  // it, so an abort that lands before or during the build is not missed. Unset: the
  // generation at its creation.
  std::optional<uint64_t> abortGeneration;
};

struct CommOpStats {
  int64_t calls = 0;
  int64_t bytes = 0;  // bytes this rank sent (model above)
};

struct CommStats {
  std::array<CommOpStats, kNumCommOps> ops{};
  // Time threads spent blocked in wait() on this group's operations (the host's view: an
  // nccl wait only orders streams and returns at once).
  int64_t waitNs = 0;

  const CommOpStats& operator[](CommOp op) const { return ops[static_cast<size_t>(op)]; }
  int64_t totalBytes() const;
  int64_t totalCalls() const;
  // "all_gather 3 calls 1.5 KiB, reduce_scatter ..." (kinds with calls only).
  std::string toString() const;
};

// Collectives this thread issues while a scope lives time out after `timeout` instead of
// their communicator's CommOptions::timeout (the trainer's checkpoint saves, loads and
// exports: diagnostics.checkpoint_timeout_s). Nested scopes: the innermost.
class TimeoutScope {
 public:
  explicit TimeoutScope(std::chrono::milliseconds timeout);
  ~TimeoutScope();
  TimeoutScope(const TimeoutScope&) = delete;
  TimeoutScope& operator=(const TimeoutScope&) = delete;

 private:
  std::chrono::milliseconds previous_;
};

// Wait handle of one asynchronous operation.
class CommHandle {
 public:
  virtual ~CommHandle() = default;
  // Blocks until the operation is complete (gloo) or ordered before later work on the
  // caller's current stream (nccl), then finishes any local step (the sum of a gloo
  // reduce-scatter, the division of AVG). Throws TimeoutError after CommOptions::timeout
  // counted from this call. Idempotent: later calls return (or rethrow) at once.
  virtual void wait() = 0;
  // Non-blocking: true once wait() would not block on communication. Gloo's point-to-point
  // operations (large all-gathers and reduce-scatters, the split all-reduce) answer false
  // until waited: LibTorch 1.13's send/recv works only learn they are done in their wait().
  virtual bool isCompleted() = 0;
};

class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int worldSize() const { return world_; }
  virtual std::string backendName() const = 0;
  const CommOptions& options() const { return options_; }
  // "gloo group 'world' rank 1 of 4" for messages.
  std::string describe() const;
  // The group's ranks as ranks of the world it was split from (member i is this group's
  // rank i): 0..N-1 for a world, the parent's members of `ranks` for a split.
  const std::vector<int>& members() const { return members_; }
  // Where this backend's buffers live: the CPU (gloo), or its CUDA device (nccl).
  virtual c10::Device tensorDevice() const { return c10::Device(c10::kCPU); }

  // The group's host twin, for the CPU-side traffic of checkpoints, exports and agreement:
  // this communicator itself when it takes CPU tensors (gloo), else the gloo communicator
  // over the same ranks attached by setHost() (Runtime attaches the world's; split()
  // splits both, so every subgroup has its twin). Throws UsageError naming the group when
  // an nccl group has none.
  std::shared_ptr<Communicator> host();
  // `host` must be a CPU communicator of this group's rank and size.
  void setHost(std::shared_ptr<Communicator> host);

  // All-gather. flat_out.numel() == N * local_in.numel(), same dtype; rank r's local_in
  // lands in elements [r*k, (r+1)*k) of flat_out (k = local_in.numel()). In place: local_in
  // may be the view of flat_out's own chunk r. local_in is not modified.
  std::shared_ptr<CommHandle> allGatherIntoAsync(const at::Tensor& flat_out, const at::Tensor& local_in);
  void allGatherInto(const at::Tensor& flat_out, const at::Tensor& local_in);

  // Reduce-scatter. flat_in.numel() == N * local_out.numel(), same dtype; local_out on rank
  // r receives op over ranks of flat_in's chunk r. op: any ReduceOp (kAvg floating only).
  // In place: local_out may be the view of flat_in's own chunk r. flat_in is otherwise not
  // modified. gloo: moves (N-1)/N of flat_in per rank (all-to-all, then a local reduction
  // in rank order, so results are deterministic run to run).
  std::shared_ptr<CommHandle> reduceScatterAsync(const at::Tensor& local_out, const at::Tensor& flat_in,
                                                 ReduceOp op = ReduceOp::kSum);
  void reduceScatter(const at::Tensor& local_out, const at::Tensor& flat_in, ReduceOp op = ReduceOp::kSum);

  // All-reduce, in place: t becomes op over ranks of t. Same numel and dtype everywhere.
  std::shared_ptr<CommHandle> allReduceAsync(const at::Tensor& t, ReduceOp op = ReduceOp::kSum);
  void allReduce(const at::Tensor& t, ReduceOp op = ReduceOp::kSum);

  // Broadcast, in place: t on every rank becomes the root's t. 0 <= root < N.
  std::shared_ptr<CommHandle> broadcastAsync(const at::Tensor& t, int root);
  void broadcast(const at::Tensor& t, int root);

  // Gather to one rank (exports go one tensor at a time to rank 0, so no rank ever holds
  // more than one full tensor). On root: out.numel() == N * local_in.numel(), rank r's
  // local_in lands in chunk r (root's own chunk may alias local_in). Elsewhere `out` is
  // ignored and may be undefined.
  std::shared_ptr<CommHandle> gatherToRootAsync(const at::Tensor& out, const at::Tensor& local_in, int root);
  void gatherToRoot(const at::Tensor& out, const at::Tensor& local_in, int root);

  // Returns once every rank has entered the barrier.
  std::shared_ptr<CommHandle> barrierAsync();
  void barrier();

  // A new communicator over a subset of this group's ranks (DeviceMesh's shard and
  // replicate groups). `ranks` are ranks of this group, without duplicates; the new
  // group's rank i is ranks[i]. Called by every member of the subset (and only them; the
  // other ranks are not involved), in the same order as their other split() calls with
  // the same subset. Blocks until all members arrive (TimeoutError naming the missing).
  std::shared_ptr<Communicator> split(const std::vector<int>& ranks);

  CommStats stats() const;
  void resetStats();

 protected:
  Communicator(int rank, int world, CommOptions options);

  // Backend hooks; arguments are already validated and counted.
  virtual std::shared_ptr<CommHandle> doAllGatherInto(const at::Tensor& flat_out, const at::Tensor& local_in) = 0;
  virtual std::shared_ptr<CommHandle> doReduceScatter(const at::Tensor& local_out, const at::Tensor& flat_in,
                                                      ReduceOp op) = 0;
  virtual std::shared_ptr<CommHandle> doAllReduce(const at::Tensor& t, ReduceOp op) = 0;
  virtual std::shared_ptr<CommHandle> doBroadcast(const at::Tensor& t, int root) = 0;
  virtual std::shared_ptr<CommHandle> doGatherToRoot(const at::Tensor& out, const at::Tensor& local_in, int root) = 0;
  virtual std::shared_ptr<CommHandle> doBarrier() = 0;
  // `name` names the subset (parent name + member list); `subRank` is this rank's index
  // in `ranks`.
  virtual std::shared_ptr<Communicator> doSplit(const std::vector<int>& ranks, int subRank,
                                                const std::string& name) = 0;

  // Shared with the backend's handles, which mark it broken (markCommBroken).
  const std::shared_ptr<CommHealth>& health() const { return health_; }
  // For a backend's waits while it is built (the store's rendezvous): PeerLostError naming
  // `doing` when abortCommunicators() was called since this group's generation.
  void throwIfAborted(const std::string& doing) const;
  // The timeout of an operation issued now on this thread: a TimeoutScope's, else
  // CommOptions::timeout. Backends give it to each operation they start.
  std::chrono::milliseconds opTimeout() const;
  // "allReduce(sum) of 1.0 KiB (float[256]) on gloo group 'world' rank 1 of 4".
  std::string describeOp(const char* method, const at::Tensor& t, const char* detail = nullptr) const;

 private:
  // True when operations are answered without the backend (one rank, shortcut on).
  bool local() const { return world_ == 1 && options_.singleRankShortcut; }
  void ensureUsable(const char* method) const;
  // Counts the operation in stats(), records it in the flight recorder (diagnostics/) and
  // returns its handle, which adds the time its wait blocks to stats().waitNs (and puts it
  // on the timeline in a profile window). `t`: the tensor whose dtype and element count
  // every rank must agree on (undefined for a barrier).
  std::shared_ptr<CommHandle> account(CommOp op, int64_t bytes, const at::Tensor& t, std::shared_ptr<CommHandle> handle);
  // CommOptions::checkCollectives: agrees on what every rank issues next; throws on a mismatch.
  void checkAgreement(CommOp op, const at::Tensor& t, int root);
  const std::shared_ptr<diagnostics::FlightRing>& flightRing();

  int rank_;
  int world_;
  CommOptions options_;
  std::shared_ptr<Communicator> host_;  // setHost(); null: this one (or none, for nccl)
  std::array<std::atomic<int64_t>, kNumCommOps> calls_{};
  std::array<std::atomic<int64_t>, kNumCommOps> bytes_{};
  std::shared_ptr<std::atomic<int64_t>> waitNs_ = std::make_shared<std::atomic<int64_t>>(0);  // shared with handles
  std::shared_ptr<CommHealth> health_;
  std::vector<int> members_;
  int64_t checked_ = 0;  // operations checked by checkAgreement (its #n)
  std::once_flag flightOnce_;
  std::shared_ptr<diagnostics::FlightRing> flight_;  // null when the recorder is off
};

// Creates a communicator over `store` ("gloo", "shm" or "nccl"); every rank of the group calls it
// with the same backend and options.name. Throws ConfigError for an unknown backend and
// for "nccl" in a build without CUDA (TESSERA_WITH_CUDA=OFF).
std::shared_ptr<Communicator> makeCommunicator(const std::string& backend, std::shared_ptr<Store> store, int rank,
                                               int world, const CommOptions& options = {});

// Backends' handles call this when an operation timed out or failed: every later call on
// the communicator owning `health` then throws.
void markCommBroken(const std::shared_ptr<CommHealth>& health, const std::string& why);

// Process-wide, for fault.survive: every wait of a shm or gloo communicator created before
// this call, in progress or to come, throws PeerLostError within 50 ms, so that no thread of
// this process stays in a collective whose group is being replaced (a replica group lost;
// the peers learn it from this rank's giving up, or from their own call). Communicators
// created afterwards are not affected. A gloo operation is abandoned, not ended: its
// c10d group is kept (never destroyed, which would wait for it) and its work ends at its
// own timeout. nccl's operations are not interrupted.
void abortCommunicators();
// How many times abortCommunicators() was called in this process.
uint64_t commAbortGeneration();
// Whether abortCommunicators() was called since the communicator owning `health` was made.
bool commAborted(const std::shared_ptr<CommHealth>& health);

// True when this build has the nccl backend.
bool ncclAvailable();
// All-reduces a CPU tensor in place over `comm`, whatever its backend: through the
// backend's device (a copy there and back) when that is not the CPU.
void allReduceHostTensor(Communicator& comm, const at::Tensor& t, ReduceOp op);

// The store key namespace of a group called `name`, unique per creation: the k-th group
// named `name` that a rank creates gets "tessera/comm/<name>#k" on every rank (one store
// add), so re-creating a group of the same name never reads the old group's keys.
std::string groupKeyPrefix(Store& store, const std::string& name, int rank);

// Bytes of a tensor's elements.
int64_t tensorBytes(const at::Tensor& t);

// The lowest rank of `comm`'s group on which `failed` is true, or -1 when none. An
// all-reduce: every rank calls it (comm may be null or of one rank: this rank's answer).
int lowestFailingRank(Communicator* comm, bool failed);

// Every rank calls it with its own error ("" when it succeeded at `what`); when any rank
// failed, every rank throws Error: the failing one with its message, the others naming
// the lowest failing rank. Ranks then leave together instead of waiting for one that
// left in their next collective.
void throwIfAnyRankFailed(Communicator* comm, const std::string& localError, const std::string& what);
// Its throw, for callers that ran the agreement themselves (e.g. an all-reduce
// overlapped with other work): failedRank is the lowest failing rank or -1, `rank` this
// rank, localError this rank's error ("" when it succeeded).
void throwIfFailed(int failedRank, int rank, const std::string& localError, const std::string& what);

// Runs `fn` on this rank, then agrees with the others as above: where fn threw, its
// exception is rethrown as it was; where it succeeded but threw on another rank, Error
// names `what` and the lowest failing rank. For work each rank does on its own part
// (reading its rows of a file) whose failure all ranks must act on.
void runOnEveryRank(Communicator* comm, const std::string& what, const std::function<void()>& fn);

}  // namespace tessera::distributed
