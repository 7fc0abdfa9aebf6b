// The encoding of a sparse chunk (mode 1, docs/patch-format.md "Sparse
// positions", "Values" and "rANS streams") written once over plain memory,
// as WSYNC_HD agents, the encoder's side of sparse_decode.h. The host codec
// makes every decision of its coders with these functions (each change's
// value symbol and bits, each gap's symbol and bits at a class's shift, the
// choice of shift, every frequency table and its header, each rANS step and
// the layout of a stream); EncodeSparseChunk composes them into a chunk's
// sparse position and value streams for the device codec, one chunk per
// thread. The host tests check EncodeSparseChunk against the host's chunk
// coder bit for bit.
//
// Costs are fixed-point integers (2^-16 bits, from one log2 table), not
// floating point: the host and the device compare the same numbers and so
// choose the same tables and shifts.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#if !defined(__CUDA_ARCH__)
#include <bit>
#endif

#include "wsync/codec/block_logic.h"
#include "wsync/codec/sparse_decode.h"

namespace wsync::codec::sparse {

WSYNC_HD inline int BitWidth64(uint64_t v) {
#if defined(__CUDA_ARCH__)
  return 64 - __clzll(static_cast<long long>(v));
#else
  return std::bit_width(v);
#endif
}

// Bits of Elias gamma of v + 1 (BitOut::PutGamma(v)).
WSYNC_HD inline int GammaBits(uint64_t v) { return 2 * (BitWidth64(v + 1) - 1) + 1; }

// ------------------------------------------------------------------ bits

// Bits out, least significant first (bit i of the stream is bit i % 8 of
// byte i / 8, an n-bit field low bit first), into at most `cap` bytes: what
// would not fit is counted but not written (overflow()). Bits gather in a
// register and leave 32 at a time: a store per field that the next field's
// load overlaps would miss store-to-load forwarding, a stall per field.
class BitOut {
 public:
  // acc holds `fill` (< 8) bits already begun at out[0].
  WSYNC_HD BitOut(uint8_t* out, uint64_t cap, uint64_t acc = 0, int fill = 0)
      : out_(out), cap_(cap), acc_(acc), fill_(fill) {}
  // n <= 64.
  WSYNC_HD __attribute__((always_inline)) void Put(uint64_t v, int n) {
    if (n > 32) {
      Put32(v & 0xFFFFFFFFu, 32);
      Put32(v >> 32, n - 32);
    } else {
      Put32(v, n);
    }
  }
  // Elias gamma of v + 1: k = bitlen(v + 1) - 1 zeros, a one, then the k
  // low bits of v + 1 (at most 127 bits). REQUIRES: v < 2^64 - 1.
  WSYNC_HD __attribute__((always_inline)) void PutGamma(uint64_t v) {
    const uint64_t u = v + 1;
    const int k = BitWidth64(u) - 1;
    Put(uint64_t{1} << k, k + 1);
    Put(u, k);
  }
  // Bits put so far (the `fill` given at construction included).
  WSYNC_HD uint64_t bits() const { return at_ * 8 + static_cast<uint64_t>(fill_); }
  // Writes the bits still in the register (the last byte zero-padded);
  // returns the bytes of the stream. Nothing may be put after.
  WSYNC_HD uint64_t Close() {
    const uint64_t bytes = (bits() + 7) / 8;
    for (uint64_t i = at_; i < bytes; ++i, acc_ >>= 8) Store8(i, static_cast<uint8_t>(acc_));
    return bytes;
  }
  WSYNC_HD bool overflow() const { return overflow_; }

 private:
  WSYNC_HD __attribute__((always_inline)) void Put32(uint64_t v, int n) {  // n <= 32, fill_ < 32
    acc_ |= (v & ~(~uint64_t{0} << n)) << fill_;
    fill_ += n;
    if (fill_ >= 32) {
      const uint32_t word = static_cast<uint32_t>(acc_);
      if (at_ + 4 <= cap_) {
#if defined(__CUDA_ARCH__)
        for (int b = 0; b < 4; ++b) out_[at_ + b] = static_cast<uint8_t>(word >> (8 * b));
#else
        __builtin_memcpy(out_ + at_, &word, 4);
#endif
      } else {
        overflow_ = true;
      }
      at_ += 4;
      acc_ >>= 32;
      fill_ -= 32;
    }
  }
  WSYNC_HD void Store8(uint64_t i, uint8_t b) {
    if (i < cap_) {
      out_[i] = b;
    } else {
      overflow_ = true;
    }
  }
  uint8_t* out_;
  uint64_t cap_;
  uint64_t at_ = 0;  // bytes stored
  uint64_t acc_;
  int fill_;
  bool overflow_ = false;
};

// Bytes out with a bound, as BitOut.
struct ByteOut {
  uint8_t* out;
  uint64_t cap;
  uint64_t at = 0;
  bool overflow = false;
  WSYNC_HD void U8(uint8_t b) {
    if (at < cap) {
      out[at] = b;
    } else {
      overflow = true;
    }
    ++at;
  }
  WSYNC_HD void Varint(uint64_t v) {
    while (v >= 0x80) {
      U8(static_cast<uint8_t>(v) | 0x80);
      v >>= 7;
    }
    U8(static_cast<uint8_t>(v));
  }
};

// ----------------------------------------------------------------- costs

inline constexpr int kCostFraction = 16;  // costs are in 2^-16 bits

// floor(log2(f) * 2^16) for f >= 1, in integers (the bits of the fraction
// by repeated squaring).
WSYNC_HD constexpr uint32_t Log2Fixed(uint32_t f) {
  int w = 31;
  while (((f >> w) & 1) == 0) --w;
  uint64_t y = uint64_t{f} << (30 - w);  // f / 2^w in [1, 2), 30 fraction bits
  uint32_t frac = 0;
  for (int b = kCostFraction - 1; b >= 0; --b) {
    y = (y * y) >> 30;
    if (y >= (uint64_t{2} << 30)) {
      y >>= 1;
      frac |= 1u << b;
    }
  }
  return (static_cast<uint32_t>(w) << kCostFraction) | frac;
}

// Log2Fixed of 0 .. 2^10 (entry 0 unused): the table every cost is computed
// from. The device codec copies it to device memory.
using Log2Table = std::array<uint32_t, kScale + 1>;
inline constexpr Log2Table kLog2Table = [] {
  Log2Table t{};
  for (uint32_t f = 1; f <= kScale; ++f) t[f] = Log2Fixed(f);
  return t;
}();

// ---------------------------------------------------------------- tables

// A frequency table chosen for symbol counts: precision p (frequencies sum
// to 2^p, every present symbol at least 1, the most frequent taking the
// rounding) and its estimated cost, header included. The p chosen is the
// cheapest; p < 0 when no symbol occurs.
struct TableChoice {
  int p = -1;
  uint32_t freq[kSymbols] = {};
  uint64_t cost = 0;  // 2^-16 bits
};

// Frequencies of counts at precision p from q10[s] = floor(c_s 2^10 /
// total) (floor(c_s 2^p / total) = q10[s] >> (10 - p): nested floor
// division); false when p cannot hold them.
WSYNC_HD inline bool NormalizeCounts(const uint32_t* counts, const uint64_t* q10, int present, int largest, int p,
                                     uint32_t* freq) {
  const uint64_t scale = uint64_t{1} << p;
  if (present == 0 || scale < static_cast<uint64_t>(present)) return false;
  int64_t sum = 0;
  for (int s = 0; s < kSymbols; ++s) {
    const uint64_t q = q10[s] >> (kPrecision - p);
    freq[s] = counts[s] == 0 ? 0u : static_cast<uint32_t>(q > 1 ? q : 1);
    sum += freq[s];
  }
  const int64_t fixed = static_cast<int64_t>(freq[largest]) + static_cast<int64_t>(scale) - sum;
  if (fixed < 1) return false;
  freq[largest] = static_cast<uint32_t>(fixed);
  return true;
}

// The header's bits (docs/patch-format.md "Table"): precision, mask, and
// every present frequency but the last as Elias gamma of freq - 1.
WSYNC_HD inline uint64_t TableHeaderBits(const uint32_t* freq) {
  uint64_t bits = 4 + kSymbols;
  int last = -1;
  for (int s = 0; s < kSymbols; ++s) last = freq[s] > 0 ? s : last;
  for (int s = 0; s < last; ++s) {
    if (freq[s] > 0) bits += static_cast<uint64_t>(GammaBits(freq[s] - 1));
  }
  return bits;
}

// lg: kLog2Table's entries (in whatever memory the caller reads fastest).
WSYNC_HD inline TableChoice ChooseTable(const uint32_t* counts, const uint32_t* lg) {
  TableChoice best;
  uint64_t total = 0;
  int present = 0, largest = -1;
  for (int s = 0; s < kSymbols; ++s) {
    total += counts[s];
    present += counts[s] > 0 ? 1 : 0;
    if (counts[s] > 0 && (largest < 0 || counts[s] > counts[largest])) largest = s;
  }
  if (total == 0) return best;
  uint64_t q10[kSymbols];
  for (int s = 0; s < kSymbols; ++s) q10[s] = (uint64_t{counts[s]} << kPrecision) / total;
  for (int p = 0; p <= kPrecision; ++p) {
    uint32_t freq[kSymbols];
    if (!NormalizeCounts(counts, q10, present, largest, p, freq)) continue;
    uint64_t cost = TableHeaderBits(freq) << kCostFraction;
    const uint64_t whole = static_cast<uint64_t>(p) << kCostFraction;
    for (int s = 0; s < kSymbols; ++s) {
      if (counts[s] > 0) cost += uint64_t{counts[s]} * (whole - lg[freq[s]]);
    }
    if (best.p < 0 || cost < best.cost) {
      best.p = p;
      best.cost = cost;
      for (int s = 0; s < kSymbols; ++s) best.freq[s] = freq[s];
    }
  }
  return best;
}

// Writes the table's header. REQUIRES: t.p >= 0.
WSYNC_HD inline void PutTable(const TableChoice& t, BitOut& out) {
  out.Put(static_cast<uint64_t>(t.p), 4);
  uint32_t mask = 0;
  int last = -1;
  for (int s = 0; s < kSymbols; ++s) {
    if (t.freq[s] > 0) {
      mask |= 1u << s;
      last = s;
    }
  }
  out.Put(mask, kSymbols);
  for (int s = 0; s < last; ++s) {
    if (t.freq[s] > 0) out.PutGamma(t.freq[s] - 1);
  }
}

// ------------------------------------------------------------------ rANS

// What a rANS step needs of a symbol: x' = x + bias + q * cmpl with
// q = floor(x / freq) = (x * rcp) >> 63, exact for every 32-bit state
// (rcp = ceil(2^63 / freq), and rcp * freq - 2^63 < freq <= 2^31).
struct EncSymbol {
  uint64_t rcp = 0;
  uint32_t freq = 0;
  uint32_t bias = 0;  // start
  uint32_t cmpl = 0;  // 2^10 - freq
};

// The table scaled to 2^10: each present symbol's EncSymbol (enc), and
// the frequencies and starts (freq, start: null to skip).
WSYNC_HD inline void ScaleTable(const TableChoice& t, EncSymbol* enc, uint16_t* freq, uint16_t* start) {
  uint32_t at = 0;
  for (int s = 0; s < kSymbols; ++s) {
    const uint32_t f = t.freq[s] << (kPrecision - t.p);
    if (freq != nullptr) freq[s] = static_cast<uint16_t>(f);
    if (start != nullptr) start[s] = static_cast<uint16_t>(at);
    enc[s] = EncSymbol{};
    if (f > 0) enc[s] = EncSymbol{((uint64_t{1} << 63) + f - 1) / f, f, at, kScale - f};
    at += f;
  }
}

// Renormalizes state x before coding a symbol of frequency freq (of 2^10)
// so that the coded state stays below 2^32 (a symbol of probability 1
// never needs it: its bound is 2^32): the low word is stored at *out either
// way and kept (out advanced) when x had to shrink, so *out must have room
// for one word even when it is not kept. Without a branch: the state
// shrinks about one symbol in several, at random, and a select on it
// compiled to a jump; the shift by 0 or 16 does not.
WSYNC_HD __attribute__((always_inline)) inline void RansRenormalize(uint32_t& x, uint32_t freq, uint16_t*& out) {
  const uint64_t x_max = uint64_t{(kLow >> kPrecision) << 16} * freq;
  const uint32_t shrink = x >= x_max ? 1u : 0u;
  *out = static_cast<uint16_t>(x & 0xFFFF);
  out += shrink;
  x >>= 16 * shrink;
}

// One step: codes symbol s into state x (x' = floor(x / freq) 2^10 +
// x mod freq + start), the quotient by the reciprocal.
WSYNC_HD __attribute__((always_inline)) inline void RansPut(uint32_t& x, const EncSymbol& s, uint16_t*& out) {
  RansRenormalize(x, s.freq, out);
#if defined(__CUDA_ARCH__)
  const uint64_t hi = __umul64hi(uint64_t{x}, s.rcp), lo = uint64_t{x} * s.rcp;
  const uint32_t q = static_cast<uint32_t>((hi << 1) | (lo >> 63));
#else
  const uint32_t q = static_cast<uint32_t>((static_cast<unsigned __int128>(x) * s.rcp) >> 63);
#endif
  x += s.bias + q * s.cmpl;
}

// The same step from the scaled frequency and start alone, the quotient by
// a division (a table of 64 bytes per class where EncSymbols take 384).
WSYNC_HD __attribute__((always_inline)) inline void RansPut(uint32_t& x, uint32_t freq, uint32_t start,
                                                            uint16_t*& out) {
  RansRenormalize(x, freq, out);
  x += start + (x / freq) * (kScale - freq);
}

// The front of a rANS stream: the word count (the words and the two final
// states) as a varint, the states (x0 then x1, high half first), then the
// words in decoding order, the reverse of their emission; little-endian.
WSYNC_HD inline void PutRansWords(uint32_t x0, uint32_t x1, const uint16_t* words, uint64_t count, ByteOut& out) {
  out.Varint(count + 4);
  auto word = [&out](uint32_t v) {
    out.U8(static_cast<uint8_t>(v & 0xFF));
    out.U8(static_cast<uint8_t>((v >> 8) & 0xFF));
  };
  word(x0 >> 16);
  word(x0 & 0xFFFF);
  word(x1 >> 16);
  word(x1 & 0xFFFF);
  for (uint64_t i = count; i-- > 0;) word(words[i]);
}

// ------------------------------------------------------------------ gaps

// Gaps between the ranks of a class's changes: with the class's shift r,
// the quotient q = gap >> r is one rANS symbol (table per class), the rest
// plain bits:
//   q 0..7: symbol q
//   q 8..127: symbols 8..14 by bit length and next bit (buckets [8,12),
//     [12,16), [16,24), [24,32), [32,48), [48,64), [64,128)), then q's
//     offset in its bucket (2, 2, 3, 3, 4, 4, 6 bits)
//   q >= 128: symbol 15, Elias gamma of q - 128
// followed by the r low bits of the gap. r is chosen per class, so a class
// changing with probability p costs close to H(p) per element, a dense one
// well under a bit per change.
WSYNC_HD constexpr int GapSymbol(uint64_t q) {
  if (q < 8) return static_cast<int>(q);
  if (q >= GapBase(kGapEscape)) return kGapEscape;
  int w = 4;  // bit length of q: 4..7
  while ((q >> w) != 0) ++w;
  return w == 7 ? 14 : 8 + 2 * (w - 4) + static_cast<int>((q >> (w - 2)) & 1);
}

// Writes gap g's bits at shift r (its symbol s = GapSymbol(g >> r)).
WSYNC_HD __attribute__((always_inline)) inline void PutGapBits(uint64_t g, int r, int s, BitOut& out) {
  const uint64_t q = g >> r;
  const uint64_t low = g & ((uint64_t{1} << r) - 1);
  if (s == kGapEscape) {
    out.PutGamma(q - GapBase(kGapEscape));
    out.Put(low, r);
  } else {
    out.Put(((q - GapBase(s)) << r) | low, GapExtra(s) + r);
  }
}

// A histogram of gaps by bit length and leading three bits: it tells a
// gap's symbol at every shift (the quotient's bits are the gap's leading
// ones), so one pass serves every candidate shift.
inline constexpr int kGapBins = 33 * 8;
// bin = bit_width(g) * 8 + g's three leading bits (g itself below 8).
WSYNC_HD __attribute__((always_inline)) inline int GapBin(uint32_t g) {
  // The width from an operand that is never zero: zero gaps are common and
  // unpredictable in a class that changes often.
  const int w = BitWidth64((uint64_t{g} << 1) | 1) - 1;
  return w * 8 + static_cast<int>(g >> (w > 3 ? w - 3 : 0));
}

// The symbol (below the escape) of the gaps in histogram bin b at shift r,
// or kGapEscape for quotients of 128 and more.
WSYNC_HD inline int BinSymbol(int b, int r) {
  const int w = b / 8, lead = b % 8;
  const int qw = w - r;  // the quotient's bit length
  if (qw <= 0) return 0;
  if (qw >= 8) return kGapEscape;
  // Below 8 the quotient is its leading bits; above, its symbol depends on
  // its length and the bit after the leading one only.
  const int q = w <= 3 ? lead >> r : qw <= 3 ? lead >> (3 - qw) : lead << (qw - 3);
  return GapSymbol(static_cast<uint64_t>(q));
}

// A class's shift and the symbol counts of its gaps at that shift.
struct ShiftChoice {
  int shift = 0;
  uint32_t counts[kSymbols] = {};
};

// The shift for a class's `count` gaps (gap(i), summing to sum, binned in
// hist): the one that puts the mean quotient near 4, or a neighbour, the
// cheapest of the three by the bits of the symbols' tables and of the
// plain bits.
template <typename GapOf>
WSYNC_HD inline ShiftChoice ChooseShift(const uint32_t* hist, uint64_t count, uint64_t sum, GapOf&& gap,
                                        const uint32_t* lg) {
  const uint64_t mean = sum / count;
  int r0 = BitWidth64(mean / 4) - 2;
  r0 = r0 < 0 ? 0 : r0 > kMaxShift - 2 ? kMaxShift - 2 : r0;
  uint32_t counts[3][kSymbols] = {};
  for (int b = 0; b < kGapBins; ++b) {
    if (hist[b] == 0) continue;
    for (int t = 0; t < 3; ++t) counts[t][BinSymbol(b, r0 + t)] += hist[b];
  }
  // Escapes (rare: 32 times the mean gap and more) cost their gamma codes.
  uint64_t escape_bits[3] = {};
  if (counts[0][kGapEscape] != 0) {
    const uint64_t escape_at = uint64_t{GapBase(kGapEscape)} << r0;
    for (uint64_t i = 0; i < count; ++i) {
      const uint64_t g = gap(i);
      if (g < escape_at) continue;
      for (int t = 0; t < 3; ++t) {
        const uint64_t q = g >> (r0 + t);
        if (q >= GapBase(kGapEscape)) escape_bits[t] += static_cast<uint64_t>(GammaBits(q - GapBase(kGapEscape)));
      }
    }
  }
  int best = 0;
  uint64_t best_cost = 0;
  for (int t = 0; t < 3; ++t) {
    uint64_t extra = escape_bits[t] + count * static_cast<uint64_t>(r0 + t);
    for (int s = 0; s < kSymbols; ++s) extra += uint64_t{counts[t][s]} * static_cast<uint64_t>(GapExtra(s));
    const uint64_t cost = (extra << kCostFraction) + ChooseTable(counts[t], lg).cost;
    if (t == 0 || cost < best_cost) {
      best = t;
      best_cost = cost;
    }
  }
  ShiftChoice out;
  out.shift = r0 + best;
  for (int s = 0; s < kSymbols; ++s) out.counts[s] = counts[best][s];
  return out;
}

// ---------------------------------------------------------------- values

// A delta d != 0, read as a signed w-bit number, is one rANS symbol (its
// sign and magnitude bucket, tables per class) plus the magnitude's offset
// in its bucket as plain bits:
//   |d| 1..5: symbol 2(|d|-1) + negative
//   |d| 6..9: symbol 10 + negative, 2 bits of |d| - 6
//   |d| 10..17: symbol 12 + negative, 3 bits of |d| - 10
//   |d| >= 18: symbol 14, the sign bit, Elias gamma of |d| - 18
// Symbol 15 does not occur. At RL learning rates almost every change is one
// unit in the last place.
inline constexpr int kValueFirstWithBits = 10;  // symbols below have no bits

template <typename T>
WSYNC_HD __attribute__((always_inline)) inline int ValueSymbol(T delta) {
  constexpr int kBits = static_cast<int>(sizeof(T) * 8);
  const int neg = static_cast<int>((delta >> (kBits - 1)) & 1);
  const uint64_t mag = static_cast<uint64_t>(neg ? static_cast<T>(T{0} - delta) : delta);
  if (mag >= ValueBase(kValueEscape)) return kValueEscape;
  return mag < ValueBase(kValueFirstWithBits)      ? static_cast<int>(2 * (mag - 1)) + neg
         : mag < ValueBase(kValueFirstWithBits + 2) ? kValueFirstWithBits + neg
                                                    : kValueFirstWithBits + 2 + neg;
}

// Writes the bits of a delta of symbol s (none below kValueFirstWithBits).
template <typename T>
WSYNC_HD inline void PutValueBits(T delta, int s, BitOut& out) {
  constexpr int kBits = static_cast<int>(sizeof(T) * 8);
  const uint64_t neg = static_cast<uint64_t>((delta >> (kBits - 1)) & 1);
  const uint64_t mag = static_cast<uint64_t>(neg ? static_cast<T>(T{0} - delta) : delta);
  if (s == kValueEscape) {
    out.Put(neg, 1);
    out.PutGamma(mag - ValueBase(kValueEscape));
  } else {
    out.Put(mag - ValueBase(s), ValueExtra(s));
  }
}

// --------------------------------------------------------------- a chunk

// The class header at the front of a position stream (docs/patch-format.md
// "Classes"): the class count, then each threshold as a varint.
WSYNC_HD inline void PutClassHeader(const ClassSpec& spec, ByteOut& out) {
  out.U8(static_cast<uint8_t>(spec.k));
  for (int t = 0; t < spec.k - 1; ++t) out.Varint(spec.thr[t]);
}

// Whether the host's chunk coder weighs sparse mode for a change of m of n
// elements (m * 2 <= n), and whether it weighs no other mode (sparse only:
// also position runs * 4 > m and m * 32 <= n, no runs, bitmap or planes).
WSYNC_HD inline bool SparseTried(uint64_t n, uint64_t m) { return m > 0 && m * 2 <= n; }
WSYNC_HD inline bool SparseOnly(uint64_t n, uint64_t m, uint64_t runs) {
  return SparseTried(n, m) && m * 32 <= n && runs * 4 > m;
}

// Maximal runs of consecutive positions.
WSYNC_HD inline uint64_t PositionRuns(const uint32_t* pos, uint64_t m) {
  uint64_t runs = 0;
  for (uint64_t i = 0; i < m; ++i) runs += (i == 0 || pos[i] != pos[i - 1] + 1) ? 1 : 0;
  return runs;
}

// A chunk's change to encode: m changes of a chunk of n elements at
// ascending positions, their deltas, and when the chunk has classes
// (spec.k > 1) the base's values there and each change's rank within its
// class (elements of its class before it in the chunk).
template <typename T>
struct SparseChunkIn {
  uint64_t n = 0, m = 0;
  const uint32_t* pos = nullptr;
  const T* delta = nullptr;
  const T* old = nullptr;
  const uint32_t* rank = nullptr;
  ClassSpec spec;
};

enum SparseEncodeCode : uint32_t {
  kSparseEncoded = 0,
  kSparseNotTried = 1,  // the host's coder would not weigh sparse mode (SparseTried)
  kOutputFull = 2,      // the streams do not fit the room given
};

struct SparseEncodeResult {
  uint32_t code = kSparseEncoded;
  uint32_t sparse_only = 0;  // SparseOnly: the streams are the chunk's; else other modes are to be weighed
  uint64_t pos_bytes = 0, val_bytes = 0;
};

// A table as the chunk encoder keeps it: its precision and its frequencies
// and starts scaled to 2^10.
struct PickedTable {
  int32_t p = -1;
  uint16_t freq[kSymbols] = {};
  uint16_t start[kSymbols] = {};
  WSYNC_HD void Set(const TableChoice& t) {
    EncSymbol ignored[kSymbols];
    p = t.p;
    ScaleTable(t, ignored, freq, start);
  }
  // The header PutTable writes for it.
  WSYNC_HD void Put(BitOut& out) const {
    TableChoice t;
    t.p = p;
    for (int s = 0; s < kSymbols; ++s) t.freq[s] = uint32_t{freq[s]} >> (kPrecision - p);
    PutTable(t, out);
  }
};

// What EncodeSparseChunk works in besides its stack (about 2.7 KB; the
// device keeps it in global memory, not in every thread's local memory).
struct SparseEncodeWork {
  uint32_t hist[kGapBins];
  uint32_t vcounts[kMaxClasses][kSymbols];
  PickedTable gap[kMaxClasses], val[kMaxClasses];
};

// Scratch: grouped (m entries; used when spec.k > 1), words (m + 1), work.
struct SparseEncodeScratch {
  uint32_t* grouped = nullptr;
  uint16_t* words = nullptr;
  SparseEncodeWork* work = nullptr;
};

// Encodes a chunk in mode 1 into the position stream (at most pos_cap
// bytes at pos_out) and the value stream (val_cap at val_out), the host
// chunk coder's sparse streams, whenever SparseTried: the chunk's bytes when
// SparseOnly, else the candidates the host weighs the other modes against
// (codec's ChooseMode).
template <typename T>
WSYNC_HD inline SparseEncodeResult EncodeSparseChunk(const SparseChunkIn<T>& in, const SparseEncodeScratch& scratch,
                                                     uint8_t* pos_out, uint64_t pos_cap, uint8_t* val_out,
                                                     uint64_t val_cap, const uint32_t* lg) {
  SparseEncodeResult result;
  const uint64_t m = in.m;
  if (!SparseTried(in.n, m)) {
    result.code = kSparseNotTried;
    return result;
  }
  result.sparse_only = SparseOnly(in.n, m, PositionRuns(in.pos, m)) ? 1 : 0;
  const ClassSpec& spec = in.spec;
  const int k = spec.k;
  SparseEncodeWork& work = *scratch.work;
  auto class_of = [&](uint64_t i) { return k > 1 ? spec.ClassOf(in.old[i]) : 0; };

  // The ranks class after class (positions when one class).
  uint64_t count[kMaxClasses] = {}, start[kMaxClasses + 1] = {};
  for (uint64_t i = 0; i < m; ++i) ++count[class_of(i)];
  for (int c = 0; c < kMaxClasses; ++c) start[c + 1] = start[c] + count[c];
  const uint32_t* ranks = in.pos;
  if (k > 1) {
    uint64_t fill[kMaxClasses];
    for (int c = 0; c < kMaxClasses; ++c) fill[c] = start[c];
    for (uint64_t i = 0; i < m; ++i) scratch.grouped[fill[class_of(i)]++] = in.rank[i];
    ranks = scratch.grouped;
  }
  auto gap_at = [ranks](uint64_t i, uint64_t first) -> uint64_t {
    return i == first ? ranks[i] : ranks[i] - ranks[i - 1] - 1;
  };

  // Positions: each class's shift and table.
  int shift[kMaxClasses] = {};
  for (int c = 0; c < k; ++c) {
    if (count[c] == 0) continue;
    for (int b = 0; b < kGapBins; ++b) work.hist[b] = 0;
    uint64_t sum = 0;
    for (uint64_t i = start[c]; i < start[c + 1]; ++i) {
      const uint64_t g = gap_at(i, start[c]);
      sum += g;
      ++work.hist[GapBin(static_cast<uint32_t>(g))];
    }
    const uint64_t first = start[c];
    const ShiftChoice sc =
        ChooseShift(work.hist, count[c], sum, [&](uint64_t j) { return gap_at(first + j, first); }, lg);
    shift[c] = sc.shift;
    work.gap[c].Set(ChooseTable(sc.counts, lg));
  }
  // The rANS pass, last gap first (gap i with state i % 2).
  uint32_t x0 = kLow, x1 = kLow;
  uint16_t* w = scratch.words;
  for (int c = k; c-- > 0;) {
    const PickedTable& t = work.gap[c];
    for (uint64_t i = start[c + 1]; i-- > start[c];) {
      const int s = GapSymbol(gap_at(i, start[c]) >> shift[c]);
      RansPut(i & 1 ? x1 : x0, t.freq[s], t.start[s], w);
    }
  }
  ByteOut pos{pos_out, pos_cap};
  PutClassHeader(spec, pos);
  PutRansWords(x0, x1, scratch.words, static_cast<uint64_t>(w - scratch.words), pos);
  BitOut pbits(pos_out + (pos.overflow ? 0 : pos.at), pos.overflow ? 0 : pos_cap - pos.at);
  for (int c = 0; c < k; ++c) pbits.PutGamma(count[c]);
  for (int c = 0; c < k; ++c) {
    if (count[c] == 0) continue;
    pbits.Put(static_cast<uint64_t>(shift[c]), 5);
    work.gap[c].Put(pbits);
  }
  for (int c = 0; c < k; ++c) {
    for (uint64_t i = start[c]; i < start[c + 1]; ++i) {
      const uint64_t g = gap_at(i, start[c]);
      PutGapBits(g, shift[c], GapSymbol(g >> shift[c]), pbits);
    }
  }
  result.pos_bytes = pos.at + pbits.Close();
  if (pos.overflow || pbits.overflow()) result.code = kOutputFull;

  // Values: a table per class present, the rANS pass, then the bits.
  for (int c = 0; c < kMaxClasses; ++c) {
    for (int s = 0; s < kSymbols; ++s) work.vcounts[c][s] = 0;
  }
  for (uint64_t i = 0; i < m; ++i) ++work.vcounts[class_of(i)][ValueSymbol(in.delta[i])];
  for (int c = 0; c < kMaxClasses; ++c) {
    if (count[c] > 0) work.val[c].Set(ChooseTable(work.vcounts[c], lg));
  }
  x0 = x1 = kLow;
  w = scratch.words;
  for (uint64_t i = m; i-- > 0;) {
    const PickedTable& t = work.val[class_of(i)];
    const int s = ValueSymbol(in.delta[i]);
    RansPut(i & 1 ? x1 : x0, t.freq[s], t.start[s], w);
  }
  ByteOut val{val_out, val_cap};
  PutRansWords(x0, x1, scratch.words, static_cast<uint64_t>(w - scratch.words), val);
  BitOut vbits(val_out + (val.overflow ? 0 : val.at), val.overflow ? 0 : val_cap - val.at);
  for (int c = 0; c < kMaxClasses; ++c) {
    if (count[c] > 0) work.val[c].Put(vbits);
  }
  for (uint64_t i = 0; i < m; ++i) {
    const int s = ValueSymbol(in.delta[i]);
    if (s >= kValueFirstWithBits) PutValueBits(in.delta[i], s, vbits);
  }
  result.val_bytes = val.at + vbits.Close();
  if (val.overflow || vbits.overflow()) result.code = kOutputFull;
  return result;
}

}  // namespace wsync::codec::sparse
