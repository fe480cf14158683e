// Deferred parameters and their initial values, so a model far larger than one rank can
// hold is never built whole: its parameters start without storage, and a strategy
// materialises only what each rank holds (ZeRO-3: its rows), filling it from a
// ParamInitializer.
//
// Deferred: a tensor of the right shape, dtype and device whose storage holds 0 bytes
// (the state zero3 leaves a parameter in between uses). Nothing may read it until a
// strategy, or materializeAll() in a single process, gives it storage.
//
// Initial values come from a counter-based generator (common/counter_rng.h): element i
// (row-major) of parameter `name` is a function of (seed, name, i) alone, so filling rows
// [a, b) on one rank gives bitwise what filling the whole tensor gives there, at any world
// size and under any strategy.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace tessera::dtensor {

// A parameter's initial distribution.
struct ParamInit {
  // kSinCos2d: the fixed 2-D sin-cos position embedding of a DiT / MAE, a [grid * grid,
  // dim] table (any leading 1s): token m = row * grid + column; its first dim / 2 values
  // embed the column, the rest the row, each half [sin(p w_k), cos(p w_k)] with
  // w_k = 10000^(-k / (dim / 4)), k < dim / 4.
  enum class Kind { kUniform, kNormal, kConstant, kSinCos2d };
  Kind kind = Kind::kConstant;
  double a = 0.0;  // uniform: low; normal: mean; constant: the value; sincos2d: grid side
  double b = 0.0;  // uniform: high; normal: standard deviation; sincos2d: dim (a multiple of 4)

  static ParamInit uniform(double low, double high) { return {Kind::kUniform, low, high}; }
  static ParamInit normal(double mean, double std) { return {Kind::kNormal, mean, std}; }
  static ParamInit constant(double value) { return {Kind::kConstant, value, 0.0}; }
  static ParamInit sinCos2d(int64_t grid, int64_t dim) {
    return {Kind::kSinCos2d, static_cast<double>(grid), static_cast<double>(dim)};
  }
  std::string str() const;  // "uniform(-0.125, 0.125)", "normal(0, 0.02)", "constant(1)", "sincos2d(7, 64)"
};

// Fills `rows` — global rows [rowBegin, rowBegin + rows.size(0)) of a parameter whose
// rows hold rows.numel() / rows.size(0) elements (a 0-d parameter: one row of one) — with
// `init`'s values for parameter `name` under `seed`. Any floating dtype and device; the
// values are computed in double on the CPU and rounded once.
void fillRows(const ParamInit& init, uint64_t seed, const std::string& name, int64_t rowBegin, const at::Tensor& rows);

// What a strategy calls to initialise the rows it materialises of a deferred parameter:
// fill `rows` (global rows [rowBegin, ...), shaped [n, ...] like the parameter's rows, fp32)
// with parameter `name`'s initial values.
using ParamInitializer = std::function<void(const std::string& name, int64_t rowBegin, const at::Tensor& rows)>;

// The whole initial value (fp32, on `device`) of parameter `name` of `shape`: `initializer`
// fills it as one [rows, row numel] block from row 0.
at::Tensor fullInitialValue(const ParamInitializer& initializer, const std::string& name, at::IntArrayRef shape,
                            at::Device device);

// A tensor of `shape` with `options` (dtype, device) and no storage (0 bytes).
at::Tensor deferredTensor(const std::vector<int64_t>& shape, const at::TensorOptions& options);
// True for a tensor with elements but less storage than they need (deferred, or a zero3
// parameter between uses).
bool hasNoStorage(const at::Tensor& tensor);

// Single process: gives every deferred parameter of `module` its full storage and fills it
// with `initializer` (e.g. for tests, or a plain training loop without a strategy).
void materializeAll(torch::nn::Module& module, const ParamInitializer& initializer);

// Frees (bytes 0) or regrows a tensor's own storage in place: the StorageImpl, and so every
// tensor and saved variable viewing it, stays the same. CPU, or CUDA in a CUDA build.
void setStorageBytes(const at::Tensor& tensor, size_t bytes);

}  // namespace tessera::dtensor
