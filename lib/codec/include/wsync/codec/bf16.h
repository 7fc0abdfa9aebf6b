// FP32 -> BF16 conversion, bit-identical to PyTorch's `.to(torch.bfloat16)`
// (c10::BFloat16's round_to_nearest_even): round to nearest, ties to even;
// every NaN becomes the canonical quiet NaN 0x7FC0; infinities and signed
// zeros are kept; overflow rounds to infinity.
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
  if (is_nan) return 0x7FC0u;
  const uint32_t rounding_bias = ((bits >> 16) & 1u) + 0x7FFFu;
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

// Converts n FP32 values (given as bit patterns) to BF16 bit patterns.
void CastFp32ToBf16(const uint32_t* src, uint16_t* dst, size_t n);

}  // namespace wsync::codec
