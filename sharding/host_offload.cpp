// Host-resident masters and gradient shards for zero3 (see host_offload.h).
#include "sharding/host_offload.h"

#include <c10/core/impl/VirtualGuardImpl.h>

namespace tessera::sharding {

HostOffload::HostOffload(at::Device device) : device_(device) {
  if (!usesStreams()) return;
  const c10::impl::VirtualGuardImpl impl(device_.type());
  if (!device_.has_index()) device_ = impl.getDevice();
  upload_ = impl.getStreamFromGlobalPool(device_);
  download_ = impl.getStreamFromGlobalPool(device_);
}

at::TensorOptions HostOffload::hostOptions() const {
  return at::TensorOptions().dtype(at::kFloat).device(at::kCPU).pinned_memory(usesStreams());
}

c10::Stream HostOffload::currentStream() const {
  return c10::impl::VirtualGuardImpl(device_.type()).getStream(device_);
}

HostOffload::UploadScope::UploadScope(HostOffload* offload) {
  if (offload == nullptr || !offload->usesStreams()) return;
  c10::Event queued(offload->device_.type());
  queued.record(offload->currentStream());
  queued.block(*offload->upload_);
  guard_.emplace(*offload->upload_);
}

at::Tensor HostOffload::upload(const at::Tensor& host) const {
  return host.to(device_, host.scalar_type(), /*non_blocking=*/true);
}

c10::Event HostOffload::markUploaded() const {
  c10::Event event(device_.type());
  if (usesStreams()) event.record(*upload_);
  return event;
}

void HostOffload::waitOn(const c10::Event& event) const {
  if (usesStreams()) event.block(currentStream());
}

void HostOffload::download(const at::Tensor& host, const at::Tensor& deviceTensor) const {
  if (!usesStreams()) {
    host.copy_(deviceTensor);
    return;
  }
  c10::Event reduced(device_.type());
  reduced.record(currentStream());
  reduced.block(*download_);
  {
    const c10::StreamGuard onDownload(*download_);
    host.copy_(deviceTensor, /*non_blocking=*/true);
  }
  // Freed by the caller on the compute stream: kept from reuse until the copy has run.
  deviceTensor.record_stream(*download_);
}

void HostOffload::finishCopies() const {
  if (!usesStreams()) return;
  const c10::impl::VirtualGuardImpl impl(device_.type());
  impl.synchronizeStream(*upload_);
  impl.synchronizeStream(*download_);
}

}  // namespace tessera::sharding
