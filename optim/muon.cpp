// Muon's orthogonalisation and parameter split (see muon.h).
#include "optim/muon.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <fnmatch.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/errors.h"
#include "kernels/cpu_matmul.h"

namespace tessera::optim {

const std::vector<std::string> kMuonDefaultExclude = {
    "embed.*",  "wte.*",     "wpe.*",         "*embedding_table.*", "*embed.weight",
    "head.*",   "lm_head.*", "final_layer.*",
};

bool takesMuon(const MuonOptions& options, const std::string& name, const std::vector<int64_t>& shape) {
  if (shape.size() != 2) return false;
  const auto matches = [&](const std::string& pattern) { return ::fnmatch(pattern.c_str(), name.c_str(), 0) == 0; };
  return std::none_of(kMuonDefaultExclude.begin(), kMuonDefaultExclude.end(), matches) &&
         std::none_of(options.exclude.begin(), options.exclude.end(), matches);
}

namespace {

// a @ b for matrices or stacks of them: oneDNN for fp32 CPU ones (kernels/cpu_matmul.h; a
// stack is one single-threaded product per matrix), else LibTorch's.
at::Tensor product(const at::Tensor& a, const at::Tensor& b) {
  return kernels::batchedMatmul(a.contiguous(), b.contiguous());
}

}  // namespace

at::Tensor orthogonalize(const at::Tensor& u, int steps, at::ScalarType dtype) {
  TESSERA_CHECK(u.dim() == 2 || u.dim() == 3, "Muon: orthogonalize needs a matrix or a stack of them, got ", u.sizes());
  c10::NoGradGuard noGrad;
  constexpr double a = 3.4445, b = -4.7750, c = 2.0315;
  const bool tall = u.size(-2) > u.size(-1);
  at::Tensor x = (tall ? u.transpose(-2, -1) : u).to(at::kFloat).contiguous();
  if (x.dim() == 2) {
    x = x / (x.norm() + 1e-7);
  } else {
    // Each matrix by its own norm, taken as the one-matrix form takes it (the same bits
    // whether a matrix is orthogonalised alone or in a stack: owners stack what they hold).
    std::vector<at::Tensor> norms;
    for (int64_t i = 0; i < x.size(0); ++i) norms.push_back(x[i].norm() + 1e-7);
    x = x / at::stack(norms).view({-1, 1, 1});
  }
  x = x.to(dtype).contiguous();
  for (int i = 0; i < steps; ++i) {
    const at::Tensor gram = product(x, x.transpose(-2, -1));      // A = X X^T
    const at::Tensor poly = gram * b + product(gram, gram) * c;  // b A + c A A
    x = x * a + product(poly, x);
  }
  x = x.to(at::kFloat);
  return tall ? x.transpose(-2, -1).contiguous() : x;
}

double muonUpdateScale(int64_t rows, int64_t cols) {
  return 0.2 * std::sqrt(static_cast<double>(std::max(rows, cols)));
}

double orthogonalizeFlops(int64_t rows, int64_t cols, int steps) {
  const double m = static_cast<double>(std::min(rows, cols)), n = static_cast<double>(std::max(rows, cols));
  // Per iteration: X X^T (2 m m n), A A (2 m m m), (.) X (2 m m n).
  return steps * (4.0 * m * m * n + 2.0 * m * m * m);
}

std::vector<int> ownersBySize(const std::vector<double>& costs, int ranks) {
  TESSERA_CHECK(ranks > 0, "Muon: owners over ", ranks, " ranks");
  std::vector<size_t> order(costs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return costs[x] > costs[y]; });
  std::vector<double> load(static_cast<size_t>(ranks), 0.0);
  std::vector<int> owners(costs.size(), 0);
  for (size_t i : order) {
    const auto least = std::min_element(load.begin(), load.end());
    owners[i] = static_cast<int>(least - load.begin());
    *least += costs[i];
  }
  return owners;
}

}  // namespace tessera::optim
