// fp32 CPU matrix products through oneDNN's sgemm, with their backward (see cpu_matmul.h).
#include "kernels/cpu_matmul.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <torch/csrc/autograd/custom_function.h>

#include <chrono>
#include <cstdlib>

#ifdef TESSERA_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#endif

#include "common/errors.h"

namespace tessera::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

CpuMatmulPath readPath() {
  const char* value = std::getenv("TESSERA_CPU_MATMUL");
  const std::string chosen = value == nullptr ? "" : value;
  if (chosen == "aten") return CpuMatmulPath::kAten;
  if (!chosen.empty() && chosen != "onednn") {
    throw ConfigError(strCat("TESSERA_CPU_MATMUL='", chosen, "': expected onednn or aten"));
  }
#ifdef TESSERA_HAVE_ONEDNN
  return CpuMatmulPath::kOnednn;
#else
  if (chosen == "onednn") throw ConfigError("TESSERA_CPU_MATMUL=onednn: this build has no oneDNN (install libdnnl-dev)");
  return CpuMatmulPath::kAten;
#endif
}

// Whether fp32 products of these tensors go through oneDNN.
bool onednnTakes(std::initializer_list<const at::Tensor*> tensors) {
  if (cpuMatmulPath() != CpuMatmulPath::kOnednn) return false;
  for (const at::Tensor* t : tensors) {
    if (!t->defined()) continue;
    if (!t->device().is_cpu() || t->scalar_type() != at::kFloat || t->layout() != at::kStrided || t->numel() == 0) {
      return false;
    }
  }
  return true;
}

// C[i] = op(A[i]) op(B[i]) + beta C[i] for `batch` row-major matrices: op(A) is m x k, op(B)
// k x n, C m x n; a transposed operand is stored as the transpose's rows.
void sgemmBatch(bool transA, bool transB, int64_t batch, int64_t m, int64_t n, int64_t k, const float* a,
                const float* b, float beta, float* c) {
#ifdef TESSERA_HAVE_ONEDNN
  const int64_t lda = transA ? m : k;
  const int64_t ldb = transB ? k : n;
  const auto one = [&](int64_t i) {
    const dnnl_status_t status = dnnl_sgemm(transA ? 'T' : 'N', transB ? 'T' : 'N', m, n, k, 1.0f, a + i * m * k, lda,
                                            b + i * k * n, ldb, beta, c + i * m * n, n);
    if (status != dnnl_success) {
      throw Error(strCat("oneDNN sgemm of ", m, "x", k, " by ", k, "x", n, " failed with status ", status));
    }
  };
  if (batch == 1) {
    one(0);  // oneDNN spreads one product over the intra-op threads itself
    return;
  }
  // Many small products (attention's, per head): one per thread, each single-threaded.
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) one(i);
  });
#else
  (void)transA, (void)transB, (void)batch, (void)m, (void)n, (void)k, (void)a, (void)b, (void)beta, (void)c;
  throw Error("oneDNN sgemm called in a build without oneDNN");
#endif
}

// out = op(a) op(b) over a batch of contiguous fp32 matrices.
at::Tensor product(const at::Tensor& a, bool transA, const at::Tensor& b, bool transB) {
  const int64_t batch = a.size(0);
  const int64_t m = transA ? a.size(2) : a.size(1);
  const int64_t k = transA ? a.size(1) : a.size(2);
  const int64_t n = transB ? b.size(1) : b.size(2);
  at::Tensor out = at::empty({batch, m, n}, a.options());
  sgemmBatch(transA, transB, batch, m, n, k, a.data_ptr<float>(), b.data_ptr<float>(), 0.0f, out.data_ptr<float>());
  return out;
}

// y = x W^T (+ b), saving what the backward needs. Two autograd functions share it: one
// with a bias and one without, since an undefined tensor cannot be an autograd input.
at::Tensor linearForward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const int64_t in = weight.size(1);
  const int64_t out = weight.size(0);
  const at::Tensor rows = x.reshape({-1, in}).contiguous();
  const at::Tensor w = weight.contiguous();
  const int64_t m = rows.size(0);
  at::Tensor y = at::empty({m, out}, x.options());
  float beta = 0.0f;
  if (bias.defined()) {
    y.copy_(bias.expand({m, out}));
    beta = 1.0f;
  }
  sgemmBatch(false, true, 1, m, out, in, rows.data_ptr<float>(), w.data_ptr<float>(), beta, y.data_ptr<float>());
  ctx->save_for_backward({rows, w});
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out;
  return y.view(shape);
}

// dx = g W, dW = g^T x, db = the sum of g over rows: each only when its input needs it.
variable_list linearBackward(AutogradContext* ctx, const at::Tensor& gradOut, bool hasBias) {
  const auto saved = ctx->get_saved_variables();
  const at::Tensor& rows = saved[0];
  const at::Tensor& w = saved[1];
  const at::Tensor g = gradOut.reshape({-1, w.size(0)}).contiguous();
  variable_list grads(hasBias ? 3 : 2);
  if (ctx->needs_input_grad(0)) {
    std::vector<int64_t> shape = gradOut.sizes().vec();
    shape.back() = w.size(1);
    grads[0] = product(g.unsqueeze(0), false, w.unsqueeze(0), false).view(shape);
  }
  if (ctx->needs_input_grad(1)) grads[1] = product(g.unsqueeze(0), true, rows.unsqueeze(0), false).squeeze(0);
  if (hasBias && ctx->needs_input_grad(2)) grads[2] = g.sum(0);
  return grads;
}

struct OnednnLinear : public torch::autograd::Function<OnednnLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias) {
    return linearForward(ctx, x, weight, bias);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return linearBackward(ctx, grads[0], true);
  }
};

struct OnednnLinearNoBias : public torch::autograd::Function<OnednnLinearNoBias> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    return linearForward(ctx, x, weight, at::Tensor());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return linearBackward(ctx, grads[0], false);
  }
};

struct OnednnBatchedMatmul : public torch::autograd::Function<OnednnBatchedMatmul> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
    const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
    const at::Tensor left = a.reshape({-1, m, k}).contiguous();
    const at::Tensor right = b.reshape({-1, k, n}).contiguous();
    ctx->save_for_backward({left, right});
    std::vector<int64_t> shape = a.sizes().vec();
    shape.back() = n;
    return product(left, false, right, false).view(shape);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& left = saved[0];
    const at::Tensor& right = saved[1];
    const at::Tensor& gradOut = grads[0];
    const at::Tensor g = gradOut.reshape({left.size(0), left.size(1), right.size(2)}).contiguous();
    at::Tensor gradA, gradB;
    if (ctx->needs_input_grad(0)) {
      std::vector<int64_t> shape = gradOut.sizes().vec();
      shape.back() = left.size(2);
      gradA = product(g, false, right, true).view(shape);
    }
    if (ctx->needs_input_grad(1)) {
      std::vector<int64_t> shape = gradOut.sizes().vec();
      shape[shape.size() - 2] = right.size(1);
      gradB = product(left, true, g, false).view(shape);
    }
    return {gradA, gradB};
  }
};

}  // namespace

bool haveOnednn() {
#ifdef TESSERA_HAVE_ONEDNN
  return true;
#else
  return false;
#endif
}

CpuMatmulPath cpuMatmulPath() {
  static const CpuMatmulPath path = readPath();
  return path;
}

std::string openblasCoreName() {
  using CoreName = char* (*)();
  const auto corename = reinterpret_cast<CoreName>(::dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  const char* name = corename != nullptr ? corename() : nullptr;
  return name != nullptr ? name : "";
}

std::string cpuMatmulPathName(CpuMatmulPath path) {
  if (path == CpuMatmulPath::kOnednn) return "oneDNN sgemm";
  const std::string core = openblasCoreName();
  return core.empty() ? "LibTorch (its BLAS)" : strCat("LibTorch (OpenBLAS, ", core, " kernel)");
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (!onednnTakes({&x, &weight, &bias}) || weight.dim() != 2 || x.dim() < 1 || x.size(-1) != weight.size(1)) {
    return at::linear(x, weight, bias);  // also the one to name a shape mismatch
  }
  return bias.defined() ? OnednnLinear::apply(x, weight, bias) : OnednnLinearNoBias::apply(x, weight);
}

at::Tensor batchedMatmul(const at::Tensor& a, const at::Tensor& b) {
  if (!onednnTakes({&a, &b}) || a.dim() < 2 || a.dim() != b.dim() || a.size(-1) != b.size(-2) ||
      a.sizes().slice(0, a.dim() - 2) != b.sizes().slice(0, b.dim() - 2)) {
    return at::matmul(a, b);
  }
  return OnednnBatchedMatmul::apply(a, b);
}

double measureCpuSgemmFlops(CpuMatmulPath path, int64_t m, int64_t n, int64_t k, double seconds) {
  const at::Tensor a = at::randn({m, k});
  const at::Tensor b = at::randn({k, n});
  at::Tensor c = at::empty({m, n});
  const auto once = [&] {
    if (path == CpuMatmulPath::kOnednn) {
      sgemmBatch(false, false, 1, m, n, k, a.data_ptr<float>(), b.data_ptr<float>(), 0.0f, c.data_ptr<float>());
    } else {
      at::mm_out(c, a, b);
    }
  };
  once();  // warm-up: kernels chosen (oneDNN compiles its kernel for this core), pages touched
  const auto start = std::chrono::steady_clock::now();
  int64_t reps = 0;
  double elapsed = 0;
  while (reps < 2 || elapsed < seconds) {
    once();
    ++reps;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) * static_cast<double>(reps) /
         elapsed;
}

}  // namespace tessera::kernels
