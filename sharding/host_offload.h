// HostOffload: zero3's CPU offload (FSDP2's CPUOffloadPolicy). The fp32 master shards, the
// gradient shards and so the optimizer state live in host memory (page-locked when the
// model is on a GPU, so copies run asynchronously); each unit's shard goes to the GPU just
// before its all-gather and its reduced gradients come back after the reduce-scatter.
// Copies run on two streams of their own (upload, download), ordered against the compute
// stream with events, so they overlap the units' compute. The optimizer then steps on the
// host (the fused CPU AdamW, on every core).
//
// Device-generic (c10's stream and event interfaces): on a CPU model there are no streams,
// the copies are plain and the masters stay where they were (host memory already).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>

#include <optional>

namespace tessera::sharding {

class HostOffload {
 public:
  // `device`: where the model computes (its parameters' device).
  explicit HostOffload(at::Device device);

  // Options of the host tensors: fp32 on the CPU, pinned when the device is a GPU.
  at::TensorOptions hostOptions() const;

  // Work between its construction and its end runs on the upload stream, after
  // everything the compute stream has queued so far (buffers it fills may be blocks the
  // compute stream freed a moment ago). Collectives issued inside it wait for the upload.
  class UploadScope {
   public:
    explicit UploadScope(HostOffload* offload);  // null: no offload, nothing changes

   private:
    std::optional<c10::StreamGuard> guard_;
  };
  // `host` (in host memory) as a device tensor, copied asynchronously; call inside an
  // UploadScope (the copy and its staging buffer belong to the upload stream).
  at::Tensor upload(const at::Tensor& host) const;
  // An event on the upload stream after what it has queued; the compute stream waits on
  // it with waitOn before it reads what was uploaded.
  c10::Event markUploaded() const;
  void waitOn(const c10::Event& event) const;

  // Copies `deviceTensor` into `host` on the download stream, after what the compute
  // stream has queued (the reduction that produced it); `deviceTensor`'s memory is not
  // reused before the copy has read it. The host tensor is valid after finishCopies().
  void download(const at::Tensor& host, const at::Tensor& deviceTensor) const;
  // Blocks until every copy queued so far, both ways, is done: the host may then read the
  // downloaded gradients and write the masters (an upload may still be reading them, e.g.
  // of a unit prefetched and never entered).
  void finishCopies() const;

 private:
  bool usesStreams() const { return !device_.is_cpu(); }
  c10::Stream currentStream() const;
  at::Device device_;
  std::optional<c10::Stream> upload_, download_;
};

}  // namespace tessera::sharding
