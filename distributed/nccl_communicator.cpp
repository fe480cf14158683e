// Communicator over NCCL called directly, with its own CUDA streams ordered against the
// caller's stream by events (see nccl_communicator.h). Compiled only with
// TESSERA_WITH_CUDA; uses the CUDA runtime API on raw pointers, plus c10's current
// stream and caching allocator when LibTorch itself has CUDA (TESSERA_TORCH_HAS_CUDA).
#include "distributed/nccl_communicator.h"

#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#if defined(TESSERA_TORCH_HAS_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "common/errors.h"
#include "common/logging.h"
#include "distributed/rendezvous.h"

#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < NCCL_VERSION(2, 7, 0)
#error "Tessera's nccl backend needs NCCL >= 2.7 (ncclSend/ncclRecv)"
#endif
// Non-blocking communicators (ncclConfig_t, ncclCommInitRankConfig) arrived in 2.14.
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0)
#define TESSERA_NCCL_NONBLOCKING 1
#else
#define TESSERA_NCCL_NONBLOCKING 0
#endif

namespace tessera::distributed {
namespace {

using Clock = std::chrono::steady_clock;

void cudaCheck(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) {
    throw Error(strCat(what, ": CUDA error ", cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
  }
}

// Makes `device` current for the scope (NCCL and stream calls act on the current device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaCheck(cudaGetDevice(&previous_), "NcclCommunicator: cudaGetDevice");
    if (previous_ != device) cudaCheck(cudaSetDevice(device), strCat("NcclCommunicator: cudaSetDevice(", device, ")"));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// The stream compute runs on: c10's current stream, or the legacy default stream.
cudaStream_t currentStream(int device) {
#if defined(TESSERA_TORCH_HAS_CUDA)
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
#else
  (void)device;
  return nullptr;
#endif
}

c10::optional<ncclDataType_t> ncclTypeOf(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kChar: return ncclInt8;
    case at::kByte: return ncclUint8;
    case at::kBool: return ncclUint8;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    default: return c10::nullopt;
  }
}

ncclRedOp_t ncclOpOf(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;
}

// The NCCL communicator and what its handles need; shared by communicator and handles.
struct NcclState {
  ncclComm_t comm = nullptr;
  int device = 0;
  bool nonBlocking = false;
  bool aborted = false;
  std::mutex mutex;  // NCCL calls on one communicator are serialised

  std::string lastError() const {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
    const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
    return last != nullptr && *last != '\0' ? strCat(" (", last, ")") : std::string();
#else
    return std::string();
#endif
  }

  void abort() {
    if (comm != nullptr && !aborted) {
      ncclCommAbort(comm);
      aborted = true;
    }
  }

  // Waits until an NCCL call's result leaves ncclInProgress (non-blocking communicators);
  // aborts the communicator and throws TimeoutError after `deadline`.
  void settle(ncclResult_t result, Clock::time_point deadline, const std::string& what,
              const std::chrono::milliseconds timeout) {
    while (result == ncclInProgress) {
      if (Clock::now() >= deadline) {
        abort();
        throw TimeoutError(strCat(what, ": timed out after ", formatDuration(timeout)));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      ncclCommGetAsyncError(comm, &result);
    }
    if (result != ncclSuccess) {
      const std::string message = strCat(what, ": NCCL error ", ncclGetErrorString(result), lastError());
      abort();
      throw Error(message);
    }
  }
};

class NcclHandle final : public CommHandle {
 public:
  NcclHandle(std::shared_ptr<NcclState> state, cudaEvent_t done, std::vector<at::Tensor> keepAlive, std::string method,
             std::string what, std::chrono::milliseconds timeout, bool blocking, std::shared_ptr<CommHealth> health)
      : state_(std::move(state)),
        done_(done),
        keepAlive_(std::move(keepAlive)),
        method_(std::move(method)),
        what_(std::move(what)),
        timeout_(timeout),
        blocking_(blocking),
        health_(std::move(health)) {}

  ~NcclHandle() override {
    if (done_ != nullptr) cudaEventDestroy(done_);
  }

  void wait() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (waited_) {
      if (error_) std::rethrow_exception(error_);
      return;
    }
    waited_ = true;
    try {
      DeviceGuard guard(state_->device);
      if (blocking_) blockUntilDone();
      // Later work on the caller's stream runs after the operation.
      cudaCheck(cudaStreamWaitEvent(currentStream(state_->device), done_, 0),
                strCat("NcclCommunicator::", method_, ": cudaStreamWaitEvent"));
    } catch (const std::exception& e) {
      markCommBroken(health_, e.what());
      error_ = std::current_exception();
      throw;
    }
    keepAlive_.clear();
  }

  bool isCompleted() override { return cudaEventQuery(done_) == cudaSuccess; }

 private:
  void blockUntilDone() {
    const auto deadline = Clock::now() + timeout_;
    for (;;) {
      const cudaError_t query = cudaEventQuery(done_);
      if (query == cudaSuccess) return;
      if (query != cudaErrorNotReady) {
        cudaCheck(query, strCat("NcclCommunicator::", method_, ": ", what_));
      }
      ncclResult_t async = ncclSuccess;
      {
        std::lock_guard<std::mutex> lock(state_->mutex);
        if (state_->aborted || state_->comm == nullptr) {
          throw Error(strCat("NcclCommunicator::", method_, ": communicator was aborted or destroyed: ", what_));
        }
        ncclCommGetAsyncError(state_->comm, &async);
        if (async != ncclSuccess && async != ncclInProgress) {
          const std::string message = strCat("NcclCommunicator::", method_, ": failed: ", what_, ": NCCL error ",
                                             ncclGetErrorString(async), state_->lastError());
          state_->abort();
          throw Error(message);
        }
        if (Clock::now() >= deadline) {
          state_->abort();  // frees the ranks stuck in this collective
          throw TimeoutError(strCat("NcclCommunicator::", method_, ": timed out after ", formatDuration(timeout_), ": ",
                                    what_));
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  std::mutex mutex_;
  std::shared_ptr<NcclState> state_;
  cudaEvent_t done_ = nullptr;
  std::vector<at::Tensor> keepAlive_;  // buffers stay allocated until wait()
  std::string method_;
  std::string what_;
  std::chrono::milliseconds timeout_;
  bool blocking_;
  std::shared_ptr<CommHealth> health_;
  bool waited_ = false;
  std::exception_ptr error_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<Store> store, int rank, int world, const NcclOptions& options)
      : Communicator(rank, world, options.comm),
        store_(std::move(store)),
        nccl_(options),
        state_(std::make_shared<NcclState>()) {
    TESSERA_CHECK_AS(UsageError, store_ != nullptr, "NcclCommunicator: no store");
    int device = options.device;
    if (device < 0) cudaCheck(cudaGetDevice(&device), "NcclCommunicator: cudaGetDevice");
    int deviceCount = 0;
    cudaCheck(cudaGetDeviceCount(&deviceCount), "NcclCommunicator: cudaGetDeviceCount");
    TESSERA_CHECK_AS(UsageError, device < deviceCount, "NcclCommunicator: device ", device, " does not exist (",
                     deviceCount, " CUDA devices) on ", describe());
    state_->device = device;
    DeviceGuard guard(device);

    const auto timeout = options.comm.timeout;
    const auto deadline = Clock::now() + timeout;
    const std::string prefix = groupKeyPrefix(*store_, options.comm.name, rank);
    try {
      waitForRanks(*store_, prefix + "/arrived", rank, world, timeout);
    } catch (const TimeoutError& e) {
      throw TimeoutError(strCat("NcclCommunicator: creating ", describe(), ": ", e.what()));
    }

    // Rank 0 of the group creates the id; the others read it from the store.
    ncclUniqueId id;
    const std::string idKey = prefix + "/nccl_unique_id";
    if (rank == 0) {
      const ncclResult_t r = ncclGetUniqueId(&id);
      TESSERA_CHECK(r == ncclSuccess, "NcclCommunicator: ncclGetUniqueId: ", ncclGetErrorString(r));
      store_->set(idKey, std::string(reinterpret_cast<const char*>(&id), sizeof id));
    } else {
      const std::string bytes = store_->get(idKey, timeout);
      TESSERA_CHECK(bytes.size() == sizeof id, "NcclCommunicator: store key ", idKey, " holds ", bytes.size(),
                    " bytes, expected an ncclUniqueId of ", sizeof id);
      std::memcpy(&id, bytes.data(), sizeof id);
    }

    const std::string what = strCat("NcclCommunicator: ncclCommInitRank for ", describe(), " on cuda:", device);
#if TESSERA_NCCL_NONBLOCKING
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // init and collectives return at once; we poll with a deadline
    state_->nonBlocking = true;
    const ncclResult_t init = ncclCommInitRankConfig(&state_->comm, world, id, rank, &config);
#else
    const ncclResult_t init = ncclCommInitRank(&state_->comm, world, id, rank);
#endif
    state_->settle(init, deadline, what, timeout);

    for (cudaStream_t* stream : {&allGatherStream_, &reduceScatterStream_, &otherStream_}) {
      cudaCheck(cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking), "NcclCommunicator: cudaStreamCreate");
    }
    cudaCheck(cudaMalloc(&barrierBuffer_, sizeof(float)), "NcclCommunicator: cudaMalloc");
    cudaCheck(cudaMemset(barrierBuffer_, 0, sizeof(float)), "NcclCommunicator: cudaMemset");
    TLOG_DEBUG("NcclCommunicator: " << describe() << " on cuda:" << device << " (" << prefix << ")");
  }

  ~NcclCommunicator() override {
    stopWatchdog();
    try {
      DeviceGuard guard(state_->device);
      std::lock_guard<std::mutex> lock(state_->mutex);
      if (state_->comm != nullptr && !state_->aborted) {
        // Finish queued work before destroying (a broken group is aborted instead).
        for (cudaStream_t stream : {allGatherStream_, reduceScatterStream_, otherStream_}) {
          if (stream != nullptr) cudaStreamSynchronize(stream);
        }
        ncclCommDestroy(state_->comm);
        state_->comm = nullptr;
      }
      for (cudaStream_t stream : {allGatherStream_, reduceScatterStream_, otherStream_}) {
        if (stream != nullptr) cudaStreamDestroy(stream);
      }
      if (barrierBuffer_ != nullptr) cudaFree(barrierBuffer_);
    } catch (...) {
      // Destructors never throw; CUDA is probably already shutting down.
    }
  }

  std::string backendName() const override { return "nccl"; }
  c10::Device tensorDevice() const override {
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(state_->device));
  }

 protected:
  std::shared_ptr<CommHandle> doAllGatherInto(const at::Tensor& flat_out, const at::Tensor& local_in) override {
    checkDevice("allGatherInto", flat_out);
    checkDevice("allGatherInto", local_in);
    const size_t bytes = static_cast<size_t>(tensorBytes(local_in));
    void* out = flat_out.data_ptr();
    const void* in = local_in.data_ptr();
    return launch("allGatherInto", describeOp("allGatherInto", local_in), allGatherStream_, {flat_out, local_in},
                  [=](ncclComm_t comm, cudaStream_t stream) {
                    return ncclAllGather(in, out, bytes, ncclUint8, comm, stream);
                  });
  }

  std::shared_ptr<CommHandle> doReduceScatter(const at::Tensor& local_out, const at::Tensor& flat_in,
                                              ReduceOp op) override {
    checkDevice("reduceScatter", local_out);
    checkDevice("reduceScatter", flat_in);
    const std::string what = describeOp("reduceScatter", flat_in, reduceOpName(op));
    const ncclDataType_t type = reduceType("reduceScatter", local_out, op, what);
    const size_t count = static_cast<size_t>(local_out.numel());
    void* out = local_out.data_ptr();
    const void* in = flat_in.data_ptr();
    const ncclRedOp_t redOp = ncclOpOf(op);
    return launch("reduceScatter", what, reduceScatterStream_, {local_out, flat_in},
                  [=](ncclComm_t comm, cudaStream_t stream) {
                    return ncclReduceScatter(in, out, count, type, redOp, comm, stream);
                  });
  }

  std::shared_ptr<CommHandle> doAllReduce(const at::Tensor& t, ReduceOp op) override {
    checkDevice("allReduce", t);
    const std::string what = describeOp("allReduce", t, reduceOpName(op));
    const ncclDataType_t type = reduceType("allReduce", t, op, what);
    const size_t count = static_cast<size_t>(t.numel());
    void* data = t.data_ptr();
    const ncclRedOp_t redOp = ncclOpOf(op);
    return launch("allReduce", what, otherStream_, {t}, [=](ncclComm_t comm, cudaStream_t stream) {
      return ncclAllReduce(data, data, count, type, redOp, comm, stream);
    });
  }

  std::shared_ptr<CommHandle> doBroadcast(const at::Tensor& t, int root) override {
    checkDevice("broadcast", t);
    const size_t bytes = static_cast<size_t>(tensorBytes(t));
    void* data = t.data_ptr();
    return launch("broadcast", describeOp("broadcast", t, strCat("root ", root).c_str()), otherStream_, {t},
                  [=](ncclComm_t comm, cudaStream_t stream) {
                    return ncclBroadcast(data, data, bytes, ncclUint8, root, comm, stream);
                  });
  }

  std::shared_ptr<CommHandle> doGatherToRoot(const at::Tensor& out, const at::Tensor& local_in, int root) override {
    checkDevice("gatherToRoot", local_in);
    const bool isRoot = rank() == root;
    if (isRoot) checkDevice("gatherToRoot", out);
    const size_t bytes = static_cast<size_t>(tensorBytes(local_in));
    const int world = worldSize();
    const int me = rank();
    char* outBase = isRoot ? static_cast<char*>(out.data_ptr()) : nullptr;
    const void* in = local_in.data_ptr();
    std::vector<at::Tensor> keep{local_in};
    if (isRoot) keep.push_back(out);
    // One group of point-to-point calls: NCCL has no gather collective.
    return launch("gatherToRoot", describeOp("gatherToRoot", local_in, strCat("root ", root).c_str()), otherStream_,
                  std::move(keep), [=](ncclComm_t comm, cudaStream_t stream) {
                    ncclResult_t first = ncclGroupStart();
                    auto note = [&first](ncclResult_t r) {
                      if (first == ncclSuccess) first = r;
                    };
                    if (isRoot) {
                      for (int r = 0; r < world; ++r) {
                        char* chunk = outBase + static_cast<size_t>(r) * bytes;
                        if (r == me) {
                          if (chunk != in) {
                            if (cudaMemcpyAsync(chunk, in, bytes, cudaMemcpyDeviceToDevice, stream) != cudaSuccess) {
                              note(ncclUnhandledCudaError);
                            }
                          }
                        } else {
                          note(ncclRecv(chunk, bytes, ncclUint8, r, comm, stream));
                        }
                      }
                    } else {
                      note(ncclSend(in, bytes, ncclUint8, root, comm, stream));
                    }
                    const ncclResult_t end = ncclGroupEnd();
                    return first == ncclSuccess || first == ncclInProgress ? end : first;
                  });
  }

  std::shared_ptr<CommHandle> doBarrier() override {
    float* buffer = barrierBuffer_;
    auto handle = launch("barrier", describeOp("barrier", at::Tensor()), otherStream_, {},
                         [=](ncclComm_t comm, cudaStream_t stream) {
                           return ncclAllReduce(buffer, buffer, 1, ncclFloat32, ncclSum, comm, stream);
                         },
                         /*forceBlocking=*/true);
    return handle;
  }

  std::shared_ptr<Communicator> doSplit(const std::vector<int>& ranks, int subRank, const std::string& name) override {
    NcclOptions sub = nccl_;
    sub.comm.name = name;
    sub.device = state_->device;
    return std::make_shared<NcclCommunicator>(store_, subRank, static_cast<int>(ranks.size()), sub);
  }

 private:
  void checkDevice(const char* method, const at::Tensor& t) const {
    TESSERA_CHECK_AS(UsageError, t.device().is_cuda() && t.device().index() == state_->device, "NcclCommunicator::",
                     method, ": tensor is on ", t.device(), " but ", describe(), " uses cuda:", state_->device);
  }

  ncclDataType_t reduceType(const char* method, const at::Tensor& t, ReduceOp op, const std::string& what) const {
    const auto type = ncclTypeOf(t.scalar_type());
    TESSERA_CHECK_AS(UsageError, type.has_value() && (t.scalar_type() != at::kBool || op == ReduceOp::kMax ||
                                                      op == ReduceOp::kMin),
                     "NcclCommunicator::", method, ": NCCL cannot reduce ", what);
    return *type;
  }

  // Orders `stream` after the caller's current stream, enqueues the NCCL call(s), records
  // the completion event. Throws (and aborts the group) when NCCL fails or stays busy past
  // the timeout.
  std::shared_ptr<CommHandle> launch(const char* method, std::string what, cudaStream_t stream,
                                     std::vector<at::Tensor> keepAlive,
                                     const std::function<ncclResult_t(ncclComm_t, cudaStream_t)>& enqueue,
                                     bool forceBlocking = false) {
    const auto timeout = opTimeout();
    const std::string context = strCat("NcclCommunicator::", method, ": ", what);
    DeviceGuard guard(state_->device);
    cudaEvent_t ready = nullptr;
    cudaEvent_t done = nullptr;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      TESSERA_CHECK(!state_->aborted, context, ": the communicator was aborted");
      cudaCheck(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), context);
      cudaCheck(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), context);
      cudaCheck(cudaEventRecord(ready, currentStream(state_->device)), context);
      cudaCheck(cudaStreamWaitEvent(stream, ready, 0), context);
      cudaEventDestroy(ready);  // released once the wait above no longer needs it
#if defined(TESSERA_TORCH_HAS_CUDA)
      // The caching allocator must not hand these blocks out again before `stream` is done.
      const auto commStream = c10::cuda::getStreamFromExternal(stream, static_cast<c10::DeviceIndex>(state_->device));
      for (const auto& t : keepAlive) {
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), commStream);
      }
#endif
      try {
        state_->settle(enqueue(state_->comm, stream), Clock::now() + timeout, context, timeout);
      } catch (const std::exception& e) {
        cudaEventDestroy(done);
        markCommBroken(health(), e.what());
        throw;
      }
      cudaCheck(cudaEventRecord(done, stream), context);
    }
    const bool blocking = forceBlocking || nccl_.blockingWait;
    if (!blocking) watch(stream, context, timeout);  // outside state_->mutex: the watchdog takes it
    return std::make_shared<NcclHandle>(state_, done, std::move(keepAlive), method, std::move(what), timeout, blocking,
                                        health());
  }

  // The watchdog. Non-blocking waits leave the host free to run ahead of the GPU, so no
  // wait() notices a collective that never finishes (a rank that stopped, a mismatched
  // call); this thread does. It polls each operation's completion in issue order and, past
  // the timeout, aborts the communicator (NCCL's kernels then return, so no stream stays
  // blocked and a host synchronise returns) and marks it broken: the next call on it
  // throws, naming the operation that timed out.
  struct Watched {
    cudaEvent_t done;
    Clock::time_point deadline;
    std::string what;
  };

  void watch(cudaStream_t stream, const std::string& context, std::chrono::milliseconds timeout) {
    cudaEvent_t done = nullptr;
    cudaCheck(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), context);
    cudaCheck(cudaEventRecord(done, stream), context);
    std::lock_guard<std::mutex> lock(watchMutex_);
    if (!watchdog_.joinable()) watchdog_ = std::thread([this] { watchLoop(); });
    watched_.push_back({done, Clock::now() + timeout, context});
  }

  void watchLoop() {
    cudaSetDevice(state_->device);
    std::unique_lock<std::mutex> lock(watchMutex_);
    while (!stopWatching_) {
      watchCv_.wait_for(lock, std::chrono::milliseconds(20));
      while (!watched_.empty()) {
        const Watched& w = watched_.front();
        if (cudaEventQuery(w.done) == cudaErrorNotReady) {
          if (Clock::now() < w.deadline) break;
          const std::string why =
              strCat(w.what, ": timed out after ", formatDuration(options().timeout), " (the watchdog aborted ",
                     describe(), ")");
          {
            std::lock_guard<std::mutex> state(state_->mutex);
            state_->abort();
          }
          markCommBroken(health(), why);
          TLOG_ERROR(why);
          for (const Watched& x : watched_) cudaEventDestroy(x.done);
          watched_.clear();
          break;
        }
        cudaEventDestroy(w.done);  // done (a CUDA error shows at the caller's next call)
        watched_.pop_front();
      }
    }
    for (const Watched& x : watched_) cudaEventDestroy(x.done);
    watched_.clear();
  }

  void stopWatchdog() {
    {
      std::lock_guard<std::mutex> lock(watchMutex_);
      stopWatching_ = true;
    }
    watchCv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
  }

  std::shared_ptr<Store> store_;
  NcclOptions nccl_;
  std::shared_ptr<NcclState> state_;
  cudaStream_t allGatherStream_ = nullptr;
  cudaStream_t reduceScatterStream_ = nullptr;
  cudaStream_t otherStream_ = nullptr;
  float* barrierBuffer_ = nullptr;
  std::mutex watchMutex_;
  std::condition_variable watchCv_;
  std::deque<Watched> watched_;
  bool stopWatching_ = false;
  std::thread watchdog_;
};

}  // namespace

std::shared_ptr<Communicator> makeNcclCommunicator(std::shared_ptr<Store> store, int rank, int world,
                                                   const NcclOptions& options) {
  return std::make_shared<NcclCommunicator>(std::move(store), rank, world, options);
}

}  // namespace tessera::distributed
