// Per-block kernels of the chunk codec (private).
//
// The kernels turn a block of 32 elements into 32-bit masks (bit j =
// element j); WordMasker puts two blocks together into a 64-element word,
// or on AVX-512 hosts makes a word's masks at once. The class of an element
// is the number of thresholds its exponent reaches: class(x) = #{t :
// exponent(x) >= thr[t]}, with thresholds ascending, so the class masks
// follow from K-1 "ge" masks.
// The portable per-block logic is in wsync/codec/block_logic.h (shared with
// the device kernels); this adds the host's fast paths.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "wsync/codec/block_logic.h"
#include "wsync/codec/dtype.h"

namespace wsync::codec::internal {

using codec::ClassSpec;
using codec::kBlock;
using codec::kMaxClasses;
using codec::SelectBit;

// The class of every exponent of a spec (mask + 1 entries): a lookup per
// element instead of a comparison per threshold.
inline std::vector<uint8_t> ClassTable(const ClassSpec& spec) {
  std::vector<uint8_t> table(size_t{spec.mask} + 1);
  for (size_t e = 0; e < table.size(); ++e) table[e] = static_cast<uint8_t>(spec.ClassOf(e << spec.shift));
  return table;
}

// The low popcount(m) bits of v deposited, in order, at the set bits of m
// (BMI2's pdep), one set bit of v at a time: for hosts without a fast pdep.
inline uint64_t DepositBitsPortable(uint64_t v, uint64_t m) {
  const int n = std::popcount(m);
  if (n < 64) v &= (uint64_t{1} << n) - 1;
  uint64_t out = 0;
  const uint32_t low = static_cast<uint32_t>(std::popcount(static_cast<uint32_t>(m)));
  for (; v != 0; v &= v - 1) {
    const uint32_t r = static_cast<uint32_t>(std::countr_zero(v));
    const int j = r < low ? SelectBit(static_cast<uint32_t>(m), r)
                          : 32 + SelectBit(static_cast<uint32_t>(m >> 32), r - low);
    out |= uint64_t{1} << j;
  }
  return out;
}

// True when the CPU runs pdep in hardware: x86 with BMI2, except AMD before
// Zen 3 (family 0x19) and Hygon, whose microcoded pdep takes hundreds of
// cycles.
bool HasFastDeposit();

// DepositBitsPortable's result; pdep where fast (`fast`: HasFastDeposit()).
inline uint64_t DepositBits(uint64_t v, uint64_t m, bool fast) {
#if defined(__BMI2__)
  if (fast) return _pdep_u64(v, m);
#endif
  (void)fast;
  return DepositBitsPortable(v, m);
}

// Bit j of the result: a[j] != b[j]. REQUIRES: 32 readable elements each.
template <typename T>
inline uint32_t NeMask(const T* a, const T* b) {
  uint32_t m = 0;
  for (int j = 0; j < kBlock; ++j) m |= static_cast<uint32_t>(a[j] != b[j]) << j;
  return m;
}

#if defined(__AVX2__)
template <>
inline uint32_t NeMask<uint16_t>(const uint16_t* a, const uint16_t* b) {
  const auto* va = reinterpret_cast<const __m256i*>(a);
  const auto* vb = reinterpret_cast<const __m256i*>(b);
  const __m256i eq0 = _mm256_cmpeq_epi16(_mm256_loadu_si256(va), _mm256_loadu_si256(vb));
  const __m256i eq1 = _mm256_cmpeq_epi16(_mm256_loadu_si256(va + 1), _mm256_loadu_si256(vb + 1));
  const __m256i eq = _mm256_permute4x64_epi64(_mm256_packs_epi16(eq0, eq1), 0xD8);
  return ~static_cast<uint32_t>(_mm256_movemask_epi8(eq));
}
#endif

// True when the 32 elements are equal (the fast path of the diff).
template <typename T>
inline bool BlockEqual(const T* a, const T* b) {
  return std::memcmp(a, b, kBlock * sizeof(T)) == 0;
}

// The "ge" masks of one full block (32 elements): ge[t] bit j is set iff
// exponent(x[j]) >= thr[t], t < k - 1. Portable version; AVX2 below.
template <typename T>
class GeKernel {
 public:
  explicit GeKernel(const ClassSpec& spec) : spec_(spec) {}
  template <int K>
  void Fixed(const T* x, uint32_t* ge) const { (*this)(x, ge); }
  void operator()(const T* x, uint32_t* ge) const {
    int e[kBlock];
    for (int j = 0; j < kBlock; ++j) e[j] = spec_.Exponent(x[j]);
    for (int t = 0; t < spec_.k - 1; ++t) {
      uint32_t m = 0;
      for (int j = 0; j < kBlock; ++j) m |= static_cast<uint32_t>(e[j] >= spec_.thr[t]) << j;
      ge[t] = m;
    }
  }

 private:
  ClassSpec spec_;
};

#if defined(__AVX2__)
// 16-bit floats (BF16, FP16) have exponents of at most 8 bits: they are
// packed into bytes once and compared against every threshold as bytes.
template <>
class GeKernel<uint16_t> {
 public:
  explicit GeKernel(const ClassSpec& spec) : k_(spec.k) {
    shift_ = _mm_cvtsi32_si128(spec.shift);
    mask_ = _mm256_set1_epi16(static_cast<int16_t>(spec.mask & 0xFF));
    // Unsigned byte compare e >= thr as signed e ^ 0x80 > (thr - 1) ^ 0x80.
    // A threshold above 255 (not produced for these types) is never reached.
    // Threshold 0 (every element) and thresholds above 255 (no element; not
    // produced for these types, but a spec is data) compare against a
    // constant that no byte exceeds; 0 then sets every bit by or_.
    for (int t = 0; t < spec.k - 1; ++t) {
      const int thr = spec.thr[t];
      const bool compared = thr > 0 && thr <= 255;
      thr_[t] = _mm256_set1_epi8(static_cast<char>(compared ? ((thr - 1) ^ 0x80) & 0xFF : 0x7F));
      or_[t] = thr == 0 ? ~0u : 0u;
    }
  }
  void operator()(const uint16_t* x, uint32_t* ge) const { Masks(x, ge, k_); }
  // With the class count known at compile time (the sweeps' inner loops).
  template <int K>
  void Fixed(const uint16_t* x, uint32_t* ge) const { Masks(x, ge, K); }

 private:
  __attribute__((always_inline)) void Masks(const uint16_t* x, uint32_t* ge, int k) const {
    const auto* v = reinterpret_cast<const __m256i*>(x);
    const __m256i e0 = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256(v), shift_), mask_);
    const __m256i e1 = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256(v + 1), shift_), mask_);
    // packus interleaves 128-bit lanes; the permute restores element order.
    const __m256i e = _mm256_xor_si256(_mm256_permute4x64_epi64(_mm256_packus_epi16(e0, e1), 0xD8),
                                       _mm256_set1_epi8(static_cast<char>(0x80)));
#pragma GCC unroll 8
    for (int t = 0; t < k - 1; ++t) {
      ge[t] = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpgt_epi8(e, thr_[t]))) | or_[t];
    }
  }

  int k_;
  __m128i shift_;
  __m256i mask_;
  __m256i thr_[kMaxClasses - 1];
  uint32_t or_[kMaxClasses - 1] = {};  // all ones for threshold 0
};
#endif

// ---- 64-element words: the sweeps' unit (sweep.h).

inline constexpr size_t kWord = 64;

// A word's ge masks: bit j of [t] is set iff exponent(x[j]) >= thr[t].
using WordGe = uint64_t[kMaxClasses - 1];

// Asks for the cache lines of the word at x (64 elements) to be brought
// into L2, for a sweep that reads them a segment later: a sweep's loops over
// a segment in cache leave the memory idle, and the next segment's first
// reads would otherwise wait for DRAM.
template <typename T>
inline void PrefetchWord(const T* x) {
  const auto* bytes = reinterpret_cast<const char*>(x);
  for (size_t off = 0; off < kWord * sizeof(T); off += 64) __builtin_prefetch(bytes + off, 0, 2);
}

// The valid elements of word w of a run of len elements (REQUIRES: w * 64 <
// len): all 64, or the run's last ones.
inline uint64_t WordValid(size_t len, size_t w) {
  const size_t left = len - w * kWord;
  return left >= kWord ? ~uint64_t{0} : (uint64_t{1} << left) - 1;
}

// Which vector kernels WordMasker runs: the build's baseline (AVX2 on
// x86-64-v3 builds), or AVX-512 (F + BW) where the CPU has it. Both give the
// same masks; AVX-512 compares 64 exponents into a mask register at once.
enum class SimdPath { kBaseline, kAvx512 };

// True when this CPU runs AVX-512 F and BW (and the build targets x86-64).
bool HostHasAvx512();
// The path new WordMaskers take: kAvx512 where the host has it.
SimdPath ActiveSimdPath();
// Tests: makes new WordMaskers take `path` (kAvx512 only where the host has
// it; otherwise the baseline). Returns the path before.
SimdPath SetSimdPathForTesting(SimdPath path);

#if defined(__x86_64__)
#define WSYNC_TARGET_AVX512 __attribute__((target("avx512f,avx512bw")))

// WordMasker's AVX-512 kernel for 16-bit elements whose exponent field
// (mask <= 0xFF) is compared as bytes: thr8[t] = spec.thr[t] (<= mask).
template <int K, bool kDiff, bool kPartial>
WSYNC_TARGET_AVX512 __attribute__((always_inline)) inline void Word512(const uint16_t* x, const uint16_t* y,
                                                                       size_t len, __m128i shift, __m512i mask,
                                                                       const __m512i* thr, uint64_t* ne,
                                                                       uint64_t* ge) {
  // Partial: lanes at and past len load as zero and leave every mask.
  const uint64_t valid = kPartial ? (uint64_t{1} << len) - 1 : ~uint64_t{0};
  const __mmask32 v0 = static_cast<__mmask32>(valid), v1 = static_cast<__mmask32>(valid >> 32);
  const __m512i x0 = kPartial ? _mm512_maskz_loadu_epi16(v0, x) : _mm512_loadu_si512(x);
  const __m512i x1 = kPartial ? _mm512_maskz_loadu_epi16(v1, x + 32) : _mm512_loadu_si512(x + 32);
  if constexpr (kDiff) {
    const __m512i y0 = kPartial ? _mm512_maskz_loadu_epi16(v0, y) : _mm512_loadu_si512(y);
    const __m512i y1 = kPartial ? _mm512_maskz_loadu_epi16(v1, y + 32) : _mm512_loadu_si512(y + 32);
    *ne = _cvtmask64_u64(_mm512_kunpackd(_mm512_cmpneq_epu16_mask(x1, y1), _mm512_cmpneq_epu16_mask(x0, y0)));
  }
  if constexpr (K > 1) {
    // The 64 exponents as bytes; packus interleaves 128-bit lanes, the
    // permute restores element order (its zero-masking form: GCC 12 warns
    // about the plain one's undefined pass-through).
    const __m512i e0 = _mm512_and_si512(_mm512_srl_epi16(x0, shift), mask);
    const __m512i e1 = _mm512_and_si512(_mm512_srl_epi16(x1, shift), mask);
    const __m512i e = _mm512_maskz_permutexvar_epi64(0xFF, _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7),
                                                     _mm512_packus_epi16(e0, e1));
#pragma GCC unroll 8
    for (int t = 0; t < K - 1; ++t) ge[t] = _cvtmask64_u64(_mm512_cmpge_epu8_mask(e, thr[t])) & valid;
  }
}

// y and ne are read and written only when kDiff (null otherwise).
template <int K, bool kDiff>
WSYNC_TARGET_AVX512 void WordMasks512(const uint16_t* x, const uint16_t* y, size_t len, int shift, int mask,
                                      const uint16_t* thr8, uint64_t* ne, WordGe* ge) {
  const __m128i sh = _mm_cvtsi32_si128(shift);
  const __m512i mk = _mm512_set1_epi16(static_cast<int16_t>(mask));
  __m512i thr[K > 1 ? K - 1 : 1];
  for (int t = 0; t < K - 1; ++t) thr[t] = _mm512_set1_epi8(static_cast<char>(thr8[t]));
  const size_t full = len / kWord;
  for (size_t w = 0; w < full; ++w) {
    const size_t i = w * kWord;
    Word512<K, kDiff, false>(x + i, kDiff ? y + i : nullptr, kWord, sh, mk, thr, kDiff ? ne + w : nullptr, ge[w]);
  }
  if (len % kWord != 0) {
    const size_t i = full * kWord;
    Word512<K, kDiff, true>(x + i, kDiff ? y + i : nullptr, len - i, sh, mk, thr, kDiff ? ne + full : nullptr,
                            ge[full]);
  }
}
#endif

// The masks of a run of elements, word by word, for one ClassSpec: ne[w]
// (base != target) and ge[w][t] (t < K - 1) of word w, the last word's bits
// past the run clear.
template <typename T>
class WordMasker {
 public:
  explicit WordMasker(const ClassSpec& spec) : kernel_(spec), shift_(spec.shift), mask_(spec.mask) {
    for (int t = 0; t < spec.k - 1; ++t) thr_[t] = spec.thr[t];
    avx512_ = std::is_same_v<T, uint16_t> && spec.mask <= 0xFF && ActiveSimdPath() == SimdPath::kAvx512;
  }

  // Words [0, ceil(len / 64)) of base (and of target, when kDiff; else
  // target and ne are not read or written).
  template <int K, bool kDiff>
  void Run(const T* base, const T* target, size_t len, uint64_t* ne, WordGe* ge) const {
#if defined(__x86_64__)
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (avx512_) return WordMasks512<K, kDiff>(base, target, len, shift_, mask_, thr_, ne, ge);
    }
#endif
    for (size_t w = 0; w * kWord < len; ++w) {
      uint64_t ne_w = 0;
      uint32_t half[2][kMaxClasses - 1] = {};
      for (int h = 0; h < 2; ++h) {
        const size_t first = w * kWord + static_cast<size_t>(h) * kBlock;
        if (first >= len) break;
        uint32_t block_ne = 0;
        if (first + kBlock <= len) {
          if constexpr (kDiff) block_ne = NeMask(base + first, target + first);
          if constexpr (K > 1) kernel_.template Fixed<K>(base + first, half[h]);
        } else {
          // A partial block through a zeroed copy; its spare bits cleared.
          const size_t left = len - first;
          const uint32_t valid = (1u << left) - 1;
          T bx[kBlock] = {}, by[kBlock] = {};
          std::memcpy(bx, base + first, left * sizeof(T));
          if constexpr (kDiff) {
            std::memcpy(by, target + first, left * sizeof(T));
            block_ne = NeMask(bx, by) & valid;
          }
          if constexpr (K > 1) {
            kernel_.template Fixed<K>(bx, half[h]);
#pragma GCC unroll 8
            for (int t = 0; t < K - 1; ++t) half[h][t] &= valid;
          }
        }
        if constexpr (kDiff) ne_w |= uint64_t{block_ne} << (32 * h);
      }
      if constexpr (kDiff) ne[w] = ne_w;
#pragma GCC unroll 8
      for (int t = 0; t < K - 1; ++t) ge[w][t] = uint64_t{half[0][t]} | (uint64_t{half[1][t]} << 32);
    }
  }

 private:
  GeKernel<T> kernel_;
  int shift_;
  int mask_;
  uint16_t thr_[kMaxClasses - 1] = {};
  bool avx512_ = false;
};

}  // namespace wsync::codec::internal
