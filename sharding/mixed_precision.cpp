// Dtype names and checks for mixed precision (see mixed_precision.h).
#include "sharding/mixed_precision.h"

#include "common/errors.h"

namespace tessera::sharding {

at::ScalarType parseFloatDtype(const std::string& name, const std::string& what) {
  if (name == "fp32" || name == "float32" || name == "float") return at::kFloat;
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  if (name == "fp16" || name == "float16" || name == "half") return at::kHalf;
  throw ConfigError(strCat(what, ": unknown dtype '", name, "' (fp32, bf16, fp16)"));
}

void checkFloatDtype(at::ScalarType type, const std::string& what) {
  TESSERA_CHECK_AS(ConfigError, type == at::kFloat || type == at::kBFloat16 || type == at::kHalf, what, ": dtype ",
                   c10::toString(type), " is not one of fp32, bf16, fp16");
}

}  // namespace tessera::sharding
