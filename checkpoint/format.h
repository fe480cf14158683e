// Shared vocabulary of the checkpoint and safetensors formats: the error type for bad or
// corrupt files, dtype names (safetensors' "F32", "BF16", ... used by both formats),
// the checksum (XXH3-64, printed as 16 hex digits), and little-endian helpers.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "common/errors.h"

namespace tessera::checkpoint {

// A checkpoint or safetensors file that is missing, truncated, corrupt, or does not match
// what the caller expects. The message names the file and, where there is one, the tensor.
// resume-auto falls back to an older checkpoint on these.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

// Safetensors dtype names: BOOL U8 I8 I16 I32 I64 F16 BF16 F32 F64. Throws tessera::Error
// for a dtype neither format can hold (complex, quantized).
std::string dtypeName(at::ScalarType dtype);
// Inverse of dtypeName; throws CheckpointError naming `where` for an unknown name.
at::ScalarType parseDtypeName(const std::string& name, const std::string& where);
// Bytes per element.
int64_t dtypeBytes(at::ScalarType dtype);

// The checksum of checkpoint blocks: XXH3 64-bit, seed 0.
uint64_t checksum(const void* data, size_t bytes);
// The checksum of a block held in pieces (a block read partly into its destination and
// partly into scratch): the same value as checksum() of the pieces joined, in order.
uint64_t checksum(std::initializer_list<std::pair<const void*, size_t>> pieces);
std::string checksumHex(uint64_t value);  // 16 lowercase hex digits
// Whether a save writes each 16 MiB segment on a helper thread while it checksums the
// next, instead of hashing and writing block by block: 1.11x vs 1.00x of raw disk speed
// on the 16-core H200 machine (docs/benchmarks.md). Loads hash inline (a helper thread
// lost there: 0.84x vs 1.01x, and on 2 cores). TESSERA_CHECKPOINT_PIPELINE=1 or 0
// decides; unset, on with 8 or more hardware threads.
bool pipelinedChecksums();
// Parses 16 hex digits; throws CheckpointError naming `where` otherwise.
uint64_t parseChecksumHex(const std::string& text, const std::string& where);
constexpr const char* kChecksumAlgorithm = "xxh3_64";
// The largest checksum block a checkpoint may use (Checkpointer writes 1 MiB blocks, more
// for a state past ~4.5 TiB): a reader holds up to one block of a chunk in memory, so a
// file cannot ask for more.
constexpr int64_t kMaxBlockBytes = int64_t{256} << 20;

// Both formats are little-endian; Tessera runs on little-endian hosts only (x86-64,
// aarch64), which this checks at compile time where the compiler says.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "Tessera's checkpoint formats assume a little-endian host"
#endif

// a*b and a+b for sizes read from files, throwing CheckpointError (naming `where`) on
// overflow of int64 instead of wrapping.
int64_t checkedMul(int64_t a, int64_t b, const std::string& where);
int64_t checkedAdd(int64_t a, int64_t b, const std::string& where);

}  // namespace tessera::checkpoint
