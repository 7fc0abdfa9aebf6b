// Process-wide allocator settings for processes that encode or apply patches
// again and again (wsyncd, wsync-bench). Call once, first thing in main.
#pragma once

#include <cstddef>

namespace wsync {

// Keeps up to `retain_bytes` of freed heap memory mapped, and serves blocks
// below 32 MiB from the heap rather than from fresh mappings.
//
// Why: the codec's scratch is freed after every call (an apply keeps each
// decoded change until the patch verifies, about 6 bytes per changed
// element; an encode its streams), and by default glibc hands freed memory
// back to the kernel, so the next call faults every page in again. On
// virtual machines a fault costs tens of microseconds: on a 1.13 GB set, an
// apply spent more time faulting than decoding (docs/codec.md, "Memory").
// A no-op where the C library is not glibc.
void RetainFreedMemory(size_t retain_bytes = size_t{1} << 30);

}  // namespace wsync
