// Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers") in Moonlight's scaled
// form (Liu et al. 2025, "Muon is scalable for LLM training"), the pieces ShardedOptimizer
// (sharded_optimizer.h) builds its `optim.name: muon` from. For a hidden 2-D weight W
// [rows, cols] with gradient g and momentum buffer m:
//   m = mu m + g;  u = g + mu m (Nesterov) or u = m
//   X = u / (||u||_F + 1e-7), transposed while rows > cols
//   ns_steps times: A = X X^T;  X = a X + (b A + c A A) X,  (a, b, c) = (3.4445, -4.7750, 2.0315)
//   W = W (1 - lr wd) - lr * 0.2 * sqrt(max(rows, cols)) * X   (X transposed back)
// Every other parameter (embeddings, norms, biases, heads, patterns in `exclude`, anything
// not 2-D) is stepped by AdamW at lr * adamwLrScale.
//
// The momentum and u are elementwise, so each rank computes them on its own rows; the
// orthogonalisation needs the whole of u: ShardedOptimizer gathers it to the matrix's owner
// rank (ownersBySize spreads the matrices over the ranks by cost), which runs the
// iteration and sends each rank its rows back.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tessera::optim {

struct MuonOptions {
  double momentum = 0.95;       // mu
  bool nesterov = true;
  int nsSteps = 5;              // Newton-Schulz iterations
  // The AdamW group's learning rate over Muon's (optim.muon.adamw_lr / optim.lr): the
  // schedule scales both alike.
  double adamwLrScale = 1.0;
  // Parameters stepped by AdamW although 2-D (fnmatch patterns), besides the default ones
  // (kMuonDefaultExclude).
  std::vector<std::string> exclude;
  // The iteration's dtype: fp32, or bf16 (on a GPU; Keller Jordan's form).
  at::ScalarType nsDtype = at::kFloat;
};

// The 2-D parameters AdamW keeps under Muon by default: embeddings and output heads (the
// built-in models' names: the MLP's and GPT's embeddings and heads, the DiT's class table
// and final layer).
extern const std::vector<std::string> kMuonDefaultExclude;

// Whether parameter `name` of global shape `shape` is Muon's: 2-D and matched by no pattern
// of kMuonDefaultExclude or `options.exclude`.
bool takesMuon(const MuonOptions& options, const std::string& name, const std::vector<int64_t>& shape);

// The orthogonalised update X of a whole 2-D `u` (fp32, any device), or of each matrix of a
// stack [k, rows, cols] (one product call per step for all of them: small matrices cost
// their calls more than their FLOPs): normalised, `steps` Newton-Schulz iterations in
// `dtype`, returned fp32 in u's shape. fp32 CPU products go through kernels::batchedMatmul
// (oneDNN when built with it); a matrix gets the same bits alone or in a stack.
at::Tensor orthogonalize(const at::Tensor& u, int steps, at::ScalarType dtype = at::kFloat);

// Moonlight's update scale for a [rows, cols] matrix: 0.2 * sqrt(max(rows, cols)), which
// gives the update the RMS of AdamW's (about 0.2), so AdamW's learning rate and weight decay
// carry over.
double muonUpdateScale(int64_t rows, int64_t cols);

// The FLOPs of one orthogonalisation of a [rows, cols] matrix with `steps` iterations.
double orthogonalizeFlops(int64_t rows, int64_t cols, int steps);

// An owner rank in [0, ranks) for each of `costs` (one per matrix, in order): largest first,
// each to the rank with the least work so far (ties: the lowest rank), so that the ranks'
// shares of the work differ by at most the largest single cost. Deterministic.
std::vector<int> ownersBySize(const std::vector<double>& costs, int ranks);

}  // namespace tessera::optim
