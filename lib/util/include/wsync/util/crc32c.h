// CRC-32C (Castagnoli), as used by the store's log records and the data
// plane's chunks. Hardware-accelerated where SSE4.2 is available.
#pragma once

#include <cstddef>
#include <cstdint>

namespace wsync {

// Extends `crc` (0 for a fresh computation) over `n` bytes.
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

}  // namespace wsync
