// Deferred parameters and counter-based initial values (see param_init.h).
#include "dtensor/param_init.h"

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

namespace tessera::dtensor {

std::string ParamInit::str() const {
  std::ostringstream s;
  switch (kind) {
    case Kind::kUniform: s << "uniform(" << a << ", " << b << ")"; break;
    case Kind::kNormal: s << "normal(" << a << ", " << b << ")"; break;
    case Kind::kConstant: s << "constant(" << a << ")"; break;
    case Kind::kSinCos2d: s << "sincos2d(" << a << ", " << b << ")"; break;
  }
  return s.str();
}

namespace {

// The value of element i (row-major, global) of a parameter with stream `key`.
double valueAt(const ParamInit& init, uint64_t key, uint64_t i) {
  switch (init.kind) {
    case ParamInit::Kind::kConstant:
      return init.a;
    case ParamInit::Kind::kUniform:
      return init.a + (init.b - init.a) * uniform01(counterBits(key, i));
    case ParamInit::Kind::kNormal: {
      // Box-Muller from two draws of element i's own pair of counters.
      const double u1 = uniform01(counterBits(key, 2 * i));
      const double u2 = uniform01(counterBits(key, 2 * i + 1));
      return init.a + init.b * std::sqrt(-2.0 * std::log1p(-u1)) * std::cos(2.0 * M_PI * u2);
    }
    case ParamInit::Kind::kSinCos2d: {
      const auto grid = static_cast<uint64_t>(init.a), dim = static_cast<uint64_t>(init.b);
      const uint64_t token = i / dim, k = i % dim, half = dim / 2, quarter = dim / 4;
      const uint64_t position = k < half ? token % grid : token / grid;  // column, then row
      const uint64_t j = k % half;
      const double omega = 1.0 / std::pow(10000.0, static_cast<double>(j % quarter) / static_cast<double>(quarter));
      const double angle = static_cast<double>(position) * omega;
      return j < quarter ? std::sin(angle) : std::cos(angle);
    }
  }
  return 0.0;
}

}  // namespace

void fillRows(const ParamInit& init, uint64_t seed, const std::string& name, int64_t rowBegin, const at::Tensor& rows) {
  TESSERA_CHECK(rows.defined() && rows.is_floating_point(), "fillRows: '", name, "': rows must be a floating tensor");
  const int64_t n = rows.numel();
  if (n == 0) return;
  const int64_t rowCount = rows.dim() == 0 ? 1 : rows.size(0);
  const int64_t first = rowBegin * (n / rowCount);  // global index of rows' first element
  // The stream of this parameter: its name hashed with the seed (stable across builds and
  // platforms, unlike std::hash).
  const uint64_t key = XXH3_64bits_withSeed(name.data(), name.size(), seed);
  c10::NoGradGuard noGrad;
  if (rows.device().is_cpu() && rows.scalar_type() == at::kFloat && rows.is_contiguous()) {
    // Straight into the destination: no temporary as large as the rows (a set-up that
    // allocates and frees one per tensor leaves the heap fragmented, and resident).
    float* out = rows.data_ptr<float>();
    at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) out[j] = static_cast<float>(valueAt(init, key, static_cast<uint64_t>(first + j)));
    });
    return;
  }
  // Other dtypes or devices: through a CPU double buffer, a block of rows at a time.
  const at::Tensor flat = rows.view({-1});
  constexpr int64_t kBlock = 1 << 18;
  at::Tensor block = at::empty({std::min(n, kBlock)}, at::TensorOptions().dtype(at::kDouble));
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t count = std::min(kBlock, n - start);
    double* out = block.data_ptr<double>();
    at::parallel_for(0, count, 1 << 14, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) out[j] = valueAt(init, key, static_cast<uint64_t>(first + start + j));
    });
    flat.narrow(0, start, count).copy_(block.narrow(0, 0, count));
  }
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
    p.detach().copy_(fullInitialValue(initializer, item.key(), p.sizes(), p.device()));
  }
}

at::Tensor fullInitialValue(const ParamInitializer& initializer, const std::string& name, at::IntArrayRef shape,
                            at::Device device) {
  at::Tensor full = at::empty(shape, at::TensorOptions().dtype(at::kFloat).device(device));
  if (full.numel() == 0) return full;
  const int64_t rows = shape.empty() ? 1 : shape[0];
  initializer(name, 0, full.view({rows, full.numel() / rows}));
  return full;
}

}  // namespace tessera::dtensor
