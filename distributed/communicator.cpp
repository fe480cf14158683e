// The backend-independent half of Communicator: argument checks, byte counters, the
// world-of-one and empty-tensor shortcuts, split bookkeeping and the backend factory.
#include "distributed/communicator.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <mutex>
#include <set>

#include "common/errors.h"
#include "common/trace.h"
#include "diagnostics/flight_recorder.h"
#include "distributed/gloo_communicator.h"
#include "distributed/shm_communicator.h"
#include "distributed/store.h"
#if defined(TESSERA_WITH_NCCL)
#include "distributed/nccl_communicator.h"
#endif

namespace tessera::distributed {

struct CommHealth {
  explicit CommHealth(uint64_t generation) : abortGeneration(generation) {}
  std::mutex mutex;
  bool broken = false;
  std::string why;
  const uint64_t abortGeneration;  // CommOptions::abortGeneration, or at the communicator's creation
};

namespace {

// A handle for operations with nothing to send (world of one, empty tensors).
class CompletedHandle final : public CommHandle {
 public:
  void wait() override {}
  bool isCompleted() override { return true; }
};

std::string formatBytes(int64_t bytes) {
  if (bytes < 1024) return strCat(bytes, " B");
  char buf[32];
  const double kib = static_cast<double>(bytes) / 1024.0;
  if (kib < 1024) {
    std::snprintf(buf, sizeof buf, "%.1f KiB", kib);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f MiB", kib / 1024.0);
  }
  return buf;
}

std::string shapeOf(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::string out = strCat(c10::toString(t.scalar_type()), "[");
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (d > 0) out += ",";
    out += std::to_string(t.size(d));
  }
  return out + "]";
}

void checkTensor(const char* method, const char* name, const at::Tensor& t) {
  TESSERA_CHECK_AS(UsageError, t.defined(), "Communicator::", method, ": ", name, " is undefined");
  TESSERA_CHECK_AS(UsageError, t.is_contiguous(), "Communicator::", method, ": ", name, " (", shapeOf(t),
                   ") must be contiguous");
}

void checkPair(const char* method, const char* flatName, const at::Tensor& flat, const char* localName,
               const at::Tensor& local, int world) {
  checkTensor(method, flatName, flat);
  checkTensor(method, localName, local);
  TESSERA_CHECK_AS(UsageError, flat.scalar_type() == local.scalar_type(), "Communicator::", method, ": ", flatName,
                   " is ", shapeOf(flat), " but ", localName, " is ", shapeOf(local), " (dtypes differ)");
  TESSERA_CHECK_AS(UsageError, flat.device() == local.device(), "Communicator::", method, ": ", flatName, " is on ",
                   flat.device(), " but ", localName, " is on ", local.device());
  TESSERA_CHECK_AS(UsageError, flat.numel() == local.numel() * world, "Communicator::", method, ": ", flatName, " (",
                   shapeOf(flat), ", ", flat.numel(), " elements) must hold world size ", world, " x ", localName, " (",
                   shapeOf(local), ", ", local.numel(), " elements) = ", local.numel() * world,
                   " elements; pad the chunks to equal size");
}

void checkReduceOp(const char* method, const at::Tensor& t, ReduceOp op) {
  TESSERA_CHECK_AS(UsageError, op != ReduceOp::kAvg || at::isFloatingType(t.scalar_type()), "Communicator::", method,
                   ": ReduceOp avg needs a floating-point tensor, got ", shapeOf(t));
  TESSERA_CHECK_AS(UsageError, (op != ReduceOp::kMax && op != ReduceOp::kMin) || !at::isComplexType(t.scalar_type()),
                   "Communicator::", method, ": ReduceOp ", reduceOpName(op), " needs an ordered dtype, got ",
                   shapeOf(t));
}

// A group of one rank: every operation is local, handled by Communicator itself (the
// world-of-one shortcuts), so a split into single ranks costs no store traffic or sockets.
class SelfCommunicator final : public Communicator {
 public:
  SelfCommunicator(std::string backend, c10::Device device, CommOptions options)
      : Communicator(0, 1, std::move(options)), backend_(std::move(backend)), device_(device) {}
  std::string backendName() const override { return backend_; }
  c10::Device tensorDevice() const override { return device_; }

 protected:
  std::shared_ptr<CommHandle> doAllGatherInto(const at::Tensor&, const at::Tensor&) override { return unreachable(); }
  std::shared_ptr<CommHandle> doReduceScatter(const at::Tensor&, const at::Tensor&, ReduceOp) override {
    return unreachable();
  }
  std::shared_ptr<CommHandle> doAllReduce(const at::Tensor&, ReduceOp) override { return unreachable(); }
  std::shared_ptr<CommHandle> doBroadcast(const at::Tensor&, int) override { return unreachable(); }
  std::shared_ptr<CommHandle> doGatherToRoot(const at::Tensor&, const at::Tensor&, int) override {
    return unreachable();
  }
  std::shared_ptr<CommHandle> doBarrier() override { return unreachable(); }
  std::shared_ptr<Communicator> doSplit(const std::vector<int>&, int, const std::string& name) override {
    CommOptions sub = options();
    sub.name = name;
    return std::make_shared<SelfCommunicator>(backend_, device_, sub);
  }

 private:
  std::shared_ptr<CommHandle> unreachable() const {
    throw Error(strCat("SelfCommunicator: internal error: a world-of-one operation reached the backend (", describe(),
                       ")"));
  }
  std::string backend_;
  c10::Device device_;
};

// Copies src into dst unless they are the same memory.
void copyUnlessSame(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.data_ptr() != src.data_ptr()) dst.reshape({-1}).copy_(src.reshape({-1}));
}

}  // namespace

const char* reduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

const char* commOpName(CommOp op) {
  switch (op) {
    case CommOp::kAllGather: return "all_gather";
    case CommOp::kReduceScatter: return "reduce_scatter";
    case CommOp::kAllReduce: return "all_reduce";
    case CommOp::kBroadcast: return "broadcast";
    case CommOp::kGather: return "gather";
    case CommOp::kBarrier: return "barrier";
  }
  return "?";
}

int64_t tensorBytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

int lowestFailingRank(Communicator* comm, bool failed) {
  const int rank = comm ? comm->rank() : 0;
  if (comm == nullptr || comm->worldSize() == 1) return failed ? rank : -1;
  const int64_t none = comm->worldSize();
  at::Tensor flag = at::tensor({failed ? int64_t{rank} : none}, at::kLong);
  comm->allReduce(flag, ReduceOp::kMin);
  const int64_t lowest = flag.item<int64_t>();
  return lowest == none ? -1 : static_cast<int>(lowest);
}

void throwIfAnyRankFailed(Communicator* comm, const std::string& localError, const std::string& what) {
  throwIfFailed(lowestFailingRank(comm, !localError.empty()), comm ? comm->rank() : 0, localError, what);
}

void throwIfFailed(int failedRank, int rank, const std::string& localError, const std::string& what) {
  if (!localError.empty()) throw Error(strCat(what, " failed on rank ", rank, ": ", localError));
  if (failedRank >= 0) throw Error(strCat(what, " failed on rank ", failedRank, " (its log has the reason)"));
}

void runOnEveryRank(Communicator* comm, const std::string& what, const std::function<void()>& fn) {
  std::exception_ptr failure;
  try {
    fn();
  } catch (...) {
    failure = std::current_exception();  // a c10::Error from a tensor op too
  }
  const int failedRank = lowestFailingRank(comm, failure != nullptr);
  if (failure) std::rethrow_exception(failure);
  if (failedRank >= 0) throw Error(strCat(what, " failed on rank ", failedRank, " (its log has the reason)"));
}

int64_t CommStats::totalBytes() const {
  int64_t total = 0;
  for (const auto& op : ops) total += op.bytes;
  return total;
}

int64_t CommStats::totalCalls() const {
  int64_t total = 0;
  for (const auto& op : ops) total += op.calls;
  return total;
}

std::string CommStats::toString() const {
  std::string out;
  for (int i = 0; i < kNumCommOps; ++i) {
    const auto& op = ops[static_cast<size_t>(i)];
    if (op.calls == 0) continue;
    if (!out.empty()) out += ", ";
    out += strCat(commOpName(static_cast<CommOp>(i)), " ", op.calls, op.calls == 1 ? " call " : " calls ",
                  formatBytes(op.bytes));
  }
  return out.empty() ? "no collectives" : out;
}

Communicator::Communicator(int rank, int world, CommOptions options)
    : rank_(rank),
      world_(world),
      options_(std::move(options)),
      health_(std::make_shared<CommHealth>(options_.abortGeneration.value_or(commAbortGeneration()))) {
  for (int r = 0; r < world; ++r) members_.push_back(r);
  TESSERA_CHECK_AS(UsageError, world >= 1 && rank >= 0 && rank < world, "Communicator: rank ", rank,
                   " is out of range for world size ", world);
  TESSERA_CHECK_AS(UsageError, options_.timeout.count() > 0, "Communicator: timeout must be positive, got ",
                   options_.timeout.count(), " ms");
}

Communicator::~Communicator() = default;

std::string Communicator::describe() const {
  return strCat(backendName(), " group '", options_.name, "' rank ", rank_, " of ", world_);
}

std::string Communicator::describeOp(const char* method, const at::Tensor& t, const char* detail) const {
  std::string what = method;
  if (detail != nullptr) what += strCat("(", detail, ")");
  if (t.defined()) what += strCat(" of ", formatBytes(tensorBytes(t)), " (", shapeOf(t), ")");
  return strCat(what, " on ", describe());
}

void markCommBroken(const std::shared_ptr<CommHealth>& health, const std::string& why) {
  std::lock_guard<std::mutex> lock(health->mutex);
  if (!health->broken) {
    health->broken = true;
    health->why = why;
  }
}

namespace {
std::atomic<uint64_t> g_abortGeneration{0};
}  // namespace

void abortCommunicators() { g_abortGeneration.fetch_add(1); }

uint64_t commAbortGeneration() { return g_abortGeneration.load(); }

bool commAborted(const std::shared_ptr<CommHealth>& health) {
  return commAbortGeneration() != health->abortGeneration;
}

void Communicator::throwIfAborted(const std::string& doing) const {
  if (commAborted(health_)) {
    throw PeerLostError(strCat(doing, " ", describe(), ": aborted by this process (its replica groups are changing)"));
  }
}

void Communicator::ensureUsable(const char* method) const {
  std::lock_guard<std::mutex> lock(health_->mutex);
  if (health_->broken) {
    throw Error(strCat("Communicator::", method, ": ", describe(),
                       " is unusable after an earlier failure (ranks no longer agree on what was sent): ", health_->why));
  }
}

namespace {

thread_local std::chrono::milliseconds t_timeoutOverride{0};  // 0: none (TimeoutScope)

// Every operation's handle: the time its wait blocks goes to its group's stats; the flight
// recorder's entry of the operation learns when this rank began waiting and how it ended
// (a timeout or failure also writes the dump: the rank may not get further); in a profile window
// (trace.h) the operation is on the group's collectives track from issue until this rank
// learnt it complete (the end of its wait: gloo's point-to-point works only learn it
// there), and a wait that blocked is a span on the waiting thread's track.
class AccountedHandle final : public CommHandle {
 public:
  AccountedHandle(std::shared_ptr<CommHandle> inner, std::shared_ptr<std::atomic<int64_t>> waitNs, std::string name,
                  std::string track, std::shared_ptr<diagnostics::FlightRing> ring, int64_t seq)
      : inner_(std::move(inner)), waitNs_(std::move(waitNs)), name_(std::move(name)), track_(std::move(track)),
        issuedNs_(trace::nowNs()), ring_(std::move(ring)), seq_(seq) {}
  void wait() override {
    if (waited_) {
      inner_->wait();  // rethrows a failure on every call
      return;
    }
    const int64_t begin = trace::nowNs();
    if (ring_) ring_->waiting(seq_);
    try {
      inner_->wait();
    } catch (const TimeoutError& e) {
      if (ring_) ring_->finish(seq_, e.what());
      diagnostics::flight::dump(strCat("collective #", seq_, " timed out: ", e.what()));
      throw;
    } catch (const std::exception& e) {
      if (ring_) ring_->finish(seq_, e.what());
      // A peer gone (a closed connection) breaks the group: say where every group stood
      // now, while the communicators still exist.
      diagnostics::flight::dump(strCat("collective #", seq_, " failed: ", e.what()));
      throw;
    }
    if (ring_) ring_->finish(seq_, "");
    waited_ = true;
    const int64_t end = trace::nowNs();
    waitNs_->fetch_add(end - begin, std::memory_order_relaxed);
    if (name_.empty()) return;  // issued outside a profile window
    trace::record({name_, "comm", track_, issuedNs_, end});
    if (end - begin > 1000) trace::record({"wait " + name_, "wait", trace::thisThreadName(), begin, end});
  }
  bool isCompleted() override { return inner_->isCompleted(); }

 private:
  std::shared_ptr<CommHandle> inner_;
  std::shared_ptr<std::atomic<int64_t>> waitNs_;
  std::string name_, track_;  // empty: not traced
  int64_t issuedNs_;
  std::shared_ptr<diagnostics::FlightRing> ring_;  // null: not recorded
  int64_t seq_;
  bool waited_ = false;
};

}  // namespace

TimeoutScope::TimeoutScope(std::chrono::milliseconds timeout) : previous_(t_timeoutOverride) {
  TESSERA_CHECK_AS(UsageError, timeout.count() > 0, "TimeoutScope: timeout must be positive, got ", timeout.count(),
                   " ms");
  t_timeoutOverride = timeout;
}
TimeoutScope::~TimeoutScope() { t_timeoutOverride = previous_; }

std::chrono::milliseconds Communicator::opTimeout() const {
  return t_timeoutOverride.count() > 0 ? t_timeoutOverride : options_.timeout;
}

const std::shared_ptr<diagnostics::FlightRing>& Communicator::flightRing() {
  // Opened at the first operation: split() sets the members after construction.
  std::call_once(flightOnce_, [this] { flight_ = diagnostics::flight::openRing(options_.name, backendName(), rank_, members_, options_.flightEntries); });
  return flight_;
}

std::shared_ptr<CommHandle> Communicator::account(CommOp op, int64_t bytes, const at::Tensor& t,
                                                  std::shared_ptr<CommHandle> handle) {
  calls_[static_cast<size_t>(op)].fetch_add(1, std::memory_order_relaxed);
  bytes_[static_cast<size_t>(op)].fetch_add(bytes, std::memory_order_relaxed);
  const std::shared_ptr<diagnostics::FlightRing>& ring = flightRing();
  const std::string& tag = trace::currentTag();
  const int64_t seq = ring ? ring->issue(commOpName(op), t.defined() ? c10::toString(t.scalar_type()) : "none",
                                         t.defined() ? t.numel() : 0, bytes, tag)
                           : 0;
  if (!trace::active()) return std::make_shared<AccountedHandle>(std::move(handle), waitNs_, "", "", ring, seq);
  std::string name = strCat(commOpName(op), tag.empty() ? "" : " " + tag, " (", formatBytes(bytes), ")");
  return std::make_shared<AccountedHandle>(std::move(handle), waitNs_, std::move(name),
                                           strCat("collectives: ", backendName(), " '", options_.name, "'"), ring, seq);
}

void Communicator::checkAgreement(CommOp op, const at::Tensor& t, int root) {
  if (!options_.checkCollectives || local()) return;
  const int64_t seq = checked_++;
  const int64_t mine[4] = {static_cast<int64_t>(op), t.defined() ? static_cast<int64_t>(t.scalar_type()) : -1,
                           t.defined() ? t.numel() : 0, root};
  const at::Tensor local = at::tensor(at::ArrayRef<int64_t>(mine, 4), at::kLong).to(tensorDevice());
  const at::Tensor all = at::empty({4 * world_}, local.options());
  doAllGatherInto(all, local)->wait();
  const at::Tensor every = all.cpu().view({world_, 4});
  auto describeRank = [&](int r) {
    const auto f = every[r];
    const int64_t dtype = f[1].item<int64_t>();
    std::string text = strCat(commOpName(static_cast<CommOp>(f[0].item<int64_t>())), " ",
                              dtype < 0 ? "none" : c10::toString(static_cast<at::ScalarType>(dtype)), " x",
                              f[2].item<int64_t>());
    if (f[3].item<int64_t>() >= 0) text += strCat(" root ", f[3].item<int64_t>());
    return text;
  };
  // The calls issued, each with its ranks, in the order of their lowest rank.
  std::vector<std::pair<std::string, std::vector<int>>> bySignature;
  for (int r = 0; r < world_; ++r) {
    const std::string signature = describeRank(r);
    auto it = std::find_if(bySignature.begin(), bySignature.end(), [&](const auto& s) { return s.first == signature; });
    if (it == bySignature.end()) {
      bySignature.push_back({signature, {r}});
    } else {
      it->second.push_back(r);
    }
  }
  if (bySignature.size() == 1) return;
  std::string ranks;
  for (const auto& [signature, who] : bySignature) {
    std::string list;
    for (const int r : who) list += (list.empty() ? "" : ", ") + std::to_string(r);
    ranks += strCat(ranks.empty() ? "" : "; ", who.size() == 1 ? "rank " : "ranks ", list, " ", signature);
  }
  const std::string why = strCat("ranks disagree on operation #", seq, " of ", describe(), ": ", ranks,
                                 " (found by diagnostics.check_collectives: every rank must issue the same "
                                 "collectives in the same order with the same sizes)");
  markCommBroken(health_, why);
  diagnostics::flight::dump(why);
  throw Error(why);
}

std::shared_ptr<CommHandle> Communicator::allGatherIntoAsync(const at::Tensor& flat_out, const at::Tensor& local_in) {
  ensureUsable("allGatherInto");
  checkPair("allGatherInto", "flat_out", flat_out, "local_in", local_in, world_);
  checkAgreement(CommOp::kAllGather, local_in, -1);
  std::shared_ptr<CommHandle> handle;
  if (local() || local_in.numel() == 0) {
    if (local_in.numel() > 0) copyUnlessSame(flat_out, local_in);
    handle = std::make_shared<CompletedHandle>();
  } else {
    handle = doAllGatherInto(flat_out, local_in);
  }
  return account(CommOp::kAllGather, (world_ - 1) * tensorBytes(local_in), local_in, std::move(handle));
}

std::shared_ptr<CommHandle> Communicator::reduceScatterAsync(const at::Tensor& local_out, const at::Tensor& flat_in,
                                                             ReduceOp op) {
  ensureUsable("reduceScatter");
  checkPair("reduceScatter", "flat_in", flat_in, "local_out", local_out, world_);
  checkReduceOp("reduceScatter", flat_in, op);
  checkAgreement(CommOp::kReduceScatter, local_out, -1);
  std::shared_ptr<CommHandle> handle;
  if (local() || local_out.numel() == 0) {
    if (local_out.numel() > 0) copyUnlessSame(local_out, flat_in);
    handle = std::make_shared<CompletedHandle>();
  } else {
    handle = doReduceScatter(local_out, flat_in, op);
  }
  return account(CommOp::kReduceScatter, (world_ - 1) * tensorBytes(local_out), local_out, std::move(handle));
}

std::shared_ptr<CommHandle> Communicator::allReduceAsync(const at::Tensor& t, ReduceOp op) {
  ensureUsable("allReduce");
  checkTensor("allReduce", "t", t);
  checkReduceOp("allReduce", t, op);
  checkAgreement(CommOp::kAllReduce, t, -1);
  std::shared_ptr<CommHandle> handle = local() || t.numel() == 0 ? std::make_shared<CompletedHandle>() : doAllReduce(t, op);
  return account(CommOp::kAllReduce, 2 * (world_ - 1) * tensorBytes(t) / world_, t, std::move(handle));
}

std::shared_ptr<CommHandle> Communicator::broadcastAsync(const at::Tensor& t, int root) {
  ensureUsable("broadcast");
  checkTensor("broadcast", "t", t);
  TESSERA_CHECK_AS(UsageError, root >= 0 && root < world_, "Communicator::broadcast: root ", root,
                   " is out of range for world size ", world_);
  checkAgreement(CommOp::kBroadcast, t, root);
  std::shared_ptr<CommHandle> handle = local() || t.numel() == 0 ? std::make_shared<CompletedHandle>() : doBroadcast(t, root);
  return account(CommOp::kBroadcast, rank_ == root && world_ > 1 ? tensorBytes(t) : 0, t, std::move(handle));
}

std::shared_ptr<CommHandle> Communicator::gatherToRootAsync(const at::Tensor& out, const at::Tensor& local_in,
                                                            int root) {
  ensureUsable("gatherToRoot");
  TESSERA_CHECK_AS(UsageError, root >= 0 && root < world_, "Communicator::gatherToRoot: root ", root,
                   " is out of range for world size ", world_);
  if (rank_ == root) {
    checkPair("gatherToRoot", "out", out, "local_in", local_in, world_);
  } else {
    checkTensor("gatherToRoot", "local_in", local_in);
  }
  checkAgreement(CommOp::kGather, local_in, root);
  std::shared_ptr<CommHandle> handle;
  if (local() || local_in.numel() == 0) {
    if (rank_ == root && local_in.numel() > 0) copyUnlessSame(out, local_in);
    handle = std::make_shared<CompletedHandle>();
  } else {
    handle = doGatherToRoot(rank_ == root ? out : at::Tensor(), local_in, root);
  }
  return account(CommOp::kGather, rank_ == root ? 0 : tensorBytes(local_in), local_in, std::move(handle));
}

std::shared_ptr<CommHandle> Communicator::barrierAsync() {
  ensureUsable("barrier");
  checkAgreement(CommOp::kBarrier, at::Tensor(), -1);
  std::shared_ptr<CommHandle> handle = local() ? std::make_shared<CompletedHandle>() : doBarrier();
  return account(CommOp::kBarrier, 0, at::Tensor(), std::move(handle));
}

void Communicator::allGatherInto(const at::Tensor& flat_out, const at::Tensor& local_in) {
  allGatherIntoAsync(flat_out, local_in)->wait();
}
void Communicator::reduceScatter(const at::Tensor& local_out, const at::Tensor& flat_in, ReduceOp op) {
  reduceScatterAsync(local_out, flat_in, op)->wait();
}
void Communicator::allReduce(const at::Tensor& t, ReduceOp op) { allReduceAsync(t, op)->wait(); }
void Communicator::broadcast(const at::Tensor& t, int root) { broadcastAsync(t, root)->wait(); }
void Communicator::gatherToRoot(const at::Tensor& out, const at::Tensor& local_in, int root) {
  gatherToRootAsync(out, local_in, root)->wait();
}
void Communicator::barrier() { barrierAsync()->wait(); }

std::shared_ptr<Communicator> Communicator::split(const std::vector<int>& ranks) {
  ensureUsable("split");
  TESSERA_CHECK_AS(UsageError, !ranks.empty(), "Communicator::split: empty rank list on ", describe());
  std::set<int> seen;
  int subRank = -1;
  std::string members;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int r = ranks[i];
    TESSERA_CHECK_AS(UsageError, r >= 0 && r < world_, "Communicator::split: rank ", r,
                     " is out of range for world size ", world_, " of ", describe());
    TESSERA_CHECK_AS(UsageError, seen.insert(r).second, "Communicator::split: rank ", r, " is listed twice");
    if (r == rank_) subRank = static_cast<int>(i);
    members += (i == 0 ? "" : ",") + std::to_string(r);
  }
  TESSERA_CHECK_AS(UsageError, subRank >= 0, "Communicator::split: rank ", rank_, " is not in the subset [", members,
                   "]; only members call split()");
  const std::string name = strCat(options_.name, "/split[", members, "]");
  std::shared_ptr<Communicator> sub;
  if (ranks.size() == 1) {
    CommOptions options = options_;
    options.name = name;
    sub = std::make_shared<SelfCommunicator>(backendName(), tensorDevice(), options);
  } else {
    sub = doSplit(ranks, subRank, name);
  }
  sub->members_.clear();
  for (const int r : ranks) sub->members_.push_back(members_[static_cast<size_t>(r)]);
  if (host_) sub->setHost(host_->split(ranks));
  return sub;
}

std::shared_ptr<Communicator> Communicator::host() {
  if (host_) return host_;
  TESSERA_CHECK_AS(UsageError, tensorDevice().is_cpu() || local(), "Communicator::host: ", describe(),
                   " takes ", tensorDevice(), " tensors and has no CPU twin attached (setHost)");
  return shared_from_this();
}

void Communicator::setHost(std::shared_ptr<Communicator> host) {
  TESSERA_CHECK_AS(UsageError, host != nullptr && host->tensorDevice().is_cpu() && host->rank() == rank_ &&
                                   host->worldSize() == world_,
                   "Communicator::setHost: the twin of ", describe(), " must be a CPU communicator of rank ", rank_,
                   " of ", world_, ", got ", host ? host->describe() : std::string("none"));
  host_ = std::move(host);
}

CommStats Communicator::stats() const {
  CommStats s;
  for (int i = 0; i < kNumCommOps; ++i) {
    s.ops[static_cast<size_t>(i)].calls = calls_[static_cast<size_t>(i)].load(std::memory_order_relaxed);
    s.ops[static_cast<size_t>(i)].bytes = bytes_[static_cast<size_t>(i)].load(std::memory_order_relaxed);
  }
  s.waitNs = waitNs_->load(std::memory_order_relaxed);
  return s;
}

void Communicator::resetStats() {
  for (int i = 0; i < kNumCommOps; ++i) {
    calls_[static_cast<size_t>(i)].store(0, std::memory_order_relaxed);
    bytes_[static_cast<size_t>(i)].store(0, std::memory_order_relaxed);
  }
  waitNs_->store(0, std::memory_order_relaxed);
}

std::string groupKeyPrefix(Store& store, const std::string& name, int rank) {
  const int64_t generation = store.add(strCat("tessera/comm/", name, "/created_by/", rank), 1);
  return strCat("tessera/comm/", name, "#", generation);
}

bool ncclAvailable() {
#if defined(TESSERA_WITH_NCCL)
  return true;
#else
  return false;
#endif
}

std::shared_ptr<Communicator> makeCommunicator(const std::string& backend, std::shared_ptr<Store> store, int rank,
                                               int world, const CommOptions& options) {
  if (backend == "gloo") {
    GlooOptions gloo;
    gloo.comm = options;
    return makeGlooCommunicator(std::move(store), rank, world, gloo);
  }
  if (backend == "shm") {
    ShmOptions shm;
    shm.comm = options;
    return makeShmCommunicator(std::move(store), rank, world, shm);
  }
  if (backend == "nccl") {
#if defined(TESSERA_WITH_NCCL)
    NcclOptions nccl;
    nccl.comm = options;
    return makeNcclCommunicator(std::move(store), rank, world, nccl);
#else
    throw ConfigError(
        "makeCommunicator: backend 'nccl' is not in this build: it needs CUDA LibTorch and NCCL "
        "(configure with -DTESSERA_WITH_CUDA=ON); this build has the CPU backend 'gloo' only");
#endif
  }
  throw ConfigError(strCat("makeCommunicator: unknown backend '", backend, "' (gloo | shm | nccl)"));
}

void allReduceHostTensor(Communicator& comm, const at::Tensor& t, ReduceOp op) {
  TESSERA_CHECK_AS(UsageError, t.device().is_cpu(), "allReduceHostTensor: needs a CPU tensor, got one on ", t.device());
  if (comm.tensorDevice().is_cpu()) {
    comm.allReduce(t, op);
    return;
  }
  const at::Tensor there = t.to(comm.tensorDevice());
  comm.allReduce(there, op);
  t.copy_(there.cpu());
}

}  // namespace tessera::distributed
