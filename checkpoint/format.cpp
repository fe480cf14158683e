// Dtype names, checksums and checked arithmetic shared by both formats (see format.h).
#include "checkpoint/format.h"

// The streaming state on the stack (its layout is this header's version's, as is the
// library's: both come from the same libxxhash package).
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <thread>

namespace tessera::checkpoint {

namespace {
struct DtypeRow {
  at::ScalarType dtype;
  const char* name;
};
constexpr DtypeRow kDtypes[] = {
    {at::kBool, "BOOL"}, {at::kByte, "U8"},      {at::kChar, "I8"},    {at::kShort, "I16"}, {at::kInt, "I32"},
    {at::kLong, "I64"},  {at::kHalf, "F16"},     {at::kBFloat16, "BF16"}, {at::kFloat, "F32"}, {at::kDouble, "F64"},
};
}  // namespace

std::string dtypeName(at::ScalarType dtype) {
  for (const auto& row : kDtypes) {
    if (row.dtype == dtype) return row.name;
  }
  throw Error(strCat("checkpoint: dtype ", c10::toString(dtype), " cannot be stored (supported: bool, uint8, int8, ",
                     "int16, int32, int64, float16, bfloat16, float32, float64)"));
}

at::ScalarType parseDtypeName(const std::string& name, const std::string& where) {
  for (const auto& row : kDtypes) {
    if (name == row.name) return row.dtype;
  }
  throw CheckpointError(strCat(where, ": unknown dtype '", name, "'"));
}

int64_t dtypeBytes(at::ScalarType dtype) { return static_cast<int64_t>(c10::elementSize(dtype)); }

uint64_t checksum(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

bool pipelinedChecksums() {
  const char* set = std::getenv("TESSERA_CHECKPOINT_PIPELINE");
  if (set != nullptr && *set != '\0') return std::string(set) != "0";
  return std::thread::hardware_concurrency() >= 8;
}

uint64_t checksum(std::initializer_list<std::pair<const void*, size_t>> pieces) {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);  // seed 0, as checksum(data, bytes)
  for (const auto& [data, bytes] : pieces) {
    if (bytes > 0) XXH3_64bits_update(&state, data, bytes);
  }
  return XXH3_64bits_digest(&state);
}

std::string checksumHex(uint64_t value) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(value));
  return buf;
}

uint64_t parseChecksumHex(const std::string& text, const std::string& where) {
  if (text.size() != 16) throw CheckpointError(strCat(where, ": checksum '", text, "' is not 16 hex digits"));
  uint64_t value = 0;
  for (char c : text) {
    int digit;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      digit = c - 'a' + 10;
    } else if (c >= 'A' && c <= 'F') {
      digit = c - 'A' + 10;
    } else {
      throw CheckpointError(strCat(where, ": checksum '", text, "' is not 16 hex digits"));
    }
    value = (value << 4) | static_cast<uint64_t>(digit);
  }
  return value;
}

int64_t checkedMul(int64_t a, int64_t b, const std::string& where) {
  int64_t out;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &out)) {
    throw CheckpointError(strCat(where, ": size ", a, " x ", b, " overflows"));
  }
  return out;
}

int64_t checkedAdd(int64_t a, int64_t b, const std::string& where) {
  int64_t out;
  if (__builtin_add_overflow(a, b, &out)) throw CheckpointError(strCat(where, ": offset ", a, " + ", b, " overflows"));
  return out;
}

}  // namespace tessera::checkpoint
