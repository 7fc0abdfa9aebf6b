// FP32 -> BF16 conversion, bit-identical to PyTorch's `tensor.to(torch.bfloat16)`
// on CPU: round to nearest, ties to even (on the bit pattern: add 0x7FFF plus
// the lowest kept bit, truncate); infinities and signed zeros are kept;
// overflow rounds to infinity; every NaN becomes 0xFFFF, which is what
// PyTorch's vectorized CPU kernel writes (measured with torch 1.13; its scalar
// c10::BFloat16 path writes 0x7FC0 and CUDA's __float2bfloat16 0x7FFF, so no
// NaN encoding is "the" PyTorch one; weights holding NaN are broken anyway).
// The known-answer table in tests/codec/bf16_test.cc was produced by torch.
//
// Header-only and usable from CUDA kernels (WSYNC_HD), so the device cast is
// the same function as the host one.
#pragma once

#include <cstddef>
#include <cstdint>

#include "wsync/codec/dtype.h"

namespace wsync::codec {

WSYNC_HD inline uint16_t Fp32BitsToBf16Bits(uint32_t bits) {
  const bool is_nan = (bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0;
  if (is_nan) return 0xFFFFu;
  const uint32_t rounding_bias = ((bits >> 16) & 1u) + 0x7FFFu;
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

// Converts n FP32 values (given as bit patterns) to BF16 bit patterns.
void CastFp32ToBf16(const uint32_t* src, uint16_t* dst, size_t n);

}  // namespace wsync::codec
