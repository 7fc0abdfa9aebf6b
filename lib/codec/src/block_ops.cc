#include "block_ops.h"

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

}  // namespace wsync::codec::internal
