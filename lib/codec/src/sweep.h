// The host codec's block sweeps (private).
//
// Encoding: the diff, the base's exponent classes and the class rank of
// every change in one pass over base and target, segment by segment, so
// that the caller can digest each segment while it is still in cache. The
// result is what the staged chunk encoder takes (chunk_codec.h): positions,
// deltas, old values and ranks, the same numbers DiffChunk + RanksByClass
// compute in separate passes.
//
// Decoding: per-class ranks back to positions (ResolveRankSweep), one pass
// over the base.
//
// Both take the first change (or rank hit) of a block without a
// data-dependent branch: at RL change rates (0.1-10%) about half the blocks
// have none, and a branch on it would mispredict every other block.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "block_ops.h"
#include "chunk_codec.h"

namespace wsync::codec::internal {

// Elements per segment: base and target segments (32 KiB each in BF16) stay
// in L1/L2 between the sweep and the caller's digest.
inline constexpr size_t kSweepSegment = 16384;

// The change of a chunk, with what the staged encoder needs besides.
template <typename T>
struct ChunkSweep {
  SparseDelta<T> d;
  std::vector<T> old;          // the base at d.pos (filled when spec.k > 1)
  std::vector<uint32_t> rank;  // class ranks (filled when spec.k > 1)
};

// SweepChunk with the class count a constant.
template <int K, typename T, typename F>
void SweepChunkK(const T* base, const T* target, size_t n, const ClassSpec& spec, ChunkSweep<T>* out,
                 F&& segment_done) {
  constexpr int k = K;
  constexpr bool ranked = K > 1;
  const GeKernel<T> ge_kernel(spec);

  // Per-segment output, appended to *out at the segment's end; spare slots
  // for the unconditional write of the branch-free extraction.
  struct Scratch {
    uint32_t pos[kSweepSegment + 2];
    T delta[kSweepSegment + 2];
    T old[kSweepSegment + 2];
    uint32_t rank[kSweepSegment + 2];
  };
  auto s = std::make_unique_for_overwrite<Scratch>();

  // at[c]: the block's elements of class >= c (at[0] the valid ones, at[k]
  // none); reach[c]: such elements before the block. A change of class c at
  // bit j has rank reach[c] - reach[c+1] + popcount(at[c] & ~at[c+1] below j).
  uint32_t reach[K + 1] = {};
  uint32_t at[K + 1] = {};
  const std::vector<uint8_t> class_of = ranked ? ClassTable(spec) : std::vector<uint8_t>();

  for (size_t seg = 0; seg < n; seg += kSweepSegment) {
    const size_t seg_end = std::min(n, seg + kSweepSegment);
    size_t m = 0;
    for (size_t b = seg; b < seg_end; b += kBlock) {
      // emit() reads base and target directly, within the block's mask.
      uint32_t ne;
      if (b + kBlock <= seg_end) {
        ne = NeMask(base + b, target + b);
        at[0] = ~0u;
        if constexpr (ranked) ge_kernel.template Fixed<K>(base + b, at + 1);
      } else {
        const size_t len = seg_end - b;
        T bx[kBlock] = {}, by[kBlock] = {};
        std::memcpy(bx, base + b, len * sizeof(T));
        std::memcpy(by, target + b, len * sizeof(T));
        const uint32_t valid = (1u << len) - 1;
        ne = NeMask(bx, by) & valid;
        at[0] = valid;
        if constexpr (ranked) {
          ge_kernel.template Fixed<K>(bx, at + 1);
#pragma GCC unroll 8
          for (int c = 1; c < k; ++c) at[c] &= valid;
        }
      }

      // Writes change j of the block at slot m; the caller decides whether
      // the slot counts.
      auto emit = [&](int j) {
        const size_t i = b + static_cast<size_t>(j);
        const T old = base[i];
        s->pos[m] = static_cast<uint32_t>(i);
        s->delta[m] = static_cast<T>(target[i] - old);
        s->old[m] = old;
        if constexpr (ranked) {
          const int c = class_of[spec.Exponent(old)];
          const uint32_t below = (uint32_t{1} << j) - 1u;
          s->rank[m] = reach[c] - reach[c + 1] + static_cast<uint32_t>(std::popcount(at[c] & ~at[c + 1] & below));
        }
      };
      // The first change without a branch (slot m is written even when the
      // mask is empty: j is then 0, a valid element, and m does not
      // advance); more than one change in a block is the rarer case.
      emit(std::countr_zero(ne) & (kBlock - 1));
      m += ne != 0;
      ne &= ne - 1;
      while (ne != 0) {
        emit(std::countr_zero(ne));
        ++m;
        ne &= ne - 1;
      }
      if constexpr (ranked) {
#pragma GCC unroll 8
        for (int c = 0; c < k; ++c) reach[c] += static_cast<uint32_t>(std::popcount(at[c]));
      }
    }
    out->d.pos.insert(out->d.pos.end(), s->pos, s->pos + m);
    out->d.delta.insert(out->d.delta.end(), s->delta, s->delta + m);
    if (ranked) {
      out->old.insert(out->old.end(), s->old, s->old + m);
      out->rank.insert(out->rank.end(), s->rank, s->rank + m);
    }
    segment_done(seg, seg_end - seg);
  }
}

// Sweeps n elements of base and target. With spec.k == 1 only the diff is
// taken. segment_done(begin, len) runs after each segment [begin, begin+len).
template <typename T, typename F>
void SweepChunk(const T* base, const T* target, size_t n, const ClassSpec& spec, ChunkSweep<T>* out,
                F&& segment_done) {
  out->d.Clear();
  out->old.clear();
  out->rank.clear();
  static_assert(kMaxClasses == 8);
  switch (spec.k) {
    case 1: return SweepChunkK<1>(base, target, n, spec, out, segment_done);
    case 2: return SweepChunkK<2>(base, target, n, spec, out, segment_done);
    case 3: return SweepChunkK<3>(base, target, n, spec, out, segment_done);
    case 4: return SweepChunkK<4>(base, target, n, spec, out, segment_done);
    case 5: return SweepChunkK<5>(base, target, n, spec, out, segment_done);
    case 6: return SweepChunkK<6>(base, target, n, spec, out, segment_done);
    case 7: return SweepChunkK<7>(base, target, n, spec, out, segment_done);
    default: return SweepChunkK<8>(base, target, n, spec, out, segment_done);
  }
}

// The changes in the sampled blocks of a chunk (those SampleHistogram
// counts), with their old values: the class chooser's evidence.
template <typename T>
void SampleChanges(const T* base, const T* target, size_t n, SparseDelta<T>* d, std::vector<T>* old) {
  d->Clear();
  old->clear();
  const size_t blocks = n / kBlock;
  for (size_t b = 0; b < blocks; b += kSampleStride) {
    const size_t first = b * kBlock;
    uint32_t ne = NeMask(base + first, target + first);
    while (ne != 0) {
      const size_t i = first + static_cast<size_t>(std::countr_zero(ne));
      d->pos.push_back(static_cast<uint32_t>(i));
      d->delta.push_back(static_cast<T>(target[i] - base[i]));
      old->push_back(base[i]);
      ne &= ne - 1;
    }
  }
}

// The end of a class's ranks in ResolveRankSweep's input.
inline constexpr uint32_t kNoRank = 0xFFFFFFFFu;

// ResolveRankSweep with the class count a constant.
template <int K, typename T>
size_t ResolveRankSweepK(const T* base, size_t n, const ClassSpec& spec, const uint32_t* const* ranks,
                         size_t total, uint32_t* pos, uint64_t* done_out) {
  const GeKernel<T> ge_kernel(spec);
  // Per class c: rank[c] its ranks, next[c] the index of its next change
  // there, left[c] that change's index among the class's members from the
  // current block on. A class whose ranks are exhausted has left[c] huge
  // (kNoRank - r: never inside a block). With AVX2 the left[] of all classes
  // live in one vector, so the per-block test and update are one operation
  // each; the portable form keeps an array.
  const uint32_t* rank[K];
  uint32_t next[K];
  uint32_t ge[K] = {};
  uint32_t member[K] = {};
  uint32_t in_block[8] = {};  // [K, 8): 0
#if defined(__AVX2__)
  static_assert(K <= 8);
  alignas(32) uint32_t init[8];
  for (int c = 0; c < 8; ++c) init[c] = c < K ? ranks[c][0] : kNoRank;
  __m256i left = _mm256_load_si256(reinterpret_cast<const __m256i*>(init));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  auto left_of = [&](int c) {
    return static_cast<uint32_t>(_mm256_cvtsi256_si32(_mm256_permutevar8x32_epi32(left, _mm256_set1_epi32(c))));
  };
  auto add_left = [&](int c, uint32_t delta) {
    const __m256i at = _mm256_cmpeq_epi32(lane, _mm256_set1_epi32(c));
    left = _mm256_add_epi32(left, _mm256_and_si256(at, _mm256_set1_epi32(static_cast<int>(delta))));
  };
#else
  uint32_t left_array[K];
  for (int c = 0; c < K; ++c) left_array[c] = ranks[c][0];
  auto left_of = [&](int c) { return left_array[c]; };
  auto add_left = [&](int c, uint32_t delta) { left_array[c] += delta; };
#endif
  for (int c = 0; c < K; ++c) {
    rank[c] = ranks[c];
    next[c] = 0;
  }

  // Takes class c's next change when `take` (else changes nothing): its bit
  // in the block, then the class's following change. Returns the class's
  // new left.
  auto step = [&](int c, uint32_t take, uint64_t* changed) {
    const uint32_t l = left_of(c);
    const uint32_t mask = 0u - take;
    *changed |= (uint64_t{1} << SelectBitFast(member[c], l & (kBlock - 1))) & (uint64_t{0} - take);
    const uint32_t r = rank[c][next[c]];
    const uint32_t delta = (rank[c][next[c] + take] - r) & mask;
    next[c] += take;
    add_left(c, delta);
    return l + delta;
  };

  size_t found = 0;
  const size_t blocks = (n + kBlock - 1) / kBlock;
  for (size_t b = 0; b < blocks && found < total; ++b) {
    const size_t first = b * kBlock;
    uint32_t valid = ~0u;
    if (first + kBlock <= n) {
      __builtin_prefetch(base + first + 1024);
      ge_kernel.template Fixed<K>(base + first, ge);
    } else {
      T tmp[kBlock] = {};
      std::memcpy(tmp, base + first, (n - first) * sizeof(T));
      valid = (1u << (n - first)) - 1;
      ge_kernel.template Fixed<K>(tmp, ge);
    }
    uint32_t upper = valid;
#pragma GCC unroll 8
    for (int c = 0; c < K - 1; ++c) {
      member[c] = upper & ~ge[c];
      upper = ge[c] & valid;
    }
    member[K - 1] = upper;
#pragma GCC unroll 8
    for (int c = 0; c < K; ++c) in_block[c] = static_cast<uint32_t>(std::popcount(member[c]));
    // hits: the classes with a change in this block (left < in_block).
#if defined(__AVX2__)
    const auto* in_lanes = reinterpret_cast<const int*>(in_block);  // lanes from K on stay 0
    const __m256i in = _mm256_setr_epi32(in_lanes[0], in_lanes[1], in_lanes[2], in_lanes[3], in_lanes[4],
                                         in_lanes[5], in_lanes[6], in_lanes[7]);
    const __m256i at_least = _mm256_cmpeq_epi32(_mm256_max_epu32(left, in), left);  // left >= in
    uint32_t hits = ~static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(at_least))) & ((1u << K) - 1);
#else
    uint32_t hits = 0;
#pragma GCC unroll 8
    for (int c = 0; c < K; ++c) hits |= static_cast<uint32_t>(left_array[c] < in_block[c]) << c;
#endif
    // The first class with a change without a branch (a step that takes
    // nothing when there is none); then any others, and further changes of
    // the same class.
    uint64_t changed = 0;
    const uint32_t any = hits != 0;
    const int c0 = std::countr_zero(hits | (uint32_t{1} << (K - 1)));
    const uint32_t l0 = step(c0, any, &changed);
    hits &= hits - 1;
    hits |= static_cast<uint32_t>(any & (l0 < in_block[c0])) << c0;
    while (hits != 0) {
      const int c = std::countr_zero(hits);
      hits &= hits - 1;
      while (step(c, 1, &changed) < in_block[c]) {
      }
    }
    // Changes of different classes interleave in position: the mask orders them.
    uint32_t bits = static_cast<uint32_t>(changed);
    pos[found] = static_cast<uint32_t>(first) + (static_cast<uint32_t>(std::countr_zero(bits)) & (kBlock - 1));
    found += bits != 0;
    bits &= bits - 1;
    while (bits != 0) {
      pos[found++] = static_cast<uint32_t>(first) + static_cast<uint32_t>(std::countr_zero(bits));
      bits &= bits - 1;
    }
#if defined(__AVX2__)
    left = _mm256_sub_epi32(left, in);
#else
#pragma GCC unroll 8
    for (int c = 0; c < K; ++c) left_array[c] -= in_block[c];
#endif
  }
  for (int c = 0; c < K; ++c) done_out[c] = next[c];
  return found;
}

// Turns per-class ranks into positions by sweeping the base's classes:
// ranks[c] holds class c's ascending ranks followed by kNoRank; total is the
// number of ranks. Writes the positions, ascending, to pos (room for total
// + 1) and returns how many were found: fewer when a rank lies beyond its
// class, and then done[c] is the index of class c's first rank not found.
template <typename T>
size_t ResolveRankSweep(const T* base, size_t n, const ClassSpec& spec, const uint32_t* const* ranks, size_t total,
                        uint32_t* pos, uint64_t* done) {
  switch (spec.k) {
    case 2: return ResolveRankSweepK<2>(base, n, spec, ranks, total, pos, done);
    case 3: return ResolveRankSweepK<3>(base, n, spec, ranks, total, pos, done);
    case 4: return ResolveRankSweepK<4>(base, n, spec, ranks, total, pos, done);
    case 5: return ResolveRankSweepK<5>(base, n, spec, ranks, total, pos, done);
    case 6: return ResolveRankSweepK<6>(base, n, spec, ranks, total, pos, done);
    case 7: return ResolveRankSweepK<7>(base, n, spec, ranks, total, pos, done);
    default: return ResolveRankSweepK<8>(base, n, spec, ranks, total, pos, done);
  }
}

}  // namespace wsync::codec::internal
