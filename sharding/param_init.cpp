// Deferred parameters and counter-based initial values (see param_init.h).
#include "sharding/param_init.h"

#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#ifdef TESSERA_TORCH_HAS_CUDA
#include <ATen/native/cuda/Resize.h>
#endif
#include <ATen/native/Resize.h>
#include <torch/nn/module.h>
#include <xxhash.h>

#include <cmath>
#include <sstream>

#include "common/counter_rng.h"
#include "common/errors.h"

namespace tessera::sharding {

std::string ParamInit::str() const {
  std::ostringstream s;
  switch (kind) {
    case Kind::kUniform: s << "uniform(" << a << ", " << b << ")"; break;
    case Kind::kNormal: s << "normal(" << a << ", " << b << ")"; break;
    case Kind::kConstant: s << "constant(" << a << ")"; break;
  }
  return s.str();
}

void fillRows(const ParamInit& init, uint64_t seed, const std::string& name, int64_t rowBegin, const at::Tensor& rows) {
  TESSERA_CHECK(rows.defined() && rows.is_floating_point(), "fillRows: '", name, "': rows must be a floating tensor");
  const int64_t n = rows.numel();
  if (n == 0) return;
  const int64_t rowCount = rows.dim() == 0 ? 1 : rows.size(0);
  const int64_t rowNumel = n / rowCount;
  const int64_t first = rowBegin * rowNumel;  // global index of rows' first element
  // The stream of this parameter: its name hashed with the seed (stable across builds and
  // platforms, unlike std::hash).
  const uint64_t key = XXH3_64bits_withSeed(name.data(), name.size(), seed);
  at::Tensor values = at::empty({n}, at::TensorOptions().dtype(at::kDouble));
  double* out = values.data_ptr<double>();
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const uint64_t i = static_cast<uint64_t>(first + j);
      switch (init.kind) {
        case ParamInit::Kind::kConstant:
          out[j] = init.a;
          break;
        case ParamInit::Kind::kUniform:
          out[j] = init.a + (init.b - init.a) * uniform01(counterBits(key, i));
          break;
        case ParamInit::Kind::kNormal: {
          // Box-Muller from two draws of element i's own pair of counters.
          const double u1 = uniform01(counterBits(key, 2 * i));
          const double u2 = uniform01(counterBits(key, 2 * i + 1));
          out[j] = init.a + init.b * std::sqrt(-2.0 * std::log1p(-u1)) * std::cos(2.0 * M_PI * u2);
          break;
        }
      }
    }
  });
  c10::NoGradGuard noGrad;
  rows.copy_(values.view(rows.sizes()));
}

at::Tensor deferredTensor(const std::vector<int64_t>& shape, const at::TensorOptions& options) {
  at::Tensor t = at::empty({0}, options);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return t;
}

bool hasNoStorage(const at::Tensor& tensor) {
  if (!tensor.defined() || tensor.numel() == 0) return false;
  const int64_t needed = (tensor.storage_offset() + tensor.numel()) * static_cast<int64_t>(tensor.element_size());
  return static_cast<int64_t>(tensor.storage().nbytes()) < needed;
}

void setStorageBytes(const at::Tensor& tensor, size_t bytes) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == bytes) return;
#ifdef TESSERA_TORCH_HAS_CUDA
  if (tensor.is_cuda()) {
    at::native::resize_bytes_cuda(storage, bytes);  // through the caching allocator
    return;
  }
#endif
  at::native::resize_bytes_cpu(storage, bytes);
}

void materializeAll(torch::nn::Module& module, const ParamInitializer& initializer) {
  c10::NoGradGuard noGrad;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (!hasNoStorage(p)) continue;
    TESSERA_CHECK(initializer != nullptr, "materializeAll: parameter '", item.key(), "' is deferred and there is no initializer");
    TESSERA_CHECK(p.is_contiguous() && p.storage_offset() == 0, "materializeAll: deferred parameter '", item.key(),
                  "' must be contiguous");
    setStorageBytes(p, static_cast<size_t>(p.numel()) * p.element_size());
    const int64_t rows = p.dim() == 0 ? 1 : p.size(0);
    at::Tensor values = at::empty({rows, p.numel() / std::max<int64_t>(rows, 1)}, p.options().dtype(at::kFloat));
    initializer(item.key(), 0, values);
    p.detach().view({rows, -1}).copy_(values);
  }
}

}  // namespace tessera::sharding
