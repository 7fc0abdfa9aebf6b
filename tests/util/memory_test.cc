// RetainFreedMemory: a block freed and allocated again comes back without
// page faults (by default glibc would hand it back to the kernel).
#include "wsync/util/memory.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cstdlib>
#include <cstring>

namespace wsync {
namespace {

long MinorFaults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// Allocates, touches and frees `bytes`; returns the faults it took.
long TouchFreshBlock(size_t bytes) {
  const long before = MinorFaults();
  auto* p = static_cast<char*>(std::malloc(bytes));
  std::memset(p, 1, bytes);
  asm volatile("" : : "r"(p) : "memory");  // the block is used: no eliding it
  const long faults = MinorFaults() - before;
  std::free(p);
  return faults;
}

TEST(RetainFreedMemory, FreedBlocksComeBackWithoutFaults) {
#if defined(__SANITIZE_ADDRESS__) || !defined(__GLIBC__)
  GTEST_SKIP() << "needs glibc's allocator (not the sanitizer's)";
#else
  RetainFreedMemory();
  constexpr size_t kBytes = 16 << 20;  // 4096 pages
  TouchFreshBlock(kBytes);             // maps it once
  EXPECT_LT(TouchFreshBlock(kBytes), 64) << "the freed block was handed back to the kernel";
#endif
}

}  // namespace
}  // namespace wsync
