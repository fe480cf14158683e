// Communicator over c10d ProcessGroupGloo, with the operations LibTorch 1.13's Gloo lacks
// built from the ones it has (see gloo_communicator.h).
#include "distributed/gloo_communicator.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <mutex>

#include "common/errors.h"
#include "common/logging.h"
#include "distributed/rendezvous.h"
#include "distributed/store_impl.h"

namespace tessera::distributed {
namespace {

// allGatherInto: outputs up to this size go through all-to-all (see doAllGatherInto).
constexpr int64_t kAllToAllGatherBytes = int64_t{4} << 20;
// Reduce-scatters of more than this go point to point (PairwiseReduceScatter): the
// all-to-all's receive buffer, as large as the input, stays below it.
constexpr int64_t kAllToAllReduceBytes = int64_t{4} << 20;

bool looksLikeTimeout(const std::string& message) {
  return message.find("imed out") != std::string::npos || message.find("imeout") != std::string::npos;
}

// The tensor's elements as a flat byte tensor sharing its memory (t is contiguous).
at::Tensor bytesOf(const at::Tensor& t) { return t.reshape({-1}).view(at::kByte); }

// Chunk views [r*chunk, (r+1)*chunk) of a flat tensor, one per rank.
std::vector<at::Tensor> chunksOf(const at::Tensor& flat, int world, int64_t chunk) {
  std::vector<at::Tensor> views;
  views.reserve(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) views.push_back(flat.narrow(0, r * chunk, chunk));
  return views;
}

c10d::ReduceOp toC10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:  // Gloo rejects AVG: SUM, then divide in wait()
      return c10d::ReduceOp::SUM;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

// The dtype Gloo reduces a tensor of `type` in: Gloo 1.13 reduces float, double, half,
// int8, uint8, int32 and int64 only.
c10::optional<at::ScalarType> glooReduceType(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
      return type;
    case at::kBFloat16:
      return at::kFloat;
    case at::kShort:
      return at::kInt;
    default:
      return c10::nullopt;
  }
}

std::shared_ptr<::gloo::transport::Device> makeDevice(const std::string& hostname) {
  if (!hostname.empty()) return c10d::ProcessGroupGloo::createDeviceForHostname(hostname);
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname != nullptr && *ifname != '\0') {
    const std::string first = std::string(ifname).substr(0, std::string(ifname).find(','));
    return c10d::ProcessGroupGloo::createDeviceForInterface(first);
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

// Gloo's words for a connection whose peer is gone (its process exited or was killed: the
// socket closed or reset).
bool looksLikeLostPeer(const std::string& message) {
  for (const char* sign : {"Connection closed by peer", "Connection reset by peer", "Socket closed", "Broken pipe"}) {
    if (message.find(sign) != std::string::npos) return true;
  }
  return false;
}

// How often a wait looks up whether this process aborted its communicators.
constexpr auto kAbortCheckEvery = std::chrono::milliseconds(50);
// What c10d's Work::wait(timeout) throws when the time given to it ran out.
constexpr const char* kSliceTimedOut = "Operation timed out!";

// Waits for `work`, turning c10d's and Gloo's failures into ours: PeerLostError when a
// peer's connection was lost or this process aborted its communicators (the work is then
// abandoned), TimeoutError when the work did not finish in time, Error otherwise; either
// way the communicator is marked broken (ranks no longer agree on what was sent).
void waitGlooWork(c10d::Work& work, const std::string& method, const std::string& what, std::chrono::milliseconds timeout,
                  const std::shared_ptr<CommHealth>& health) {
  // A line every fifth of the timeout while the work has not finished: a rank that is
  // stopped or stuck otherwise leaves the others silent for the whole timeout.
  const auto every = std::clamp<std::chrono::milliseconds>(timeout / 5, std::chrono::seconds(1), std::chrono::seconds(30));
  const auto start = std::chrono::steady_clock::now();
  auto nextLine = start + every;
  try {
    while (true) {
      const auto now = std::chrono::steady_clock::now();
      const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - start);
      const auto left = timeout - waited;
      if (commAborted(health)) {
        const std::string message = strCat("GlooCommunicator::", method, ": ", what,
                                           ": aborted by this process (its replica groups are changing)");
        markCommBroken(health, message);
        throw PeerLostError(message);
      }
      try {
        work.wait(std::clamp(left, std::chrono::milliseconds(1), kAbortCheckEvery));
        break;
      } catch (const std::exception& e) {
        // c10d's wait gave up on this slice ("Operation timed out!"; the work may have ended
        // just after): wait again, until the whole timeout has passed. Anything else is the
        // work's own end (Gloo's errors, its timeout included).
        const auto after = std::chrono::steady_clock::now();
        if (after - start >= timeout || std::string(e.what()).find(kSliceTimedOut) == std::string::npos) throw;
        if (after >= nextLine) {
          nextLine += every;
          TLOG_WARN("GlooCommunicator::" << method << ": " << what << " has waited "
                    << formatDuration(std::chrono::duration_cast<std::chrono::milliseconds>(after - start))
                    << " for the other ranks (timeout " << formatDuration(timeout)
                    << "): one has not joined it (stopped, stuck or slow); at the timeout the run stops and "
                       "tessera-run's verdict names it");
        }
      }
    }
  } catch (const PeerLostError&) {
    throw;
  } catch (const std::exception& e) {
    // Either c10d's wait gave up ("Operation timed out!", the work still runs) or Gloo's
    // own timeout or a transport error ended the work.
    const std::string cause = firstLine(e.what());
    if (work.isCompleted() && looksLikeLostPeer(cause)) {
      const std::string message = strCat("GlooCommunicator::", method, ": ", what, ": a peer is lost (gloo: ", cause, ")");
      markCommBroken(health, message);
      throw PeerLostError(message);
    }
    const bool timedOut = !work.isCompleted() || looksLikeTimeout(cause);
    const std::string message =
        timedOut ? strCat("GlooCommunicator::", method, ": timed out after ", formatDuration(timeout), ": ", what,
                          " (gloo: ", cause, ")")
                 : strCat("GlooCommunicator::", method, ": failed: ", what, " (gloo: ", cause, ")");
    markCommBroken(health, message);
    if (timedOut) throw TimeoutError(message);
    throw Error(message);
  }
}

// A handle whose wait() runs once: later calls return at once, or rethrow what the first
// one threw. Subclasses put the waiting itself in waitOnce().
class WaitOnceHandle : public CommHandle {
 public:
  void wait() final {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) {
      if (error_) std::rethrow_exception(error_);
      return;
    }
    done_ = true;
    try {
      waitOnce();
    } catch (...) {
      error_ = std::current_exception();
      throw;
    }
  }

 protected:
  virtual void waitOnce() = 0;

 private:
  std::mutex mutex_;
  bool done_ = false;
  std::exception_ptr error_;
};

class GlooHandle final : public WaitOnceHandle {
 public:
  GlooHandle(c10::intrusive_ptr<c10d::Work> work, std::function<void()> finish, std::string method, std::string what,
             std::chrono::milliseconds timeout, std::shared_ptr<CommHealth> health)
      : work_(std::move(work)),
        finish_(std::move(finish)),
        method_(std::move(method)),
        what_(std::move(what)),
        timeout_(timeout),
        health_(std::move(health)) {}

  bool isCompleted() override { return work_->isCompleted(); }

 protected:
  void waitOnce() override {
    waitGlooWork(*work_, method_, what_, timeout_, health_);
    if (finish_) finish_();
    finish_ = nullptr;  // drops the references to the buffers
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> finish_;
  std::string method_;
  std::string what_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<CommHealth> health_;
};

// A reduce-scatter from point-to-point transfers that holds two chunks of receive buffer,
// not one as large as the input (an all-to-all's): zero3 reduces a whole unit at a time,
// and that buffer was a unit at its memory peak. Every rank sends chunk j of its input to
// rank j at once; it receives from rank-1, rank-2, ... in turn (so each rank sends to one
// peer and receives from another in each round, as a ring does), adding each chunk into
// the output after its own, in that fixed order (deterministic). Same bytes on the wire
// as the all-to-all. 16-bit inputs are summed in fp32 and rounded once.
class PairwiseReduceScatter final : public WaitOnceHandle {
 public:
  PairwiseReduceScatter(c10d::ProcessGroupGloo& pg, const at::Tensor& flatIn, const at::Tensor& localOut, ReduceOp op,
                        int rank, int world, int tag, std::string what, std::chrono::milliseconds timeout,
                        std::shared_ptr<CommHealth> health)
      : pg_(pg),
        flatIn_(flatIn),
        out_(localOut.view({-1})),
        op_(op),
        rank_(rank),
        world_(world),
        tag_(tag),
        what_(std::move(what)),
        timeout_(timeout),
        health_(std::move(health)) {
    const int64_t chunk = out_.numel();
    const at::Tensor parts = flatIn_.view({world_, chunk});
    for (int i = 1; i < world_; ++i) {
      const int to = (rank_ + i) % world_;
      std::vector<at::Tensor> t{bytesOf(parts[to])};
      sends_.push_back(pg_.send(t, to, tag_));
    }
    // The sum runs in the output itself, or in fp32 beside a 16-bit one.
    const bool narrow = out_.scalar_type() == at::kBFloat16 || out_.scalar_type() == at::kHalf;
    if (narrow) {
      sum_ = parts[rank_].to(at::kFloat);
    } else {
      out_.copy_(parts[rank_]);
      sum_ = out_;
    }
    for (at::Tensor& b : buffers_) b = at::empty({chunk}, out_.options());
    // One rank (CommOptions::singleRankShortcut off): nothing to receive; its own chunk
    // is the sum (gloo's TCP pair to itself segfaults on a receive).
    if (world_ > 1) postReceive(1);
  }

  bool isCompleted() override {
    if (pending_ && !pending_->isCompleted()) return false;
    for (auto& send : sends_) {
      if (!send->isCompleted()) return false;
    }
    return true;
  }

 protected:
  void waitOnce() override {
    for (int i = 1; i < world_; ++i) {
      c10::intrusive_ptr<c10d::Work> work = std::move(pending_);
      const at::Tensor received = buffers_[i % 2];
      if (i + 1 < world_) postReceive(i + 1);  // into the other buffer, while this one is added
      waitGlooWork(*work, "reduceScatter", what_, timeout_, health_);
      combine(received);
    }
    for (auto& send : sends_) waitGlooWork(*send, "reduceScatter", what_, timeout_, health_);
    if (op_ == ReduceOp::kAvg) sum_.div_(world_);
    if (!sum_.is_same(out_)) out_.copy_(sum_);
    sends_.clear();
    flatIn_ = sum_ = at::Tensor();
    for (at::Tensor& b : buffers_) b = at::Tensor();
  }

 private:
  // Round i: the chunk from rank - i.
  void postReceive(int i) {
    std::vector<at::Tensor> t{bytesOf(buffers_[i % 2])};
    pending_ = pg_.recv(t, (rank_ - i + world_) % world_, tag_);
  }

  void combine(const at::Tensor& received) {
    switch (op_) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        sum_.add_(received);
        return;
      case ReduceOp::kMax:
        at::maximum_out(sum_, sum_, received);
        return;
      case ReduceOp::kMin:
        at::minimum_out(sum_, sum_, received);
        return;
    }
  }

  c10d::ProcessGroupGloo& pg_;
  at::Tensor flatIn_, out_, sum_;
  ReduceOp op_;
  int rank_, world_, tag_;
  std::string what_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<CommHealth> health_;
  std::vector<c10::intrusive_ptr<c10d::Work>> sends_;
  c10::intrusive_ptr<c10d::Work> pending_;
  at::Tensor buffers_[2];
};

// An all-gather from point-to-point transfers straight into the output's chunks: c10d's
// Gloo allgather (LibTorch 1.13) gathers into a temporary as large as the output and
// copies it out, a whole zero3 unit more at the memory peak. Every rank sends its chunk
// to every other and receives theirs in place, all at once; the same bytes on the wire.
class PairwiseAllGather final : public WaitOnceHandle {
 public:
  PairwiseAllGather(c10d::ProcessGroupGloo& pg, const at::Tensor& flatOut, const at::Tensor& localIn, int rank,
                    int world, int tag, std::string what, std::chrono::milliseconds timeout,
                    std::shared_ptr<CommHealth> health)
      : what_(std::move(what)), timeout_(timeout), health_(std::move(health)) {
    const at::Tensor out = bytesOf(flatOut).view({world, -1});
    const at::Tensor in = bytesOf(localIn);
    if (!out[rank].is_same(in) && out[rank].data_ptr() != in.data_ptr()) out[rank].copy_(in);
    for (int i = 1; i < world; ++i) {
      const int to = (rank + i) % world, from = (rank - i + world) % world;
      std::vector<at::Tensor> send{out[rank]};
      works_.push_back(pg.send(send, to, tag));
      std::vector<at::Tensor> receive{out[from]};
      works_.push_back(pg.recv(receive, from, tag));
    }
  }

  bool isCompleted() override {
    for (auto& work : works_) {
      if (!work->isCompleted()) return false;
    }
    return true;
  }

 protected:
  void waitOnce() override {
    for (auto& work : works_) waitGlooWork(*work, "allGatherInto", what_, timeout_, health_);
    works_.clear();
  }

 private:
  std::string what_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<CommHealth> health_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

// An all-reduce as the ring's two halves, point to point: a PairwiseReduceScatter into
// this rank's chunk, then a PairwiseAllGather of the reduced chunks, both in place (in a
// padded copy when the element count is not a multiple of the world size). Same bytes on
// the wire as a ring all-reduce; used for the sizes GlooOptions::splitAllReduce* name
// (none by default: bench_allreduce_bench found no size where it won consistently). Every chunk is reduced by its
// owner alone, so all ranks end with bitwise the same values. The gather starts in wait(),
// once the reduce-scatter is over; both tags were taken at issue, so the ranks need not
// wait at the same point.
class SplitAllReduce final : public WaitOnceHandle {
 public:
  SplitAllReduce(c10d::ProcessGroupGloo& pg, const at::Tensor& t, ReduceOp op, int rank, int world,
                 std::pair<int, int> tags, std::string what, std::chrono::milliseconds timeout,
                 std::shared_ptr<CommHealth> health)
      : pg_(pg), t_(t), rank_(rank), world_(world), gatherTag_(tags.second), what_(what), timeout_(timeout),
        health_(health) {
    const int64_t numel = t.numel();
    chunk_ = (numel + world - 1) / world;
    if (chunk_ * world == numel) {
      flat_ = t.view({-1});
    } else {
      flat_ = at::zeros({chunk_ * world}, t.options());
      flat_.narrow(0, 0, numel).copy_(t.view({-1}));
    }
    scatter_ = std::make_shared<PairwiseReduceScatter>(pg, flat_, flat_.narrow(0, rank * chunk_, chunk_), op, rank,
                                                       world, tags.first, std::move(what), timeout, std::move(health));
  }

  // The gather starts in wait(): LibTorch 1.13's point-to-point works report completion
  // only once waited, so the reduce-scatter's end cannot be seen earlier.
  bool isCompleted() override { return completed_.load(); }

 protected:
  void waitOnce() override {
    scatter_->wait();
    startGather();
    gather_->wait();
    if (!flat_.is_same(t_) && flat_.data_ptr() != t_.data_ptr()) t_.view({-1}).copy_(flat_.narrow(0, 0, t_.numel()));
    scatter_.reset();
    gather_.reset();
    flat_ = t_ = at::Tensor();
    completed_.store(true);
  }

 private:
  void startGather() {
    gather_ = std::make_shared<PairwiseAllGather>(pg_, flat_, flat_.narrow(0, rank_ * chunk_, chunk_), rank_, world_,
                                                  gatherTag_, what_, timeout_, health_);
  }

  c10d::ProcessGroupGloo& pg_;
  at::Tensor t_, flat_;
  int64_t chunk_ = 0;
  int rank_, world_, gatherTag_;
  std::string what_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<CommHealth> health_;
  std::shared_ptr<CommHandle> scatter_, gather_;
  std::atomic<bool> completed_{false};  // read without the lock wait() holds throughout
};

// Gloo moves host memory. CUDA tensors (a CUDA model on ranks that share a GPU, the CPU
// group of a GPU run) go through host copies: inputs are copied to the host before the
// operation, results back to the device in wait(). Slow, but the same code path
// as CPU runs; GPU runs move their hot collectives over nccl.
bool onHost(const at::Tensor& t) { return !t.defined() || t.device().is_cpu(); }
at::Tensor hostCopy(const at::Tensor& t) { return onHost(t) ? t : t.to(at::kCPU); }
at::Tensor hostBuffer(const at::Tensor& t) {
  return onHost(t) ? t : at::empty(t.sizes(), t.options().device(at::kCPU));
}

class HostStagedHandle final : public CommHandle {
 public:
  HostStagedHandle(std::shared_ptr<CommHandle> inner, at::Tensor device, at::Tensor host)
      : inner_(std::move(inner)), device_(std::move(device)), host_(std::move(host)) {}

  void wait() override {
    inner_->wait();  // rethrows a failure on every call
    std::lock_guard<std::mutex> lock(mutex_);
    if (device_.defined()) device_.copy_(host_);
    device_ = at::Tensor();
    host_ = at::Tensor();
  }
  bool isCompleted() override { return inner_->isCompleted(); }

 private:
  std::mutex mutex_;
  std::shared_ptr<CommHandle> inner_;
  at::Tensor device_, host_;
};

// `inner` ran on host buffers; `host` holds the result that belongs in `device`.
std::shared_ptr<CommHandle> copyBackOnWait(std::shared_ptr<CommHandle> inner, const at::Tensor& device,
                                           const at::Tensor& host) {
  if (onHost(device)) return inner;
  return std::make_shared<HostStagedHandle>(std::move(inner), device, host);
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<Store> store, int rank, int world, const GlooOptions& options)
      : Communicator(rank, world, options.comm), store_(std::move(store)), gloo_(options) {
    TESSERA_CHECK_AS(UsageError, store_ != nullptr, "GlooCommunicator: no store");
    TESSERA_CHECK_AS(UsageError, options.threads >= 1, "GlooCommunicator: threads must be >= 1, got ",
                     options.threads);
    const std::string prefix = groupKeyPrefix(*store_, options.comm.name, rank);
    // Our own arrival check first: it names the missing ranks, Gloo's would not.
    try {
      waitForRanks(*store_, prefix + "/arrived", rank, world, options.comm.timeout,
                   [this] { throwIfAborted("creating"); });
    } catch (const TimeoutError& e) {
      throw TimeoutError(strCat("GlooCommunicator: creating ", describe(), ": ", e.what()));
    }
    auto pgStore = store_->withPrefix(prefix + "/gloo");
    auto pgOptions = c10d::ProcessGroupGloo::Options::create(options.comm.timeout);
    try {
      pgOptions->devices.push_back(makeDevice(options.hostname));
      pgOptions->threads = options.threads;
      pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(c10dStore(*pgStore), rank, world, pgOptions);
    } catch (const std::exception& e) {
      const std::string message = strCat("GlooCommunicator: connecting ", describe(), " over ", store_->address(),
                                         " failed: ", firstLine(e.what()));
      if (looksLikeTimeout(e.what())) throw TimeoutError(message);
      throw Error(message);
    }
    // Return only once every rank is connected. Gloo's connect returns on a rank as soon
    // as its own side is up; a rank that then destroyed the group at once (a communicator
    // used for nothing, or a failing caller) closed sockets a slower peer was still
    // connecting over: "Connection closed by peer" in that peer's constructor (seen about
    // once in 300 runs of a 4-rank test).
    try {
      waitForRanks(*store_, prefix + "/connected", rank, world, options.comm.timeout,
                   [this] { throwIfAborted("connecting"); });
    } catch (const TimeoutError& e) {
      throw TimeoutError(strCat("GlooCommunicator: connecting ", describe(), ": ", e.what()));
    }
    TLOG_DEBUG("GlooCommunicator: " << describe() << " connected (" << prefix << ")");
  }

  // After abortCommunicators(), operations of this group may still wait in c10d's threads
  // (abandoned, until their timeout); destroying the group would wait for them, so it is
  // kept for the rest of the process instead.
  ~GlooCommunicator() override {
    if (commAborted(health())) new c10::intrusive_ptr<c10d::ProcessGroupGloo>(std::move(pg_));  // kept: see above
  }

  std::string backendName() const override { return "gloo"; }

 protected:
  // All-to-all with equal splits: chunk r of `send` goes to rank r, and chunk r of
  // `received` comes from rank r (c10d keeps both tensors alive until the work ends).
  c10::intrusive_ptr<c10d::Work> allToAllEqual(at::Tensor received, at::Tensor send) {
    std::vector<int64_t> equalSplits;
    c10d::AllToAllOptions opts;
    opts.timeout = opTimeout();
    return pg_->alltoall_base(received, send, equalSplits, equalSplits, opts);
  }

  std::shared_ptr<CommHandle> doAllGatherInto(const at::Tensor& flat_out, const at::Tensor& local_in) override {
    if (!onHost(flat_out) || !onHost(local_in)) {
      const at::Tensor hostOut = hostBuffer(flat_out);
      return copyBackOnWait(doAllGatherInto(hostOut, hostCopy(local_in)), flat_out, hostOut);
    }
    // The collective writes through byte views of flat_out: a copy would lose the result.
    TESSERA_CHECK_AS(UsageError, flat_out.is_contiguous(), "GlooCommunicator::allGatherInto: output ",
                     flat_out.sizes(), " is not contiguous");
    const at::Tensor in = bytesOf(local_in);
    if (flat_out.nbytes() <= kAllToAllGatherBytes) {
      // Small gathers as an all-to-all of the shard repeated once per rank, straight into
      // flat_out: Gloo's allgather in LibTorch 1.13 has a large fixed cost even for one
      // element, its all-to-all a smaller one (docs/benchmarks.md, "Training
      // throughput"). The repeated shard is a temporary as large as flat_out, hence the cap.
      return handle("allGatherInto", describeOp("allGatherInto", local_in),
                    allToAllEqual(bytesOf(flat_out), in.repeat({worldSize()})));
    }
    // Large: point to point into flat_out itself (c10d's allgather would stage it).
    return std::make_shared<PairwiseAllGather>(*pg_, flat_out, local_in, rank(), worldSize(), nextPointToPointTag(),
                                               describeOp("allGatherInto", local_in), opTimeout(), health());
  }

  std::shared_ptr<CommHandle> doReduceScatter(const at::Tensor& local_out, const at::Tensor& flat_in,
                                              ReduceOp op) override {
    if (!onHost(local_out) || !onHost(flat_in)) {
      const at::Tensor hostOut = hostBuffer(local_out);
      return copyBackOnWait(doReduceScatter(hostOut, hostCopy(flat_in), op), local_out, hostOut);
    }
    const int world = worldSize();
    if (flat_in.nbytes() > kAllToAllReduceBytes) {
      // Large: point to point, two chunks of receive buffer instead of a whole input.
      return std::make_shared<PairwiseReduceScatter>(*pg_, flat_in.contiguous(), local_out, op, rank(), world,
                                                     nextPointToPointTag(),
                                                     describeOp("reduceScatter", flat_in, reduceOpName(op)),
                                                     opTimeout(), health());
    }
    // All-to-all with equal splits: chunk r of every rank's flat_in lands on rank r, in
    // rank order; then rank r reduces its N received chunks locally.
    const at::Tensor send = bytesOf(flat_in);
    const at::Tensor received = at::empty_like(send);
    auto work = allToAllEqual(received, send);
    const int64_t chunk = local_out.numel();
    const at::ScalarType type = local_out.scalar_type();
    auto finish = [received, local_out, world, chunk, type, op]() {
      const at::Tensor parts = received.view(type).view({world, chunk});
      at::Tensor out = local_out.view({chunk});
      switch (op) {
        case ReduceOp::kSum:
          at::sum_out(out, parts, {0});
          break;
        case ReduceOp::kAvg:
          at::sum_out(out, parts, {0});
          out.div_(world);
          break;
        case ReduceOp::kMax:
          at::amax_out(out, parts, {0});
          break;
        case ReduceOp::kMin:
          at::amin_out(out, parts, {0});
          break;
      }
    };
    return handle("reduceScatter", describeOp("reduceScatter", flat_in, reduceOpName(op)), std::move(work),
                  std::move(finish));
  }

  std::shared_ptr<CommHandle> doAllReduce(const at::Tensor& t, ReduceOp op) override {
    if (!onHost(t)) {
      const at::Tensor host = hostCopy(t);
      return copyBackOnWait(doAllReduce(host, op), t, host);
    }
    const std::string what = describeOp("allReduce", t, reduceOpName(op));
    const at::ScalarType type = t.scalar_type();
    const auto bytes = static_cast<int64_t>(t.nbytes());
    const bool splittable = type == at::kFloat || type == at::kDouble || type == at::kHalf || type == at::kBFloat16;
    if (bytes >= gloo_.splitAllReduceFromBytes && bytes < gloo_.splitAllReduceBelowBytes && splittable) {
      const int scatterTag = nextPointToPointTag();
      const int gatherTag = nextPointToPointTag();
      return std::make_shared<SplitAllReduce>(*pg_, t, op, rank(), worldSize(), std::make_pair(scatterTag, gatherTag),
                                              what, opTimeout(), health());
    }
    at::Tensor buffer = t;
    bool copyBack = false;  // the reduction ran in a wider temporary
    if (type == at::kBool && (op == ReduceOp::kMax || op == ReduceOp::kMin)) {
      buffer = t.view(at::kByte);  // same memory: max = any, min = all
    } else {
      const auto reduceType = glooReduceType(type);
      TESSERA_CHECK_AS(UsageError, reduceType.has_value(), "GlooCommunicator::allReduce: gloo cannot reduce ", what);
      if (*reduceType != type) {
        buffer = t.to(*reduceType);
        copyBack = true;
      }
    }
    std::vector<at::Tensor> tensors{buffer};
    c10d::AllreduceOptions opts;
    opts.reduceOp = toC10d(op);
    opts.timeout = opTimeout();
    auto work = pg_->allreduce(tensors, opts);
    std::function<void()> finish;
    const int world = worldSize();
    if (op == ReduceOp::kAvg || copyBack) {
      finish = [t, buffer, op, world, copyBack]() {
        if (op == ReduceOp::kAvg) buffer.div_(world);
        if (copyBack) t.copy_(buffer);
      };
    }
    return handle("allReduce", what, std::move(work), std::move(finish));
  }

  std::shared_ptr<CommHandle> doBroadcast(const at::Tensor& t, int root) override {
    if (!onHost(t)) {
      const at::Tensor host = hostCopy(t);
      return copyBackOnWait(doBroadcast(host, root), t, host);
    }
    std::vector<at::Tensor> tensors{bytesOf(t)};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.rootTensor = 0;
    opts.timeout = opTimeout();
    return handle("broadcast", describeOp("broadcast", t, strCat("root ", root).c_str()), pg_->broadcast(tensors, opts));
  }

  std::shared_ptr<CommHandle> doGatherToRoot(const at::Tensor& out, const at::Tensor& local_in, int root) override {
    if (!onHost(local_in) || (rank() == root && !onHost(out))) {
      const at::Tensor hostOut = rank() == root ? hostBuffer(out) : at::Tensor();
      return copyBackOnWait(doGatherToRoot(hostOut, hostCopy(local_in), root), rank() == root ? out : at::Tensor(),
                            hostOut);
    }
    const at::Tensor in = bytesOf(local_in);
    std::vector<std::vector<at::Tensor>> outputs;
    if (rank() == root) {
      outputs.push_back(chunksOf(bytesOf(out), worldSize(), in.numel()));
    }
    std::vector<at::Tensor> inputs{in};
    c10d::GatherOptions opts;
    opts.rootRank = root;
    opts.timeout = opTimeout();
    return handle("gatherToRoot", describeOp("gatherToRoot", local_in, strCat("root ", root).c_str()),
                  pg_->gather(outputs, inputs, opts));
  }

  std::shared_ptr<CommHandle> doBarrier() override {
    c10d::BarrierOptions opts;
    opts.timeout = opTimeout();
    return handle("barrier", describeOp("barrier", at::Tensor()), pg_->barrier(opts));
  }

  std::shared_ptr<Communicator> doSplit(const std::vector<int>& ranks, int subRank, const std::string& name) override {
    GlooOptions sub = gloo_;
    sub.comm.name = name;
    return std::make_shared<GlooCommunicator>(store_, subRank, static_cast<int>(ranks.size()), sub);
  }

 private:
  std::shared_ptr<CommHandle> handle(const char* method, std::string what, c10::intrusive_ptr<c10d::Work> work,
                                     std::function<void()> finish = nullptr) {
    return std::make_shared<GlooHandle>(std::move(work), std::move(finish), method, std::move(what),
                                        opTimeout(), health());
  }

  std::shared_ptr<Store> store_;
  GlooOptions gloo_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  // Point-to-point collectives are told apart by tag: the same sequence on every rank,
  // as they are issued in the same order everywhere (unsigned: wraps without overflow).
  int nextPointToPointTag() { return static_cast<int>(pointToPointIssued_++ & 0x3fffffffu); }
  uint32_t pointToPointIssued_ = 0;
};

}  // namespace

std::shared_ptr<Communicator> makeGlooCommunicator(std::shared_ptr<Store> store, int rank, int world,
                                                   const GlooOptions& options) {
  return std::make_shared<GlooCommunicator>(std::move(store), rank, world, options);
}

}  // namespace tessera::distributed
