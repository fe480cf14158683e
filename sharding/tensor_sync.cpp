// Coalesced broadcast / all-reduce of tensor lists (see tensor_sync.h).
#include "sharding/tensor_sync.h"

#include <c10/core/GradMode.h>
#include <functional>
#include <map>

#include "common/errors.h"

namespace tessera::sharding {
namespace {

// Groups tensors by dtype (first-seen order within a dtype), packs each group into flat
// buffers of at most bucketBytes, runs `collective` on each buffer and copies back.
void coalesced(const std::vector<at::Tensor>& tensors, int64_t bucketBytes,
               const std::function<void(const at::Tensor&)>& collective) {
  TESSERA_CHECK_AS(ConfigError, bucketBytes > 0, "coalesced collective: bucket size must be > 0, got ", bucketBytes);
  std::map<int, std::vector<at::Tensor>> byType;  // ordered: every rank walks dtypes alike
  for (const at::Tensor& t : tensors) {
    TESSERA_CHECK(t.defined(), "coalesced collective: undefined tensor in the list");
    if (t.numel() > 0) byType[static_cast<int>(t.scalar_type())].push_back(t.detach());
  }
  c10::NoGradGuard noGrad;
  for (auto& [type, group] : byType) {
    size_t begin = 0;
    while (begin < group.size()) {
      size_t end = begin;
      int64_t numel = 0;
      const int64_t elementBytes = static_cast<int64_t>(group[begin].element_size());
      while (end < group.size() && (end == begin || (numel + group[end].numel()) * elementBytes <= bucketBytes)) {
        numel += group[end].numel();
        ++end;
      }
      at::Tensor flat = at::empty({numel}, group[begin].options());
      int64_t offset = 0;
      for (size_t i = begin; i < end; ++i) {
        flat.narrow(0, offset, group[i].numel()).copy_(group[i].reshape({-1}));
        offset += group[i].numel();
      }
      collective(flat);
      offset = 0;
      for (size_t i = begin; i < end; ++i) {
        group[i].copy_(flat.narrow(0, offset, group[i].numel()).view(group[i].sizes()));
        offset += group[i].numel();
      }
      begin = end;
    }
  }
}

}  // namespace

void broadcastCoalesced(const std::vector<at::Tensor>& tensors, distributed::Communicator& comm, int root,
                        int64_t bucketBytes) {
  if (comm.worldSize() == 1) return;
  coalesced(tensors, bucketBytes, [&](const at::Tensor& flat) { comm.broadcast(flat, root); });
}

void allReduceCoalesced(const std::vector<at::Tensor>& tensors, distributed::Communicator& comm,
                        distributed::ReduceOp op, int64_t bucketBytes) {
  if (comm.worldSize() == 1) return;
  coalesced(tensors, bucketBytes, [&](const at::Tensor& flat) { comm.allReduce(flat, op); });
}

}  // namespace tessera::sharding
