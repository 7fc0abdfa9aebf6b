// The host encoder's fused sweep of a chunk (private): the diff, the base's
// exponent classes and the class rank of every change in one pass over base
// and target, segment by segment, so that the caller can digest each segment
// while it is still in cache. The result is what the staged chunk encoder
// takes (chunk_codec.h): positions, deltas, old values and ranks, the same
// numbers DiffChunk + RanksByClass compute in separate passes.
//
// Changes are taken out of a block's mask without data-dependent branches
// for the first two (the common case at RL change rates, 0.1-10%), so the
// sweep does not pay a misprediction per block.
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

  // Per-segment output, appended to *out at the segment's end; two spare
  // slots for the unconditional writes of the branch-free extraction.
  struct Scratch {
    uint32_t pos[kSweepSegment + 2];
    T delta[kSweepSegment + 2];
    T old[kSweepSegment + 2];
    uint32_t rank[kSweepSegment + 2];
  };
  auto s = std::make_unique_for_overwrite<Scratch>();

  // count[c]: elements of class c before the current block; member[c]: the
  // block's members of class c. A change of class c at bit j has rank
  // count[c] + popcount(member[c] below j).
  uint32_t count[kMaxClasses] = {};
  uint32_t member[kMaxClasses] = {};
  uint32_t ge[kMaxClasses] = {};
  std::vector<uint8_t> class_of;  // exponent -> class
  if (ranked) {
    class_of.resize(size_t{spec.mask} + 1);
    for (size_t e = 0; e < class_of.size(); ++e) class_of[e] = static_cast<uint8_t>(spec.ClassOf(e << spec.shift));
  }

  for (size_t seg = 0; seg < n; seg += kSweepSegment) {
    const size_t seg_end = std::min(n, seg + kSweepSegment);
    size_t m = 0;
    for (size_t b = seg; b < seg_end; b += kBlock) {
      // emit() reads base and target directly, within the block's mask.
      uint32_t ne;
      uint32_t valid = ~0u;
      if (b + kBlock <= seg_end) {
        ne = NeMask(base + b, target + b);
        if constexpr (ranked) ge_kernel.template Fixed<K>(base + b, ge);
      } else {
        const size_t len = seg_end - b;
        T bx[kBlock] = {}, by[kBlock] = {};
        std::memcpy(bx, base + b, len * sizeof(T));
        std::memcpy(by, target + b, len * sizeof(T));
        valid = (1u << len) - 1;
        ne = NeMask(bx, by) & valid;
        if constexpr (ranked) ge_kernel.template Fixed<K>(bx, ge);
      }
      if constexpr (ranked) {
        // Nested ge masks to class members: c has ge[c-1] & ~ge[c].
        uint32_t upper = valid;
        #pragma GCC unroll 8
        for (int c = 0; c < k - 1; ++c) {
          member[c] = upper & ~ge[c];
          upper = ge[c] & valid;
        }
        member[k - 1] = upper;
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
          s->rank[m] = count[c] + static_cast<uint32_t>(std::popcount(member[c] & below));
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
        for (int c = 0; c < k; ++c) count[c] += static_cast<uint32_t>(std::popcount(member[c]));
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

}  // namespace wsync::codec::internal

namespace wsync::codec::internal {

// ResolveRankSweep with the class count a constant.
template <int K, typename T>
size_t ResolveRankSweepK(const T* base, size_t n, const ClassSpec& spec, const uint32_t* const* ranks,
                         const uint64_t* counts, uint32_t* pos, uint32_t* seen_out, uint64_t* done_out) {
  const GeKernel<T> ge_kernel(spec);
  // For class c: want[c] is the rank of its next change (UINT64_MAX when
  // none is left), seen[c] its elements before the current block.
  uint64_t want[K];
  uint64_t done[K] = {};
  uint32_t seen[K] = {};
  int pending = 0;
  #pragma GCC unroll 8
  for (int c = 0; c < K; ++c) {
    want[c] = counts[c] > 0 ? ranks[c][0] : UINT64_MAX;
    pending += counts[c] > 0;
  }
  uint32_t ge[K] = {};
  uint32_t member[K];
  uint32_t in_block[K];
  size_t found = 0;
  const size_t blocks = (n + kBlock - 1) / kBlock;
  for (size_t b = 0; b < blocks && pending > 0; ++b) {
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
    uint32_t hits = 0;  // classes with a change in this block
    #pragma GCC unroll 8
    for (int c = 0; c < K - 1; ++c) {
      member[c] = upper & ~ge[c];
      upper = ge[c] & valid;
    }
    member[K - 1] = upper;
    #pragma GCC unroll 8
    for (int c = 0; c < K; ++c) {
      in_block[c] = static_cast<uint32_t>(std::popcount(member[c]));
      hits |= static_cast<uint32_t>(want[c] < uint64_t{seen[c]} + in_block[c]) << c;
    }
    if (hits != 0) {
      // Changes of one class come in rank order, so a class's positions in
      // the block ascend; the union of all is taken as a bit mask.
      uint32_t changed = 0;
      do {
        const int c = std::countr_zero(hits);
        hits &= hits - 1;
        do {
          changed |= uint32_t{1} << SelectBitFast(member[c], static_cast<uint32_t>(want[c] - seen[c]));
          want[c] = ++done[c] < counts[c] ? ranks[c][done[c]] : UINT64_MAX;
          pending -= done[c] == counts[c];
        } while (want[c] < uint64_t{seen[c]} + in_block[c]);
      } while (hits != 0);
      do {
        pos[found++] = static_cast<uint32_t>(first) + static_cast<uint32_t>(std::countr_zero(changed));
        changed &= changed - 1;
      } while (changed != 0);
    }
    #pragma GCC unroll 8
    for (int c = 0; c < K; ++c) seen[c] += in_block[c];
  }
  #pragma GCC unroll 8
  for (int c = 0; c < K; ++c) {
    seen_out[c] = seen[c];
    done_out[c] = done[c];
  }
  return found;
}

// Turns per-class ranks into positions by sweeping the base's classes:
// ranks[c] holds counts[c] ascending ranks of class c. Writes the positions,
// ascending, to pos and returns how many were found; fewer than the ranks
// when one lies beyond its class (then seen[c] is class c's size and done[c]
// the index of its first rank not found).
template <typename T>
size_t ResolveRankSweep(const T* base, size_t n, const ClassSpec& spec, const uint32_t* const* ranks,
                        const uint64_t* counts, uint32_t* pos, uint32_t* seen, uint64_t* done) {
  switch (spec.k) {
    case 2: return ResolveRankSweepK<2>(base, n, spec, ranks, counts, pos, seen, done);
    case 3: return ResolveRankSweepK<3>(base, n, spec, ranks, counts, pos, seen, done);
    case 4: return ResolveRankSweepK<4>(base, n, spec, ranks, counts, pos, seen, done);
    case 5: return ResolveRankSweepK<5>(base, n, spec, ranks, counts, pos, seen, done);
    case 6: return ResolveRankSweepK<6>(base, n, spec, ranks, counts, pos, seen, done);
    case 7: return ResolveRankSweepK<7>(base, n, spec, ranks, counts, pos, seen, done);
    default: return ResolveRankSweepK<8>(base, n, spec, ranks, counts, pos, seen, done);
  }
}

}  // namespace wsync::codec::internal
