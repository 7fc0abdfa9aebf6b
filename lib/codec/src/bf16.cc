#include "wsync/codec/bf16.h"

namespace wsync::codec {

void CastFp32ToBf16(const uint32_t* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = Fp32BitsToBf16Bits(src[i]);
}

}  // namespace wsync::codec
