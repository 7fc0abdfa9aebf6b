// Per-block kernels of the chunk codec (private).
//
// Elements are processed in blocks of 32; each kernel turns a block into
// 32-bit masks (bit j = element j). The class of an element is the number of
// thresholds its exponent reaches: class(x) = #{t : exponent(x) >= thr[t]},
// with thresholds ascending, so the class masks follow from K-1 "ge" masks.
// These are plain functions of bits, shared by the encoder, the decoder and
// (through the same definitions) the device kernels.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "wsync/codec/dtype.h"

namespace wsync::codec::internal {

inline constexpr int kBlock = 32;
inline constexpr int kMaxClasses = 8;

struct ClassSpec {
  int k = 1;                          // number of classes, 1..kMaxClasses
  uint16_t thr[kMaxClasses - 1] = {};  // ascending exponent thresholds
  uint8_t shift = 0;
  uint16_t mask = 0;

  template <typename T>
  WSYNC_HD int Exponent(T x) const {
    return static_cast<int>((static_cast<uint64_t>(x) >> shift) & mask);
  }
  template <typename T>
  WSYNC_HD int ClassOf(T x) const {
    int e = Exponent(x);
    int c = 0;
    for (int t = 0; t < k - 1; ++t) c += e >= thr[t] ? 1 : 0;
    return c;
  }
};

// Bit j of the result: a[j] != b[j]. REQUIRES: 32 readable elements each.
template <typename T>
inline uint32_t NeMask(const T* a, const T* b) {
  uint32_t m = 0;
  for (int j = 0; j < kBlock; ++j) m |= static_cast<uint32_t>(a[j] != b[j]) << j;
  return m;
}

// True when the 32 elements are equal (the fast path of the diff).
template <typename T>
inline bool BlockEqual(const T* a, const T* b) {
  return std::memcmp(a, b, kBlock * sizeof(T)) == 0;
}

// ge[t] bit j: exponent(x[j]) >= thr[t], t < spec.k - 1.
// REQUIRES: 32 readable elements.
template <typename T>
inline void GeMasks(const T* x, const ClassSpec& spec, uint32_t* ge) {
  int e[kBlock];
  for (int j = 0; j < kBlock; ++j) e[j] = spec.Exponent(x[j]);
  for (int t = 0; t < spec.k - 1; ++t) {
    uint32_t m = 0;
    for (int j = 0; j < kBlock; ++j) m |= static_cast<uint32_t>(e[j] >= spec.thr[t]) << j;
    ge[t] = m;
  }
}

#if defined(__AVX2__)
template <>
inline uint32_t NeMask<uint16_t>(const uint16_t* a, const uint16_t* b) {
  __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16));
  __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
  __m256i eq = _mm256_packs_epi16(_mm256_cmpeq_epi16(a0, b0), _mm256_cmpeq_epi16(a1, b1));
  eq = _mm256_permute4x64_epi64(eq, 0xD8);  // packs interleaves 128-bit lanes
  return ~static_cast<uint32_t>(_mm256_movemask_epi8(eq));
}

template <>
inline void GeMasks<uint16_t>(const uint16_t* x, const ClassSpec& spec, uint32_t* ge) {
  const __m128i shift = _mm_cvtsi32_si128(spec.shift);
  const __m256i mask = _mm256_set1_epi16(static_cast<int16_t>(spec.mask));
  __m256i e0 = _mm256_and_si256(
      _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)), shift), mask);
  __m256i e1 = _mm256_and_si256(
      _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)), shift), mask);
  for (int t = 0; t < spec.k - 1; ++t) {
    // Exponents fit in 15 bits, so the signed compare is exact.
    __m256i thr = _mm256_set1_epi16(static_cast<int16_t>(spec.thr[t] - 1));
    __m256i g = _mm256_packs_epi16(_mm256_cmpgt_epi16(e0, thr), _mm256_cmpgt_epi16(e1, thr));
    g = _mm256_permute4x64_epi64(g, 0xD8);
    ge[t] = static_cast<uint32_t>(_mm256_movemask_epi8(g));
  }
}
#endif

// Class masks from ge masks: cls[c] bit j set iff class(x[j]) == c.
inline void ClassMasks(const uint32_t* ge, int k, uint32_t valid, uint32_t* cls) {
  if (k == 1) {
    cls[0] = valid;
    return;
  }
  cls[0] = ~ge[0] & valid;
  for (int c = 1; c < k - 1; ++c) cls[c] = ge[c - 1] & ~ge[c] & valid;
  cls[k - 1] = ge[k - 2] & valid;
}

// Class masks of block b of a chunk of n elements; elements past n are not
// in any class. Returns the mask of valid elements.
template <typename T>
inline uint32_t BlockClassMasks(const T* x, size_t n, size_t b, const ClassSpec& spec, uint32_t* cls) {
  size_t begin = b * kBlock;
  uint32_t ge[kMaxClasses - 1] = {};
  uint32_t valid;
  if (begin + kBlock <= n) {
    valid = ~0u;
    if (spec.k > 1) GeMasks(x + begin, spec, ge);
  } else {
    size_t len = n - begin;
    valid = (1u << len) - 1;
    if (spec.k > 1) {
      T tmp[kBlock] = {};
      std::memcpy(tmp, x + begin, len * sizeof(T));
      GeMasks(tmp, spec, ge);
    }
  }
  ClassMasks(ge, spec.k, valid, cls);
  return valid;
}

// Index of the r-th (0-based) set bit of m. REQUIRES: popcount(m) > r.
inline int SelectBit(uint32_t m, uint32_t r) {
  for (uint32_t i = 0; i < r; ++i) m &= m - 1;
  return std::countr_zero(m);
}

}  // namespace wsync::codec::internal
