#include "wsync/util/memory.h"

#include <algorithm>
#include <climits>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace wsync {

void RetainFreedMemory(size_t retain_bytes) {
#if defined(__GLIBC__)
  // Setting either disables glibc's dynamic thresholds; 32 MiB is the
  // largest mmap threshold it accepts on 64-bit hosts.
  mallopt(M_TRIM_THRESHOLD, static_cast<int>(std::min<size_t>(retain_bytes, INT_MAX)));
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
#else
  (void)retain_bytes;
#endif
}

}  // namespace wsync
