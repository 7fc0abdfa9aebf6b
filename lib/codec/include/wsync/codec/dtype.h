// Element types of tensors, with the safetensors spelling of their names.
//
// The codec works on bit patterns: what matters of a dtype is its width in
// bytes and, for floating-point types, where the exponent field sits (the
// position coder conditions on the exponent of the old value).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "wsync/util/status.h"

#if defined(__CUDACC__)
#define WSYNC_HD __host__ __device__
#else
#define WSYNC_HD
#endif

namespace wsync::codec {

// Values are part of the patch format (docs/patch-format.md): never renumber.
enum class DType : uint8_t {
  kBool = 1,
  kU8 = 2,
  kI8 = 3,
  kF8E4M3 = 4,
  kF8E5M2 = 5,
  kI16 = 6,
  kU16 = 7,
  kF16 = 8,
  kBF16 = 9,
  kI32 = 10,
  kU32 = 11,
  kF32 = 12,
  kI64 = 13,
  kU64 = 14,
  kF64 = 15,
};

// Bytes per element: 1, 2, 4 or 8. 0 for a value outside the enum.
size_t DTypeWidth(DType dtype);

// Safetensors name ("BF16", "F32", "F8_E4M3", ...).
std::string_view DTypeName(DType dtype);

// Inverse of DTypeName; InvalidArgument naming the string when unknown.
StatusOr<DType> ParseDType(std::string_view name);

// True if `code` is a defined DType value (for decoders of untrusted bytes).
bool IsValidDType(uint8_t code);

// Where the exponent field of a floating-point type sits in its bit pattern:
// exponent = (bits >> shift) & mask. mask == 0 for integer types.
struct ExponentField {
  uint8_t shift = 0;
  uint16_t mask = 0;
};
ExponentField ExponentFieldOf(DType dtype);

}  // namespace wsync::codec
