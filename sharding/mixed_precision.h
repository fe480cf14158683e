// Mixed precision vocabulary shared by every strategy: the dtype names configs use and
// the rules for which dtypes may compute and reduce.
//
// Tessera's mixed precision is the ZeRO/FSDP one: the optimizer updates fp32 master
// shards; the module computes with copies of the parameters cast to `param dtype`
// (fp32, bf16 or fp16), so its gradients arrive in that dtype; gradients are reduced
// across ranks in `reduce dtype` (fp32 by default, so N bf16 gradients are not summed
// in 8 bits of mantissa) and applied to the fp32 masters. fp16 has no loss scaler here:
// a non-finite gradient norm skips the step (see ShardingStrategy::step), which is the
// mechanism a dynamic loss scaler would build on.
#pragma once

#include <c10/core/ScalarType.h>

#include <string>

#include "common/enum_names.h"

namespace tessera::sharding {

// The names configs give the floating dtypes a module computes in and gradients are
// reduced in.
inline constexpr std::array<EnumName<at::ScalarType>, 3> kFloatDtypeNames = {
    {{"fp32", at::kFloat}, {"bf16", at::kBFloat16}, {"fp16", at::kHalf}}};

// "fp32" | "float32" | "float", "bf16" | "bfloat16", "fp16" | "float16" | "half".
// Throws tessera::ConfigError naming `what` (e.g. "sharding.param_dtype") otherwise.
at::ScalarType parseFloatDtype(const std::string& name, const std::string& what = "dtype");

// Throws tessera::ConfigError unless `type` is fp32, bf16 or fp16 (the dtypes a module
// may compute in and gradients may be reduced in).
void checkFloatDtype(at::ScalarType type, const std::string& what);

}  // namespace tessera::sharding
