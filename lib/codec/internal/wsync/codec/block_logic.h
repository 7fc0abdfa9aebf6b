// Per-element and per-block logic of the chunk codec, shared by the host
// codec and the device kernels (cuda/): every function here is WSYNC_HD and
// depends on nothing but its arguments, so host tests exercise exactly what
// the device runs.
//
// Elements are processed in blocks of 32 (a warp on the device); a block turns
// into 32-bit masks, bit j = element j. The class of an element is the number
// of ascending exponent thresholds its base value reaches:
//   class(x) = #{t : exponent(x) >= thr[t]},
// so the K-1 "ge" masks nest and class c's members are ge[c-1] & ~ge[c].
// The rank of a changed element is the number of elements of its class that
// precede it in its chunk; the sparse mode codes gaps between ranks.
#pragma once

#include <cstddef>
#include <cstdint>

#if !defined(__CUDA_ARCH__)
#include <bit>
#endif

#include "wsync/codec/dtype.h"

namespace wsync::codec {

inline constexpr int kBlock = 32;
inline constexpr int kMaxClasses = 8;
// The class chooser's exponent histogram counts every kSampleStride-th block
// of a chunk (blocks 0, 16, 32, ...; full blocks only).
inline constexpr int kSampleStride = 16;
// Encoders (host and device alike) choose classes once per run of
// kClassRunChunks consecutive chunks of a tensor: chunk c takes the classes
// chosen for chunk ClassSourceChunk(c) of its tensor, the first of its run.
// The chunks of a run are alike (8 MiB of one tensor at the default chunk
// size), and sampling every chunk cost a sixth of host encode time.
inline constexpr size_t kClassRunChunks = 8;
WSYNC_HD inline size_t ClassSourceChunk(size_t chunk) { return chunk - chunk % kClassRunChunks; }

WSYNC_HD inline int Popcount32(uint32_t m) {
#if defined(__CUDA_ARCH__)
  return __popc(m);
#else
  return std::popcount(m);
#endif
}

WSYNC_HD inline int CountrZero32(uint32_t m) {
#if defined(__CUDA_ARCH__)
  return __ffs(static_cast<int>(m)) - 1;
#else
  return std::countr_zero(m);
#endif
}

// The classes of one chunk. Part of the patch format (docs/patch-format.md,
// "class header").
struct ClassSpec {
  int k = 1;                           // number of classes, 1..kMaxClasses
  uint16_t thr[kMaxClasses - 1] = {};  // ascending exponent thresholds
  uint8_t shift = 0;
  uint16_t mask = 0;

  template <typename T>
  WSYNC_HD int Exponent(T x) const {
    return static_cast<int>((static_cast<uint64_t>(x) >> shift) & mask);
  }
  template <typename T>
  WSYNC_HD int ClassOf(T x) const {
    const int e = Exponent(x);
    int c = 0;
    for (int t = 0; t < k - 1; ++t) c += e >= thr[t] ? 1 : 0;
    return c;
  }
};

// The ge masks of a block of `len` <= 32 elements: ge[t] bit j is set iff
// exponent(x[j]) >= thr[t], t < k - 1. Elements past len are in no mask.
template <typename T>
WSYNC_HD inline void BlockGeMasks(const ClassSpec& spec, const T* x, int len, uint32_t* ge) {
  for (int t = 0; t < spec.k - 1; ++t) ge[t] = 0;
  for (int j = 0; j < len; ++j) {
    const int e = spec.Exponent(x[j]);
    for (int t = 0; t < spec.k - 1; ++t) ge[t] |= static_cast<uint32_t>(e >= spec.thr[t]) << j;
  }
}

// Members of class c in a block, from its nested ge masks and valid mask.
WSYNC_HD inline uint32_t ClassMask(const uint32_t* ge, int k, uint32_t valid, int c) {
  const uint32_t upper = c == 0 ? valid : ge[c - 1];
  const uint32_t lower = c == k - 1 ? 0u : ge[c];
  return upper & ~lower;
}

// Class of element j of a block from its ge masks.
WSYNC_HD inline int ClassAt(const uint32_t* ge, int k, int j) {
  int c = 0;
  while (c < k - 1 && ((ge[c] >> j) & 1)) ++c;
  return c;
}

// Mask of the first `len` elements of a block.
WSYNC_HD inline uint32_t ValidMask(int len) { return len >= kBlock ? ~0u : (1u << len) - 1; }

// Index of the r-th (0-based) set bit of m. REQUIRES: popcount(m) > r.
WSYNC_HD inline int SelectBit(uint32_t m, uint32_t r) {
  int base = 0;
  uint32_t c = static_cast<uint32_t>(Popcount32(m & 0xFFFFu));
  if (r >= c) {
    r -= c;
    m >>= 16;
    base += 16;
  }
  c = static_cast<uint32_t>(Popcount32(m & 0xFFu));
  if (r >= c) {
    r -= c;
    m >>= 8;
    base += 8;
  }
  for (uint32_t i = 0; i < r; ++i) m &= m - 1;
  return base + CountrZero32(m);
}

}  // namespace wsync::codec
