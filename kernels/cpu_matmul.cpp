// fp32 CPU matrix products through oneDNN's sgemm, or in bf16 through its matmul, with their
// backward (see cpu_matmul.h).
#include "kernels/cpu_matmul.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <unordered_map>

#ifdef TESSERA_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl.hpp>
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

std::atomic<at::ScalarType> linearDtype{at::kFloat};

// Whether these (defined) tensors are non-empty fp32 CPU tensors: the products Tessera's own
// paths take; everything else is LibTorch's.
bool fp32Cpu(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    if (!t->defined()) continue;
    if (!t->device().is_cpu() || t->scalar_type() != at::kFloat || t->layout() != at::kStrided || t->numel() == 0) {
      return false;
    }
  }
  return true;
}

// Whether fp32 products of these tensors go through oneDNN's sgemm.
bool onednnTakes(std::initializer_list<const at::Tensor*> tensors) {
  return cpuMatmulPath() == CpuMatmulPath::kOnednn && fp32Cpu(tensors);
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

#ifdef TESSERA_HAVE_ONEDNN
const dnnl::engine& cpuEngine() {
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// A bf16 matrix as oneDNN reads it: row-major, or the transpose of a row-major matrix (a
// `.t()` view), through its strides; any other layout is copied first.
struct Bf16Operand {
  at::Tensor tensor;
  dnnl::memory::desc desc;
};

Bf16Operand bf16Operand(const at::Tensor& t) {
  using dnnl::memory;
  const int64_t rows = t.size(0), cols = t.size(1);
  if (t.is_contiguous()) return {t, memory::desc({rows, cols}, memory::data_type::bf16, memory::dims{cols, 1})};
  if (t.t().is_contiguous()) return {t, memory::desc({rows, cols}, memory::data_type::bf16, memory::dims{1, rows})};
  const at::Tensor copy = t.contiguous();
  return {copy, memory::desc({rows, cols}, memory::data_type::bf16, memory::dims{cols, 1})};
}

dnnl::matmul::primitive_desc bf16MatmulDesc(const dnnl::memory::desc& a, const dnnl::memory::desc& b,
                                            const dnnl::memory::desc* bias, const dnnl::memory::desc& out) {
  // oneDNN caches the primitives it creates, so building one per call costs microseconds.
  const dnnl::matmul::desc desc = bias != nullptr ? dnnl::matmul::desc(a, b, *bias, out) : dnnl::matmul::desc(a, b, out);
  return dnnl::matmul::primitive_desc(desc, cpuEngine());
}
#endif

// out = a b (+ bias) in fp32 for bf16 matrices a [m, k] and b [k, n] (either may be a `.t()`
// view), accumulated in fp32; bias fp32 [n] or undefined.
at::Tensor bf16Product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  at::Tensor out = at::empty({m, n}, a.options().dtype(at::kFloat));
  if (!haveOnednnBf16()) {
    out.copy_(at::mm(a, b));  // LibTorch's bf16 product, rounded to bf16 before the copy
    if (bias.defined()) out.add_(bias);
    return out;
  }
#ifdef TESSERA_HAVE_ONEDNN
  using dnnl::memory;
  const Bf16Operand left = bf16Operand(a), right = bf16Operand(b);
  const memory::desc outDesc({m, n}, memory::data_type::f32, memory::dims{n, 1});
  const memory::desc biasDesc({1, n}, memory::data_type::f32, memory::dims{n, 1});
  const at::Tensor biasRow = bias.defined() ? bias.contiguous() : at::Tensor();
  try {
    const auto pd = bf16MatmulDesc(left.desc, right.desc, bias.defined() ? &biasDesc : nullptr, outDesc);
    const dnnl::engine& engine = cpuEngine();
    thread_local dnnl::stream stream(cpuEngine());
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, memory(left.desc, engine, left.tensor.data_ptr())},
        {DNNL_ARG_WEIGHTS, memory(right.desc, engine, right.tensor.data_ptr())},
        {DNNL_ARG_DST, memory(outDesc, engine, out.data_ptr())}};
    if (bias.defined()) args.emplace(DNNL_ARG_BIAS, memory(biasDesc, engine, biasRow.data_ptr()));
    dnnl::matmul(pd).execute(stream, args);
    stream.wait();
  } catch (const dnnl::error& e) {
    throw Error(strCat("oneDNN bf16 matmul of ", m, "x", k, " by ", k, "x", n, " failed: ", e.what()));
  }
#endif
  return out;
}

// y = x W^T (+ b) with bf16 copies of x and W, fp32 out; the backward multiplies a bf16 copy
// of the output gradient by the same copies. The copies, not x and W, are saved: half the
// bytes an fp32 linear keeps for its backward.
at::Tensor bf16LinearForward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& bias) {
  const int64_t in = weight.size(1), out = weight.size(0);
  const at::Tensor rows = x.reshape({-1, in}).to(at::kBFloat16).contiguous();
  const at::Tensor w = weight.to(at::kBFloat16).contiguous();
  const at::Tensor y = bf16Product(rows, w.t(), bias);
  ctx->save_for_backward({rows, w});
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out;
  return y.view(shape);
}

variable_list bf16LinearBackward(AutogradContext* ctx, const at::Tensor& gradOut, bool hasBias) {
  const auto saved = ctx->get_saved_variables();
  const at::Tensor& rows = saved[0];
  const at::Tensor& w = saved[1];
  const at::Tensor g = gradOut.reshape({-1, w.size(0)});
  const at::Tensor g16 = g.to(at::kBFloat16).contiguous();
  variable_list grads(hasBias ? 3 : 2);
  if (ctx->needs_input_grad(0)) {
    std::vector<int64_t> shape = gradOut.sizes().vec();
    shape.back() = w.size(1);
    grads[0] = bf16Product(g16, w, at::Tensor()).view(shape);
  }
  if (ctx->needs_input_grad(1)) grads[1] = bf16Product(g16.t(), rows, at::Tensor());
  if (hasBias && ctx->needs_input_grad(2)) grads[2] = g.sum(0);
  return grads;
}

// y = x W^T (+ b) through oneDNN's sgemm, saving what the backward needs.
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

// A linear's forward and backward as autograd functions: one with a bias and one without,
// since an undefined tensor cannot be an autograd input. `Forward` and `Backward` are the
// fp32 (oneDNN sgemm) or the bf16 pair above.
using LinearForward = at::Tensor (*)(AutogradContext*, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using LinearBackward = variable_list (*)(AutogradContext*, const at::Tensor&, bool);

template <LinearForward Forward, LinearBackward Backward>
struct LinearWithBias : public torch::autograd::Function<LinearWithBias<Forward, Backward>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias) {
    return Forward(ctx, x, weight, bias);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) { return Backward(ctx, grads[0], true); }
};

template <LinearForward Forward, LinearBackward Backward>
struct LinearNoBias : public torch::autograd::Function<LinearNoBias<Forward, Backward>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    return Forward(ctx, x, weight, at::Tensor());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) { return Backward(ctx, grads[0], false); }
};

template <LinearForward Forward, LinearBackward Backward>
at::Tensor applyLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  return bias.defined() ? LinearWithBias<Forward, Backward>::apply(x, weight, bias)
                        : LinearNoBias<Forward, Backward>::apply(x, weight);
}

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

void setCpuLinearDtype(at::ScalarType dtype) {
  if (dtype != at::kFloat && dtype != at::kBFloat16) {
    throw ConfigError(strCat("CPU Linear products in ", dtype, ": expected fp32 or bf16"));
  }
  linearDtype.store(dtype);
}

at::ScalarType cpuLinearDtype() { return linearDtype.load(); }

namespace {

// The kernel oneDNN picks for bf16 products on this core; "" where it has none.
std::string onednnBf16Kernel() {
#ifdef TESSERA_HAVE_ONEDNN
  using dnnl::memory;
  const memory::desc square({256, 256}, memory::data_type::bf16, memory::dims{256, 1});
  const memory::desc out({256, 256}, memory::data_type::f32, memory::dims{256, 1});
  try {
    return bf16MatmulDesc(square, square, nullptr, out).impl_info_str();
  } catch (const dnnl::error&) {
    return "";  // unimplemented: no bf16 support below AVX-512
  }
#else
  return "";
#endif
}

}  // namespace

bool haveOnednnBf16() {
  static const bool have = cpuMatmulPath() == CpuMatmulPath::kOnednn && !onednnBf16Kernel().empty();
  return have;
}

bool coreHasBf16Instructions() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("avx512bf16") || __builtin_cpu_supports("amx-bf16");
  return has;
#else
  return false;
#endif
}

std::string bf16MatmulKernel() {
  if (haveOnednnBf16()) return "oneDNN's matmul, kernel " + onednnBf16Kernel();
  if (!haveOnednn()) return "LibTorch's bf16 product (a build without oneDNN)";
  return cpuMatmulPath() == CpuMatmulPath::kAten ? "LibTorch's bf16 product (TESSERA_CPU_MATMUL=aten)"
                                                 : "LibTorch's bf16 product (oneDNN has no bf16 kernel for this core)";
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (cpuLinearDtype() == at::kBFloat16 && fp32Cpu({&x, &weight, &bias}) && weight.dim() == 2 && x.dim() >= 1 &&
      x.size(-1) == weight.size(1) && (!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)))) {
    return applyLinear<bf16LinearForward, bf16LinearBackward>(x, weight, bias);
  }
  if (!onednnTakes({&x, &weight, &bias}) || weight.dim() != 2 || x.dim() < 1 || x.size(-1) != weight.size(1)) {
    return at::linear(x, weight, bias);  // also the one to name a shape mismatch
  }
  return applyLinear<linearForward, linearBackward>(x, weight, bias);
}

at::Tensor batchedMatmul(const at::Tensor& a, const at::Tensor& b) {
  if (!onednnTakes({&a, &b}) || a.dim() < 2 || a.dim() != b.dim() || a.size(-1) != b.size(-2) ||
      a.sizes().slice(0, a.dim() - 2) != b.sizes().slice(0, b.dim() - 2)) {
    return at::matmul(a, b);
  }
  return OnednnBatchedMatmul::apply(a, b);
}

namespace {

// FLOP/s of `once`, an [m, k] x [k, n] product, after a warm-up call (kernels chosen and
// compiled, pages touched), timed for at least `seconds`.
template <typename Product>
double timedFlops(const Product& once, int64_t m, int64_t n, int64_t k, double seconds) {
  once();
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

}  // namespace

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
  return timedFlops(once, m, n, k, seconds);
}

double measureCpuBf16Flops(int64_t m, int64_t n, int64_t k, double seconds) {
  const at::Tensor a = at::randn({m, k}).to(at::kBFloat16);
  const at::Tensor b = at::randn({k, n}).to(at::kBFloat16);
  return timedFlops([&] { (void)bf16Product(a, b, at::Tensor()); }, m, n, k, seconds);
}

}  // namespace tessera::kernels
