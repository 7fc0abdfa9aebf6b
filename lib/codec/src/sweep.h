// The host codec's block sweeps (private).
//
// Encoding: the diff, the base's exponent classes and the class rank of
// every change in one pass over base and target, segment by segment, so
// that the caller can digest each segment while it is still in cache. The
// result is what the sparse coder takes (chunk_codec.h): positions, deltas,
// each change's class, and the ranks grouped by class -- the numbers
// DiffChunk + RanksByClass compute in separate passes, already in the order
// the position stream codes them.
//
// Decoding: per-class ranks back to positions (ResolveRankSweep), one pass
// over the base.
//
// Neither branches on whether a block has a change: at RL change rates
// (0.1-10%) about half the blocks have none, and such a branch would
// mispredict every other block. The encode sweep takes the first change of
// a block without a branch; the resolution deposits bits (no branch at all).
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "block_ops.h"
#include "chunk_codec.h"

namespace wsync::codec::internal {

// Elements per segment: base and target segments (32 KiB each in BF16) stay
// in L1/L2 between the sweep and the caller's digest.
inline constexpr size_t kSweepSegment = 16384;

// The change of a chunk, with what the sparse coder needs besides.
template <typename T>
struct ChunkSweep {
  SparseDelta<T> d;
  // Filled when spec.k > 1: each change's class, in position order, and
  // class c's ranks (ascending: the changes of class c in position order).
  std::vector<uint8_t> cls;
  std::vector<uint32_t> rank[kMaxClasses];
};

// SweepChunk with the class count a constant.
template <int K, typename T, typename F>
void SweepChunkK(const T* base, const T* target, size_t n, const ClassSpec& spec, ChunkSweep<T>* out,
                 F&& segment_done) {
  constexpr bool ranked = K > 1;
  constexpr size_t kSegmentWords = kSweepSegment / kWord;
  static_assert(kSweepSegment % kWord == 0);
  const WordMasker<T> masker(spec);

  // Per-segment masks and output, the output appended to *out at the
  // segment's end; spare slots for the unconditional write of the
  // branch-free extraction. Each class has room for the whole segment, so
  // a rank goes straight to its class's list (only the used part of each
  // is touched).
  struct Scratch {
    uint64_t ne[kSegmentWords];
    WordGe ge[kSegmentWords];
    uint32_t pos[kSweepSegment + 2];
    T delta[kSweepSegment + 2];
    uint8_t cls[kSweepSegment + 2];
    uint32_t rank[ranked ? K : 1][kSweepSegment + 2];
  };
  auto s = std::make_unique_for_overwrite<Scratch>();

  // at[c]: the word's elements of class >= c (at[0] the valid ones, at[K]
  // none); reach[c]: such elements before the word. A change of class c at
  // bit j has rank reach[c] - reach[c+1] + popcount(at[c] & ~at[c+1] below j).
  uint32_t reach[K + 1] = {};
  uint64_t at[K + 1] = {};
  const std::vector<uint8_t> class_of = ranked ? ClassTable(spec) : std::vector<uint8_t>();

  for (size_t seg = 0; seg < n; seg += kSweepSegment) {
    const size_t seg_len = std::min(n - seg, kSweepSegment);
    masker.template Run<K, true>(base + seg, target + seg, seg_len, s->ne, s->ge);
    size_t m = 0;
    size_t ranks[K] = {};  // this segment's ranks of each class
    // The next segment's words are fetched while this one's are ranked.
    const size_t next_len = seg + kSweepSegment < n ? std::min(n - seg - kSweepSegment, kSweepSegment) : 0;
    for (size_t w = 0; w * kWord < seg_len; ++w) {
      const size_t b = seg + w * kWord;
      if (w * kWord < next_len) {
        PrefetchWord(base + b + kSweepSegment);
        PrefetchWord(target + b + kSweepSegment);
      }
      at[0] = WordValid(seg_len, w);
#pragma GCC unroll 8
      for (int c = 1; c < K; ++c) at[c] = s->ge[w][c - 1];
      uint64_t ne = s->ne[w];

      // Writes change j of the word at slot m (and its rank at its class's
      // next slot); counts it when `counts` is 1. emit() reads base and
      // target directly.
      auto emit = [&](int j, size_t counts) {
        const size_t i = b + static_cast<size_t>(j);
        const T old = base[i];
        s->pos[m] = static_cast<uint32_t>(i);
        s->delta[m] = static_cast<T>(target[i] - old);
        if constexpr (ranked) {
          const int c = class_of[spec.Exponent(old)];
          const uint64_t below = (uint64_t{1} << j) - 1u;
          s->cls[m] = static_cast<uint8_t>(c);
          s->rank[c][ranks[c]] =
              reach[c] - reach[c + 1] + static_cast<uint32_t>(std::popcount(at[c] & ~at[c + 1] & below));
          ranks[c] += counts;
        }
        m += counts;
      };
      // The first change without a branch (slot m is written even when the
      // mask is empty: j is then 0, a valid element, and nothing advances);
      // more than one change in a word is the rarer case.
      emit(std::countr_zero(ne) & (kWord - 1), ne != 0);
      ne &= ne - 1;
      while (ne != 0) {
        emit(std::countr_zero(ne), 1);
        ne &= ne - 1;
      }
      if constexpr (ranked) {
#pragma GCC unroll 8
        for (int c = 0; c < K; ++c) reach[c] += static_cast<uint32_t>(std::popcount(at[c]));
      }
    }
    out->d.pos.insert(out->d.pos.end(), s->pos, s->pos + m);
    out->d.delta.insert(out->d.delta.end(), s->delta, s->delta + m);
    if constexpr (ranked) {
      out->cls.insert(out->cls.end(), s->cls, s->cls + m);
      for (int c = 0; c < K; ++c) out->rank[c].insert(out->rank[c].end(), s->rank[c], s->rank[c] + ranks[c]);
    }
    segment_done(seg, seg_len);
  }
}

// Sweeps n elements of base and target. With spec.k == 1 only the diff is
// taken. segment_done(begin, len) runs after each segment [begin, begin+len).
template <typename T, typename F>
void SweepChunk(const T* base, const T* target, size_t n, const ClassSpec& spec, ChunkSweep<T>* out,
                F&& segment_done) {
  out->d.Clear();
  out->cls.clear();
  for (auto& r : out->rank) r.clear();
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

// Words per ResolveRankSweep segment: the segment's class masks (7 KiB)
// stay in L1 between the phases.
inline constexpr size_t kResolveWords = 128;

// ResolveRankSweep with the class count a constant. Each class's ranks are
// first set as bits of a bitmap over the class's members (bit r: its r-th
// member changed). Then, segment by segment: the ge masks of every
// 64-element word (no dependency between words); then class by class,
// each word's mask takes the class's next popcount(mask) bitmap bits by a
// bit deposit -- the word's changes of that class, without a branch however
// many there are; last, the segment's change bitmap in position order.
template <int K, typename T>
size_t ResolveRankSweepK(const T* base, size_t n, const ClassSpec& spec, const uint32_t* const* ranks,
                         const uint64_t* count, uint32_t* pos, uint64_t* done_out) {
  static const bool fast_deposit = HasFastDeposit();
  // Class c's bitmap is words [offset[c], offset[c + 1]): its ranks' bits
  // and a zero word past them (the extraction reads two words).
  size_t total = 0, offset[K + 1] = {};
  for (int c = 0; c < K; ++c) {
    total += count[c];
    const size_t bits = count[c] == 0 ? 0 : size_t{ranks[c][count[c] - 1]} + 1;
    offset[c + 1] = offset[c] + (bits + 63) / 64 + 1;
  }
  static thread_local std::vector<uint64_t> rank_bits;  // capacity kept from chunk to chunk
  rank_bits.assign(offset[K], 0);
  for (int c = 0; c < K; ++c) {
    uint64_t* bits = rank_bits.data() + offset[c];
    for (size_t i = 0; i < count[c]; ++i) bits[ranks[c][i] >> 6] |= uint64_t{1} << (ranks[c][i] & 63);
  }

  const WordMasker<T> masker(spec);
  alignas(64) WordGe ge[kResolveWords];
  alignas(64) uint64_t changed[kResolveWords];
  // Class c's members before the word being read; once past the bitmap
  // (every rank below it) the class is done and no longer counted.
  uint64_t seen[K] = {};
  size_t found = 0;
  for (size_t seg = 0; seg < n && found < total; seg += kResolveWords * kWord) {
    const size_t seg_n = std::min(n - seg, kResolveWords * kWord);
    const size_t words = (seg_n + kWord - 1) / kWord;
    masker.template Run<K, false>(base + seg, nullptr, seg_n, nullptr, ge);
    std::fill_n(changed, words, uint64_t{0});

    // Class by class, each with its own loop (the class a constant: its
    // member mask's form is fixed, no select per word). Class c's members:
    // ge[c - 1] & ~ge[c]; class 0 takes the valid elements below the first
    // threshold, the last class everything from the last threshold up.
    const uint64_t last_valid = WordValid(seg_n, words - 1);
    auto resolve_class = [&]<int C>(std::integral_constant<int, C>) {
      const uint64_t* bits = rank_bits.data() + offset[C];
      const uint64_t limit = (offset[C + 1] - offset[C] - 1) * 64;
      uint64_t at = seen[C];
      for (size_t w = 0; w < words && at < limit; ++w) {
        uint64_t m;
        if constexpr (C == 0) {
          m = w + 1 < words ? ~uint64_t{0} : last_valid;
        } else {
          m = ge[w][C - 1];
        }
        if constexpr (C < K - 1) m &= ~ge[w][C];
        const size_t i = at >> 6;
        const unsigned sh = at & 63;
        // The 64 bitmap bits from `at` on (the high word's shift in two
        // steps: a shift by 64 is undefined).
        const uint64_t next = (bits[i] >> sh) | ((bits[i + 1] << 1) << (63 - sh));
        changed[w] |= DepositBits(next, m, fast_deposit);
        at += static_cast<uint64_t>(std::popcount(m));
      }
      seen[C] = at;
    };
    [&]<int... Cs>(std::integer_sequence<int, Cs...>) {
      (resolve_class(std::integral_constant<int, Cs>{}), ...);
    }(std::make_integer_sequence<int, K>{});

    // The first two changes of a word without a branch: pos has room for
    // two past the last. Meanwhile the next segment's words are fetched.
    const size_t next = seg + kResolveWords * kWord;
    const size_t next_words = next < n ? (std::min(n - next, kResolveWords * kWord) + kWord - 1) / kWord : 0;
    for (size_t w = 0; w < words; ++w) {
      if (w < next_words) PrefetchWord(base + next + w * kWord);
      uint64_t bits = changed[w];
      const uint32_t at = static_cast<uint32_t>(seg + w * 64);
      const int changes = std::popcount(bits);
      pos[found] = at + (static_cast<uint32_t>(std::countr_zero(bits)) & 63);
      bits &= bits - 1;
      pos[found + 1] = at + (static_cast<uint32_t>(std::countr_zero(bits)) & 63);
      bits &= bits - 1;
      found += static_cast<size_t>(std::min(changes, 2));
      while (bits != 0) {
        pos[found++] = at + static_cast<uint32_t>(std::countr_zero(bits));
        bits &= bits - 1;
      }
    }
  }
  // A class's ranks below its size were found (all of them once the sweep
  // stopped early, or the class's walk did).
  for (int c = 0; c < K; ++c) {
    done_out[c] = found == total ? count[c]
                                 : static_cast<uint64_t>(std::lower_bound(ranks[c], ranks[c] + count[c], seen[c]) - ranks[c]);
  }
  return found;
}

// Turns per-class ranks into positions by sweeping the base's classes:
// ranks[c] holds class c's count[c] ascending ranks. Writes the positions,
// ascending, to pos (room for their total + 2) and returns how many were
// found: fewer when a rank lies beyond its class, and then done[c] is the
// index of class c's first rank not found.
template <typename T>
size_t ResolveRankSweep(const T* base, size_t n, const ClassSpec& spec, const uint32_t* const* ranks,
                        const uint64_t* count, uint32_t* pos, uint64_t* done) {
  switch (spec.k) {
    case 2: return ResolveRankSweepK<2>(base, n, spec, ranks, count, pos, done);
    case 3: return ResolveRankSweepK<3>(base, n, spec, ranks, count, pos, done);
    case 4: return ResolveRankSweepK<4>(base, n, spec, ranks, count, pos, done);
    case 5: return ResolveRankSweepK<5>(base, n, spec, ranks, count, pos, done);
    case 6: return ResolveRankSweepK<6>(base, n, spec, ranks, count, pos, done);
    case 7: return ResolveRankSweepK<7>(base, n, spec, ranks, count, pos, done);
    default: return ResolveRankSweepK<8>(base, n, spec, ranks, count, pos, done);
  }
}

}  // namespace wsync::codec::internal
