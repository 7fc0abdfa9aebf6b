#include "block_ops.h"

#include <atomic>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace wsync::codec::internal {

bool HasFastDeposit() {
#if defined(__BMI2__) && (defined(__x86_64__) || defined(__i386__))
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return false;
  // "AuthenticAMD": ebx "Auth", edx "enti", ecx "cAMD". Hygon's cores
  // ("HygonGenuine") are Zen 1: slow.
  const bool amd = ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u;
  const bool hygon = ebx == 0x6f677948u && edx == 0x6e65476eu && ecx == 0x656e6975u;
  if (hygon) return false;
  if (!amd) return true;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
  const unsigned base_family = (eax >> 8) & 0xF;
  const unsigned family = base_family == 0xF ? base_family + ((eax >> 20) & 0xFF) : base_family;
  return family >= 0x19;
#else
  return false;
#endif
}

bool HostHasAvx512() {
#if defined(__x86_64__)
  // libgcc's CPU model also checks that the OS saves the AVX-512 state.
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return has;
#else
  return false;
#endif
}

namespace {

std::atomic<SimdPath>& SimdPathSetting() {
  static std::atomic<SimdPath> path(HostHasAvx512() ? SimdPath::kAvx512 : SimdPath::kBaseline);
  return path;
}

}  // namespace

SimdPath ActiveSimdPath() { return SimdPathSetting().load(std::memory_order_relaxed); }

SimdPath SetSimdPathForTesting(SimdPath path) {
  if (!HostHasAvx512()) path = SimdPath::kBaseline;
  return SimdPathSetting().exchange(path);
}

}  // namespace wsync::codec::internal
