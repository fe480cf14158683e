// The shm backend (see shm_communicator.h): one shared-memory segment per group, pieces
// through per-rank slots, futex waits, one worker thread per group.
#include "distributed/shm_communicator.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <mutex>
#include <new>
#include <random>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "common/logging.h"
#include "distributed/gloo_communicator.h"
#include "distributed/rendezvous.h"

namespace tessera::distributed {
namespace {

using Clock = std::chrono::steady_clock;

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "the shm backend shares atomics between processes");

constexpr uint64_t kMagic = 0x3173686d61726574ULL;  // "teramsh1"
// How often a waiting rank checks that the ranks it waits for are still alive.
constexpr auto kLivenessEvery = std::chrono::milliseconds(50);

// One rank's progress, on its own cache line.
struct alignas(64) RankState {
  std::atomic<uint64_t> posted;    // the last piece whose part this rank has put in its slot
  std::atomic<uint64_t> consumed;  // the last piece this rank has finished reading
  std::atomic<int32_t> pid;        // its process, for the liveness check
  std::atomic<uint32_t> gaveUp;    // 1 once it left an operation with an error
};

struct alignas(64) SegmentHeader {
  uint64_t magic;
  int64_t world;
  int64_t slotBytes;
  // Bumped by every rank that changes a RankState while someone sleeps; waiters sleep on it.
  alignas(64) std::atomic<uint32_t> futexWord;
  std::atomic<uint32_t> sleepers;
};

int64_t roundUp(int64_t v, int64_t to) { return (v + to - 1) / to * to; }
int64_t ranksOffset() { return static_cast<int64_t>(sizeof(SegmentHeader)); }
int64_t slotsOffset(int64_t world) { return roundUp(ranksOffset() + world * static_cast<int64_t>(sizeof(RankState)), 4096); }
int64_t segmentBytes(int64_t world, int64_t slotBytes) { return slotsOffset(world) + world * slotBytes; }

std::string errnoText(int err) { return std::strerror(err); }

void futexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::milliseconds timeout) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  ts.tv_nsec = static_cast<long>((timeout.count() % 1000) * 1000000);
  // Not FUTEX_PRIVATE: the word is shared between processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// The state letter of a process in /proc/<pid>/stat ('R', 'S', 'T' stopped, 't' traced, 'Z'
// a zombie: exited, not yet reaped by its launcher), 'X' when it is gone, '?' without /proc.
char processState(int32_t pid) {
  if (pid <= 0 || (kill(pid, 0) != 0 && errno != EPERM)) return 'X';
  std::ifstream stat(strCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return '?';   // no /proc: kill()'s answer
  const size_t close = line.rfind(')');        // "pid (comm) state ...": comm may hold spaces
  return close == std::string::npos || close + 2 >= line.size() ? '?' : line[close + 2];
}

// The process exists and has not exited.
bool processVisible(int32_t pid) {
  const char state = processState(pid);
  return state != 'X' && state != 'Z';
}

// The mapped segment; the name is unlinked once every rank has it open.
class Segment {
 public:
  // Rank 0: creates and reserves the segment (ENOSPC here, not SIGBUS at first use).
  static std::unique_ptr<Segment> create(const std::string& name, int64_t world, int64_t slotBytes) {
    const int64_t bytes = segmentBytes(world, slotBytes);
    const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) throw Error(strCat("cannot create shared memory ", name, ": ", errnoText(errno)));
    const int err = posix_fallocate(fd, 0, bytes);
    if (err != 0) {
      close(fd);
      shm_unlink(name.c_str());
      throw Error(strCat("cannot reserve ", bytes >> 20, " MiB of shared memory in /dev/shm for ", name, ": ",
                         errnoText(err),
                         " (a container's /dev/shm is often 64 MiB: raise it, e.g. docker run --shm-size, or set "
                         "run.backend: gloo)"));
    }
    std::unique_ptr<Segment> segment;
    try {
      segment = map(fd, name, bytes);
    } catch (const Error&) {
      shm_unlink(name.c_str());
      throw;
    }
    auto* header = new (segment->base_) SegmentHeader();
    header->magic = kMagic;
    header->world = world;
    header->slotBytes = slotBytes;
    header->futexWord.store(0);
    header->sleepers.store(0);
    for (int64_t r = 0; r < world; ++r) {
      auto* state = new (segment->base_ + ranksOffset() + r * static_cast<int64_t>(sizeof(RankState))) RankState();
      state->posted.store(0);
      state->consumed.store(0);
      state->pid.store(0);
      state->gaveUp.store(0);
    }
    return segment;
  }

  static std::unique_ptr<Segment> attach(const std::string& name, int64_t world, int64_t slotBytes) {
    const int64_t bytes = segmentBytes(world, slotBytes);
    const int fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) {
      throw Error(strCat("cannot open shared memory ", name, " that rank 0 created: ", errnoText(errno),
                         " (ranks in different containers or mount namespaces do not share /dev/shm)"));
    }
    struct stat st {};
    if (fstat(fd, &st) != 0 || st.st_size != bytes) {
      close(fd);
      throw Error(strCat("shared memory ", name, " has ", st.st_size, " bytes, expected ", bytes,
                         " (ranks disagree on the world size or slot size)"));
    }
    auto segment = map(fd, name, bytes);
    const auto* header = reinterpret_cast<const SegmentHeader*>(segment->base_);
    if (header->magic != kMagic || header->world != world || header->slotBytes != slotBytes) {
      throw Error(strCat("shared memory ", name, " is not this group's segment"));
    }
    return segment;
  }

  ~Segment() {
    if (base_ != nullptr) munmap(base_, static_cast<size_t>(bytes_));
  }
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  SegmentHeader& header() const { return *reinterpret_cast<SegmentHeader*>(base_); }
  RankState& rank(int r) const {
    return *reinterpret_cast<RankState*>(base_ + ranksOffset() + r * static_cast<int64_t>(sizeof(RankState)));
  }
  uint8_t* slot(int r) const { return base_ + slotsOffset(header().world) + r * header().slotBytes; }

 private:
  static std::unique_ptr<Segment> map(int fd, const std::string& name, int64_t bytes) {
    void* base = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int err = errno;
    close(fd);
    if (base == MAP_FAILED) throw Error(strCat("cannot map shared memory ", name, ": ", errnoText(err)));
    std::unique_ptr<Segment> segment(new Segment());
    segment->base_ = static_cast<uint8_t*>(base);
    segment->bytes_ = bytes;
    return segment;
  }
  Segment() = default;

  uint8_t* base_ = nullptr;
  int64_t bytes_ = 0;
};

// `out` = op over `parts` in rank order (the same bits on every rank). 16-bit floats are
// summed in fp32 and rounded once, as the gloo backend does.
void reduceInto(const at::Tensor& out, const std::vector<at::Tensor>& parts, ReduceOp op) {
  const auto world = static_cast<double>(parts.size());
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: {
      const bool narrow = out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf;
      at::Tensor acc = narrow ? parts[0].to(at::kFloat) : out;
      if (!narrow) acc.copy_(parts[0]);
      for (size_t i = 1; i < parts.size(); ++i) acc.add_(parts[i]);
      if (op == ReduceOp::kAvg) acc.div_(world);
      if (narrow) out.copy_(acc);
      return;
    }
    case ReduceOp::kMax:
    case ReduceOp::kMin: {
      at::Tensor result = out;  // the *_out functions take a mutable reference
      result.copy_(parts[0]);
      for (size_t i = 1; i < parts.size(); ++i) {
        if (op == ReduceOp::kMax) {
          at::maximum_out(result, result, parts[i]);
        } else {
          at::minimum_out(result, result, parts[i]);
        }
      }
      return;
    }
  }
}

// One operation's state, shared by its handle and the queue.
struct ShmOp {
  std::function<void()> run;  // dropped after it ran (releases the tensors)
  bool done = false;
  std::exception_ptr error;
};

// Runs a group's operations in issue order: on its worker thread, or on a thread that
// waits for an operation at the head of the queue.
class Executor {
 public:
  Executor() {
    worker_ = std::thread([this] { workLoop(); });
  }
  ~Executor() { shutdown(); }
  // Stops the worker, makes an operation in progress stop waiting for its peers, and fails
  // the operations not yet run: they refer to a communicator that is going away. Idempotent.
  void shutdown() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return;
      stopping_ = true;
    }
    aborting_.store(true);
    changed_.notify_all();
    worker_.join();
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return !running_; });  // a waiting thread running one
    for (auto& op : queue_) {
      op->done = true;
      op->error = std::make_exception_ptr(Error("shm communicator destroyed before the operation ran"));
      op->run = nullptr;
    }
    queue_.clear();
    changed_.notify_all();
  }
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  std::shared_ptr<ShmOp> submit(std::function<void()> run) {
    auto op = std::make_shared<ShmOp>();
    op->run = std::move(run);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(op);
    }
    changed_.notify_all();
    return op;
  }

  void wait(const std::shared_ptr<ShmOp>& op) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!op->done && !running_ && !stopping_ && !queue_.empty() && queue_.front() == op) {
      queue_.pop_front();
      runLocked(lock, op);
    }
    // The running operation ends by its own timeout; this wait follows it.
    changed_.wait(lock, [&] { return op->done; });
    if (op->error) std::rethrow_exception(op->error);
  }

  bool isDone(const std::shared_ptr<ShmOp>& op) {
    std::lock_guard<std::mutex> lock(mutex_);
    return op->done;
  }

  const std::atomic<bool>& aborting() const { return aborting_; }

 private:
  void workLoop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      changed_.wait(lock, [&] { return stopping_ || (!running_ && !queue_.empty()); });
      if (stopping_) return;
      auto op = queue_.front();
      queue_.pop_front();
      runLocked(lock, op);
    }
  }

  // Called with the lock held; runs `op` without it.
  void runLocked(std::unique_lock<std::mutex>& lock, const std::shared_ptr<ShmOp>& op) {
    running_ = true;
    std::function<void()> run = std::move(op->run);
    lock.unlock();
    std::exception_ptr error;
    try {
      run();
    } catch (...) {
      error = std::current_exception();
    }
    run = nullptr;
    lock.lock();
    op->error = error;
    op->done = true;
    running_ = false;
    changed_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::shared_ptr<ShmOp>> queue_;
  bool running_ = false;
  bool stopping_ = false;
  std::atomic<bool> aborting_{false};
  std::thread worker_;
};

class ShmHandle final : public CommHandle {
 public:
  ShmHandle(std::shared_ptr<Executor> executor, std::shared_ptr<ShmOp> op)
      : executor_(std::move(executor)), op_(std::move(op)) {}
  void wait() override { executor_->wait(op_); }
  bool isCompleted() override { return executor_->isDone(op_); }

 private:
  std::shared_ptr<Executor> executor_;
  std::shared_ptr<ShmOp> op_;
};

class ShmCommunicator final : public Communicator {
 public:
  ShmCommunicator(std::shared_ptr<Store> store, int rank, int world, const ShmOptions& options)
      : Communicator(rank, world, options.comm), store_(std::move(store)), shm_(options) {
    TESSERA_CHECK_AS(UsageError, store_ != nullptr, "ShmCommunicator: no store");
    // A piece holds at least one element of the widest dtype (16 bytes) from every rank.
    TESSERA_CHECK_AS(UsageError, options.slotBytes >= 16 * world && options.slotBytes % 64 == 0,
                     "ShmCommunicator: slotBytes must be a multiple of 64 and at least 16 x world (", 16 * world,
                     "), got ", options.slotBytes);
    const auto timeout = options.comm.timeout;
    const std::string prefix = groupKeyPrefix(*store_, options.comm.name, rank);
    try {
      waitForRanks(*store_, prefix + "/arrived", rank, world, timeout, [this] { throwIfAborted("creating"); });
    } catch (const TimeoutError& e) {
      throw TimeoutError(strCat("ShmCommunicator: creating ", describe(), ": ", e.what()));
    }
    // Rank 0 creates the segment; everyone reports whether it could open it, so that
    // every rank throws the same error (and a caller's fallback is taken by all).
    std::string name;
    std::string failure;
    if (rank == 0) {
      std::random_device random;
      name = strCat(options.namePrefix, getpid(), "-", random(), "-", world);
      try {
        segment_ = Segment::create(name, world, options.slotBytes);
      } catch (const Error& e) {
        failure = e.what();
      }
      store_->set(prefix + "/shm/name", failure.empty() ? name : "!" + failure);
    } else {
      const std::string published = awaitKey(prefix + "/shm/name");
      if (!published.empty() && published[0] == '!') {
        failure = strCat("rank 0 could not set up the segment (", published.substr(1), ")");
      } else {
        name = published;
        try {
          segment_ = Segment::attach(name, world, options.slotBytes);
        } catch (const Error& e) {
          failure = e.what();
        }
      }
    }
    if (segment_) segment_->rank(rank).pid.store(static_cast<int32_t>(getpid()));
    // Every rank has it open, or has failed: either way no name is left behind.
    try {
      agree(prefix + "/shm/attached", failure);
    } catch (...) {
      if (rank == 0 && segment_) shm_unlink(name.c_str());
      throw;
    }
    if (rank == 0) shm_unlink(name.c_str());
    std::string unseen;
    for (int r = 0; r < world && unseen.empty(); ++r) {
      if (!processVisible(segment_->rank(r).pid.load())) {
        unseen = strCat("cannot see rank ", r, "'s process ", segment_->rank(r).pid.load(),
                        " (ranks in different pid namespaces)");
      }
    }
    agree(prefix + "/shm/visible", unseen);
    executor_ = std::make_shared<Executor>();
    TLOG_DEBUG("ShmCommunicator: " << describe() << " ready (" << segmentBytes(world, options.slotBytes)
                                   << " bytes of shared memory)");
  }

  // Handles may outlive the communicator (they hold the executor): nothing runs after this.
  ~ShmCommunicator() override {
    if (executor_) executor_->shutdown();
  }

  std::string backendName() const override { return "shm"; }

 protected:
  std::shared_ptr<CommHandle> doAllGatherInto(const at::Tensor& flat_out, const at::Tensor& local_in) override {
    return gather(describeOp("allGatherInto", flat_out), flat_out, local_in, /*reads=*/true);
  }

  std::shared_ptr<CommHandle> doReduceScatter(const at::Tensor& local_out, const at::Tensor& flat_in,
                                              ReduceOp op) override {
    const int64_t c = local_out.numel();
    const int64_t elem = static_cast<int64_t>(local_out.element_size());
    // q elements of every rank's chunk per piece: world x q elements fill a slot.
    const int64_t q = std::max<int64_t>(1, slotBytes() / (elem * worldSize()));
    const at::Tensor out = local_out.view({-1});
    const auto* in = static_cast<const uint8_t*>(flat_in.data_ptr());
    return submit(describeOp("reduceScatter", flat_in, reduceOpName(op)), [=] {
      for (int64_t off = 0; off < c; off += q) {
        const int64_t n = std::min(q, c - off);
        piece(
            [&](uint8_t* slot) {
              for (int d = 0; d < worldSize(); ++d) std::memcpy(slot + d * q * elem, in + (d * c + off) * elem, n * elem);
            },
            [&] { reduceInto(out.narrow(0, off, n), slotViews(rank() * q * elem, n, out.scalar_type()), op); });
      }
    }, {local_out, flat_in});
  }

  std::shared_ptr<CommHandle> doAllReduce(const at::Tensor& t, ReduceOp op) override {
    const int64_t elem = static_cast<int64_t>(t.element_size());
    const int64_t q = slotBytes() / elem;
    const at::Tensor flat = t.view({-1});
    const auto* in = static_cast<const uint8_t*>(t.data_ptr());
    return submit(describeOp("allReduce", t, reduceOpName(op)), [=] {
      for (int64_t off = 0; off < flat.numel(); off += q) {
        const int64_t n = std::min(q, flat.numel() - off);
        piece([&](uint8_t* slot) { std::memcpy(slot, in + off * elem, n * elem); },
              [&] { reduceInto(flat.narrow(0, off, n), slotViews(0, n, flat.scalar_type()), op); });
      }
    }, {t});
  }

  std::shared_ptr<CommHandle> doBroadcast(const at::Tensor& t, int root) override {
    const int64_t k = tensorBytes(t);
    auto* data = static_cast<uint8_t*>(t.data_ptr());
    const bool isRoot = rank() == root;
    return submit(describeOp("broadcast", t), [=] {
      for (int64_t off = 0; off < k; off += slotBytes()) {
        const int64_t n = std::min(slotBytes(), k - off);
        if (isRoot) {
          piece([&](uint8_t* slot) { std::memcpy(slot, data + off, n); }, nullptr);
        } else {
          piece(nullptr, [&] { std::memcpy(data + off, slotOf(root), n); });
        }
      }
    }, {t});
  }

  std::shared_ptr<CommHandle> doGatherToRoot(const at::Tensor& out, const at::Tensor& local_in, int root) override {
    return gather(describeOp("gatherToRoot", local_in), out, local_in, /*reads=*/rank() == root);
  }

  std::shared_ptr<CommHandle> doBarrier() override {
    return submit(strCat("barrier on ", describe()), [this] { piece(nullptr, nullptr); }, {});
  }

  std::shared_ptr<Communicator> doSplit(const std::vector<int>& ranks, int subRank, const std::string& name) override {
    ShmOptions sub = shm_;
    sub.comm.name = name;
    const int size = static_cast<int>(ranks.size());
    try {
      return std::make_shared<ShmCommunicator>(store_, subRank, size, sub);
    } catch (const TimeoutError&) {
      throw;
    } catch (const Error& e) {
      // Every member got this error (creation agrees on it), so all take gloo: a full
      // /dev/shm (each group reserves members x slotBytes) does not stop the run.
      TLOG_WARN("ShmCommunicator: subgroup '" << name << "' over gloo: " << e.what());
      GlooOptions gloo;
      gloo.comm = sub.comm;
      gloo.hostname = "127.0.0.1";
      return makeGlooCommunicator(store_, subRank, size, gloo);
    }
  }

 private:
  int64_t slotBytes() const { return shm_.slotBytes; }
  uint8_t* slotOf(int r) const { return segment_->slot(r); }

  // A key another rank sets while this group is built; abortCommunicators() ends the wait
  // (a peer lost mid-build, under fault.survive), as the options' timeout does.
  std::string awaitKey(const std::string& key) {
    const auto deadline = Clock::now() + options().timeout;
    while (!store_->check({key}) && Clock::now() < deadline) {
      throwIfAborted("creating");
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return store_->get(key, std::chrono::milliseconds(1000));
  }

  // Every rank publishes `failure` ("" = fine) under `key`; all throw the first failure.
  void agree(const std::string& key, const std::string& failure) {
    store_->set(strCat(key, "/", rank()), failure.empty() ? "ok" : failure);
    for (int r = 0; r < worldSize(); ++r) {
      const std::string answer = awaitKey(strCat(key, "/", r));
      if (answer != "ok") throw Error(strCat("ShmCommunicator: creating ", describe(), ": rank ", r, ": ", answer));
    }
  }

  // Every rank's local_in into chunk r of `out`, on the ranks that `reads` (all of them for
  // an all-gather, the root for a gather; elsewhere `out` may be undefined).
  std::shared_ptr<CommHandle> gather(std::string what, const at::Tensor& out, const at::Tensor& local_in, bool reads) {
    const int64_t k = tensorBytes(local_in);
    auto* dst = reads ? static_cast<uint8_t*>(out.data_ptr()) : nullptr;
    const auto* in = static_cast<const uint8_t*>(local_in.data_ptr());
    return submit(std::move(what), [=] {
      for (int64_t off = 0; off < k; off += slotBytes()) {
        const int64_t n = std::min(slotBytes(), k - off);
        piece([&](uint8_t* slot) { std::memcpy(slot, in + off, n); },
              [&] {
                if (dst == nullptr) return;
                for (int r = 0; r < worldSize(); ++r) std::memcpy(dst + r * k + off, slotOf(r), n);
              });
      }
    }, {out, local_in});
  }

  // Views of `n` elements at byte `offset` of every rank's slot, in rank order.
  std::vector<at::Tensor> slotViews(int64_t offset, int64_t n, at::ScalarType dtype) const {
    std::vector<at::Tensor> views;
    views.reserve(static_cast<size_t>(worldSize()));
    for (int r = 0; r < worldSize(); ++r) {
      views.push_back(at::from_blob(slotOf(r) + offset, {n}, at::TensorOptions().dtype(dtype)));
    }
    return views;
  }

  // Queues `body` (which captures raw pointers: `keep` holds the tensors alive until it ran).
  std::shared_ptr<CommHandle> submit(std::string what, std::function<void()> body, std::vector<at::Tensor> keep) {
    auto run = [this, what = std::move(what), body = std::move(body), keep = std::move(keep),
                timeout = opTimeout()]() {
      current_ = {what, Clock::now() + timeout, timeout};
      // Whatever failed (a timeout, a peer gone, LibTorch refusing a reduction, memory),
      // the peers must stop waiting for this rank and later calls must fail at once.
      try {
        body();
      } catch (const std::exception& e) {
        giveUp(e.what());
        throw;
      } catch (...) {
        giveUp(what + ": unknown exception");
        throw;
      }
    };
    return std::make_shared<ShmHandle>(executor_, executor_->submit(std::move(run)));
  }

  void giveUp(const std::string& why) {
    segment_->rank(rank()).gaveUp.store(1);
    wake();
    markCommBroken(health(), why);
  }

  // One piece of an operation: steps (1)-(5) of shm_communicator.h.
  void piece(const std::function<void(uint8_t*)>& write, const std::function<void()>& read) {
    const uint64_t g = ++pieces_;
    RankState& me = segment_->rank(rank());
    await([&](int r) { return segment_->rank(r).consumed.load() >= g - 1; }, "to finish reading the last piece");
    if (write) write(slotOf(rank()));
    me.posted.store(g);
    wake();
    await([&](int r) { return segment_->rank(r).posted.load() >= g; }, "to arrive");
    if (read) read();
    me.consumed.store(g);
    wake();
  }

  void wake() {
    SegmentHeader& h = segment_->header();
    if (h.sleepers.load() == 0) return;
    h.futexWord.fetch_add(1);
    futexWakeAll(&h.futexWord);
  }

  // Until ready(r) for every rank: a short spin, then futex sleeps; throws at the
  // operation's deadline, when an awaited rank gave up or exited, or at destruction.
  template <typename Ready>
  void await(const Ready& ready, const char* waitingFor) {
    const auto allReady = [&] {
      for (int r = 0; r < worldSize(); ++r) {
        if (!ready(r)) return false;
      }
      return true;
    };
    for (int spin = 0; spin < 100; ++spin) {
      if (allReady()) return;
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
    SegmentHeader& h = segment_->header();
    const auto start = Clock::now();
    auto nextCheck = start + kLivenessEvery;
    std::vector<Clock::time_point> stoppedSince(worldSize());  // when each peer was first seen stopped
    // A line now and then while a rank is missing (as gloo's waits say): a stopped or stuck
    // rank otherwise leaves the others silent for the whole timeout.
    const auto every = std::clamp<std::chrono::milliseconds>(current_.timeout / 5, std::chrono::seconds(1),
                                                             std::chrono::seconds(30));
    auto nextLine = start + every;
    const auto missingRanks = [&] {
      std::string missing;
      for (int r = 0; r < worldSize(); ++r) {
        if (!ready(r)) missing += strCat(missing.empty() ? "" : ", ", r);
      }
      return missing;
    };
    while (true) {
      h.sleepers.fetch_add(1);
      const uint32_t seen = h.futexWord.load();
      if (allReady()) {
        h.sleepers.fetch_sub(1);
        return;
      }
      futexWait(&h.futexWord, seen, kLivenessEvery);
      h.sleepers.fetch_sub(1);
      if (allReady()) return;
      const auto now = Clock::now();
      if (executor_->aborting().load()) throw Error(strCat(current_.what, ": the communicator was destroyed"));
      if (commAborted(health())) {
        throw PeerLostError(strCat(current_.what, ": aborted by this process (its replica groups are changing)"));
      }
      if (now >= nextCheck) {
        for (int r = 0; r < worldSize(); ++r) {
          if (ready(r)) continue;
          const RankState& peer = segment_->rank(r);
          if (peer.gaveUp.load() != 0) {
            throw PeerLostError(strCat(current_.what, ": rank ", r, " left the operation with an error"));
          }
          const char state = processState(peer.pid.load());
          if (state == 'X' || state == 'Z') {
            throw PeerLostError(strCat(current_.what, ": rank ", r, " (process ", peer.pid.load(), ") exited"));
          }
          // CommOptions::lostWhenStoppedFor: a peer stopped (SIGSTOP, a hung node's freeze) that
          // long is as lost as one that exited.
          const auto stopLimit = options().lostWhenStoppedFor;
          if (stopLimit.count() > 0 && state == 'T') {
            if (stoppedSince[r] == Clock::time_point{}) stoppedSince[r] = now;
            if (now - stoppedSince[r] >= stopLimit) {
              throw PeerLostError(strCat(current_.what, ": rank ", r, " (process ", peer.pid.load(), ") stopped for ",
                                         formatDuration(stopLimit), " (SIGSTOP)"));
            }
          } else {
            stoppedSince[r] = Clock::time_point{};
          }
        }
        nextCheck = now + kLivenessEvery;
      }
      if (now >= current_.deadline) {
        throw TimeoutError(strCat("ShmCommunicator: timed out after ", formatDuration(current_.timeout), ": ",
                                  current_.what, ", waiting for rank(s) ", missingRanks(), " ", waitingFor));
      }
      if (now >= nextLine) {
        TLOG_WARN("ShmCommunicator: " << current_.what << " has waited "
                  << formatDuration(std::chrono::duration_cast<std::chrono::milliseconds>(now - start))
                  << " for the other ranks (timeout " << formatDuration(current_.timeout)
                  << "): one has not joined it (rank(s) " << missingRanks()
                  << ": stopped, stuck or slow); at the timeout the run stops and tessera-run's verdict names it");
        nextLine = now + every;
      }
    }
  }

  struct Current {
    std::string what;
    Clock::time_point deadline;
    std::chrono::milliseconds timeout{0};
  };

  std::shared_ptr<Store> store_;
  ShmOptions shm_;
  std::unique_ptr<Segment> segment_;
  std::shared_ptr<Executor> executor_;
  uint64_t pieces_ = 0;  // pieces run so far; only the executing thread touches it
  Current current_;       // the operation running now (executing thread only)
};

}  // namespace

std::shared_ptr<Communicator> makeShmCommunicator(std::shared_ptr<Store> store, int rank, int world,
                                                  const ShmOptions& options) {
  return std::make_shared<ShmCommunicator>(std::move(store), rank, world, options);
}

}  // namespace tessera::distributed
