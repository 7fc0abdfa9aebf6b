// The decoding of a sparse chunk (mode 1, docs/patch-format.md "Sparse
// positions" and "Values") written once over plain memory, as WSYNC_HD
// agents: the device kernels run them one chunk per thread, and the host
// codec decodes its sparse chunks and value streams with them too. Nothing
// here allocates, reads outside the bytes it is given or depends on anything
// but its arguments. The one difference between the two executions is how a
// rANS slot finds its symbol (the Tables policy below).
//
// A chunk is decoded in three steps, each an agent:
//   DecodeSparseRanks: the position stream -> per-class ranks (positions
//     themselves when the chunk has one class);
//   (elsewhere: ranks -> positions and old values over the base's classes)
//   MergeClassLists: the per-class positions -> ascending positions;
//   DecodeSparseValues: the value stream -> one delta per position.
// Each returns a SparseResult; SparseErrorText words it, and the caller
// names the chunk.
#pragma once

#include <cstddef>
#include <cstdint>

#include "wsync/codec/block_logic.h"

namespace wsync::codec::sparse {

inline constexpr int kSymbols = 16;
inline constexpr int kPrecision = 10;  // tables scale to sum 2^10
inline constexpr uint32_t kScale = 1u << kPrecision;
inline constexpr uint32_t kLow = 1u << 16;  // rANS states live in [2^16, 2^32)

// Part of the patch format's gap and value symbols (shared with the host
// encoder in coder_values.cc and coder_sparse.cc): functions rather than arrays so that device
// code reads them without a table in memory.
inline constexpr int kGapEscape = 15;
inline constexpr int kMaxShift = 31;
WSYNC_HD constexpr uint32_t GapBase(int s) {  // 0..7, 8, 12, 16, 24, 32, 48, 64, 128
  if (s < 8) return static_cast<uint32_t>(s);
  if (s == kGapEscape) return 128;
  return (s & 1 ? 12u : 8u) << ((s - 8) >> 1);
}
WSYNC_HD constexpr int GapExtra(int s) {  // 0 x8, 2, 2, 3, 3, 4, 4, 6, 0
  if (s < 8 || s == kGapEscape) return 0;
  return s == 14 ? 6 : 2 + ((s - 8) >> 1);
}
inline constexpr int kValueEscape = 14;
WSYNC_HD constexpr uint32_t ValueBase(int s) {  // 1,1,2,2,3,3,4,4,5,5,6,6,10,10,18
  if (s < 12) return static_cast<uint32_t>(s >> 1) + 1;
  return s < kValueEscape ? 10u : 18u;
}
WSYNC_HD constexpr int ValueExtra(int s) {  // none below 10, then 2, 2, 3, 3
  if (s < 10 || s >= kValueEscape) return 0;
  return s < 12 ? 2 : 3;
}

enum SparseError : uint32_t {
  kSparseOk = 0,
  kBadClassCounts = 1,    // a class count exceeds the changes, or they do not sum to them
  kBadTable = 2,          // a frequency table is malformed
  kGapOverrun = 3,        // a gap reaches past the chunk
  kCorruptPositions = 4,  // words or bits left over or missing, states not back at the start
  kClassOrder = 5,        // a class's positions do not ascend, or a position repeats
  kDeltaRange = 6,        // a delta's magnitude is out of range (or symbol 15)
  kCorruptValues = 7,
};

// An agent's outcome: the error, and where (the class of a count or table,
// the change of a gap or delta, the counts' sum).
struct SparseResult {
  SparseError code = kSparseOk;
  int cls = 0;
  uint64_t at = 0;
  uint64_t sum = 0;
  WSYNC_HD bool ok() const { return code == kSparseOk; }
};

// Where one rANS stream's parts lie: its 16-bit words and its bit stream
// (docs/patch-format.md "rANS streams"; the word count already parsed).
struct RansSpan {
  const uint8_t* words = nullptr;
  uint64_t word_count = 0;  // >= 4
  const uint8_t* bits = nullptr;
  uint64_t bit_bytes = 0;
};

// A sparse chunk's classes and streams (the position stream after its
// class header).
struct ChunkStreams {
  ClassSpec spec;
  RansSpan pos, val;
};

// Bits least significant first; zeros past the end, which the caller
// detects by what was consumed.
class BitIn {
 public:
  WSYNC_HD BitIn(const uint8_t* p, uint64_t size) : p_(p), size_(size) {}
  // n <= 56.
  WSYNC_HD uint64_t Get(int n) {
    if (n == 0) return 0;
    if (have_ < n) Refill();
    const uint64_t v = buf_ & ((uint64_t{1} << n) - 1);
    buf_ >>= n;
    have_ -= n;
    consumed_ += static_cast<uint64_t>(n);
    return v;
  }
  // n <= 64.
  WSYNC_HD uint64_t GetWide(int n) {
    if (n <= 32) return Get(n);
    const uint64_t low = Get(32);
    return low | (Get(n - 32) << 32);
  }
  // Elias gamma of v + 1 (k zeros, a one, k low bits); false when v would
  // exceed max or the code is longer than 64 bits.
  WSYNC_HD bool GetGamma(uint64_t max, uint64_t* v) {
    int k = 0;
    for (;;) {
      if (have_ < 32) Refill();
      const uint32_t peek = static_cast<uint32_t>(buf_);
      if (peek != 0) {
        const int z = CountrZero32(peek);
        k += z;
        Get(z + 1);
        break;
      }
      k += 32;
      Get(32);
      if (k > 63 || overrun()) return false;
    }
    if (k > 63) return false;
    const uint64_t u = (uint64_t{1} << k) | GetWide(k);
    if (u - 1 > max) return false;
    *v = u - 1;
    return true;
  }
  WSYNC_HD bool overrun() const { return consumed_ > size_ * 8; }
  // Every bit read and nothing but the last byte's padding left.
  WSYNC_HD bool ExactlyConsumed() const { return !overrun() && (consumed_ + 7) / 8 == size_; }

 private:
  WSYNC_HD void Refill() {
#if !defined(__CUDA_ARCH__)
    // The host loads the bytes that fit at once.
    if (next_ + 8 <= size_) {
      uint64_t v;
      __builtin_memcpy(&v, p_ + next_, 8);
      const int take = (64 - have_) >> 3;
      buf_ |= (take == 8 ? v : v & ((uint64_t{1} << (8 * take)) - 1)) << have_;
      have_ += 8 * take;
      next_ += static_cast<uint64_t>(take);
      return;
    }
#endif
    while (have_ <= 56) {
      const uint64_t b = next_ < size_ ? p_[next_] : 0;
      buf_ |= b << have_;
      have_ += 8;
      ++next_;
    }
  }
  const uint8_t* p_;
  uint64_t size_;
  uint64_t next_ = 0;  // next byte to load
  uint64_t buf_ = 0;   // loaded, unread bits
  int have_ = 0;
  uint64_t consumed_ = 0;
};

// A frequency table scaled to 2^10: freq[s] (0: absent) and start[s].
struct Table {
  uint16_t freq[kSymbols];
  uint16_t start[kSymbols];
};

// Reads a table header (docs/patch-format.md "Table"); false if malformed.
WSYNC_HD inline bool ReadTable(BitIn& r, Table* t) {
  const int p = static_cast<int>(r.Get(4));
  const uint32_t mask = static_cast<uint32_t>(r.Get(kSymbols));
  if (p > kPrecision || mask == 0) return false;
  const uint32_t scale = 1u << p;
  const int present = Popcount32(mask);
  if (scale < static_cast<uint32_t>(present)) return false;
  int last = 31;
  while (!((mask >> last) & 1)) --last;
  uint32_t freq[kSymbols] = {};
  uint32_t sum = 0;
  int after = present - 1;  // present symbols after s
  for (int s = 0; s < last; ++s) {
    if (!((mask >> s) & 1)) continue;
    uint64_t v;
    if (!r.GetGamma(scale - sum - static_cast<uint32_t>(after) - 1, &v)) return false;
    freq[s] = static_cast<uint32_t>(v) + 1;
    sum += freq[s];
    --after;
  }
  freq[last] = scale - sum;
  uint32_t start = 0;
  for (int s = 0; s < kSymbols; ++s) {
    t->freq[s] = static_cast<uint16_t>(freq[s] << (kPrecision - p));
    t->start[s] = static_cast<uint16_t>(start);
    start += t->freq[s];
  }
  return true;
}

// How a decoder finds a rANS slot's symbol, per class: an entry of the
// symbol (bits 0-3), its frequency (4-14) and the slot's offset from the
// symbol's start (15-24). SearchTables searches the 16 symbols (64 bytes
// per class: the device's, a thread's tables stay in registers and L1);
// SlotTables looks the slot up (4 KiB per class: the host's).
struct SearchTables {
  Table t[kMaxClasses];
  WSYNC_HD void Set(int c, const Table& table) { t[c] = table; }
  WSYNC_HD uint32_t Entry(int c, uint32_t slot) const {
    const Table& tc = t[c];
    int s = 0;
    for (int j = 1; j < kSymbols; ++j) s = (tc.freq[j] != 0 && slot >= tc.start[j]) ? j : s;
    return static_cast<uint32_t>(s) | (uint32_t{tc.freq[s]} << 4) | ((slot - tc.start[s]) << 15);
  }
};
struct SlotTables {
  uint32_t entry[kMaxClasses][kScale];
  WSYNC_HD void Set(int c, const Table& t) {
    for (int s = 0; s < kSymbols; ++s) {
      for (uint32_t j = 0; j < t.freq[s]; ++j) {
        entry[c][t.start[s] + j] = static_cast<uint32_t>(s) | (uint32_t{t.freq[s]} << 4) | (j << 15);
      }
    }
  }
  WSYNC_HD uint32_t Entry(int c, uint32_t slot) const { return entry[c][slot]; }
};

// Two interleaved static rANS states: symbol i of the stream uses state
// i % 2, and a state that falls below 2^16 reads the next word.
class RansIn {
 public:
  WSYNC_HD explicit RansIn(const RansSpan& s) : w_(s.words), count_(s.word_count) {
    x0_ = (Word(0) << 16) | Word(1);
    x1_ = (Word(2) << 16) | Word(3);
  }
  // Decodes symbol i of the stream with class c's table. The states are two
  // members, not an array indexed by i % 2, so that they stay in registers.
  template <typename Tables>
  WSYNC_HD int Next(uint64_t i, const Tables& tables, int c) {
    const bool odd = (i & 1) != 0;
    uint32_t x = odd ? x1_ : x0_;
    const uint32_t e = tables.Entry(c, x & (kScale - 1));
    x = ((e >> 4) & 0x7FF) * (x >> kPrecision) + (e >> 15);
    if (x < kLow) x = (x << 16) | Word(next_++);
    if (odd) {
      x1_ = x;
    } else {
      x0_ = x;
    }
    return static_cast<int>(e & 0xF);
  }
  // Every word read and both states back at the encoder's start.
  WSYNC_HD bool Finished() const { return next_ == count_ && x0_ == kLow && x1_ == kLow; }

 private:
  WSYNC_HD uint32_t Word(uint64_t i) const {
    return i < count_ ? uint32_t{w_[2 * i]} | (uint32_t{w_[2 * i + 1]} << 8) : 0u;
  }
  const uint8_t* w_;
  uint64_t count_;
  uint64_t next_ = 4;
  uint32_t x0_, x1_;
};

// The ranks of a sparse chunk of n elements with `changed` changes and k
// classes: counts[c] (k entries), then ranks[] (changed entries) class after
// class, each class's ranks ascending. With k == 1 the ranks are the
// positions. `pos` is the position stream after its class header.
template <typename Tables = SearchTables>
WSYNC_HD inline SparseResult DecodeSparseRanks(const RansSpan& pos, uint64_t n, uint64_t changed, int k,
                                               uint64_t* counts, uint32_t* ranks, Tables* tables) {
  BitIn bits(pos.bits, pos.bit_bytes);
  uint64_t sum = 0;
  for (int c = 0; c < k; ++c) {
    if (!bits.GetGamma(changed - sum, &counts[c])) return {kBadClassCounts, c, 0, sum};
    sum += counts[c];
  }
  if (sum != changed) return {kBadClassCounts, k, 0, sum};
  int shift[kMaxClasses] = {};
  for (int c = 0; c < k; ++c) {
    if (counts[c] == 0) continue;
    shift[c] = static_cast<int>(bits.Get(5));
    Table t;
    if (!ReadTable(bits, &t)) return {kBadTable, c, 0, 0};
    tables->Set(c, t);
  }
  RansIn rans(pos);
  uint64_t i = 0;
  for (int c = 0; c < k; ++c) {
    const int r = shift[c];
    const uint64_t low_mask = (uint64_t{1} << r) - 1;
    uint64_t next = 0;
    for (uint64_t j = 0; j < counts[c]; ++j, ++i) {
      const int s = rans.Next(i, *tables, c);
      uint64_t q, low;
      if (s != kGapEscape) {
        const uint64_t v = bits.Get(GapExtra(s) + r);
        q = GapBase(s) + (v >> r);
        low = v & low_mask;
      } else {
        if (!bits.GetGamma(n, &q)) return {kGapOverrun, c, j, 0};
        q += GapBase(kGapEscape);
        low = bits.Get(r);
      }
      const uint64_t gap = (q << r) | low;
      if (q > n || next >= n || gap > n - 1 - next) return {kGapOverrun, c, j, 0};
      ranks[i] = static_cast<uint32_t>(next + gap);
      next += gap + 1;
    }
  }
  if (!rans.Finished() || !bits.ExactlyConsumed()) return {kCorruptPositions, 0, 0, 0};
  return {};
}

// Merges the k per-class position lists (class after class, `counts`, each
// ascending, with their old values) into ascending positions and old values.
template <typename T>
WSYNC_HD inline SparseResult MergeClassLists(const uint32_t* pos_by_class, const T* old_by_class,
                                             const uint64_t* counts, int k, uint32_t* pos, T* old) {
  uint64_t at[kMaxClasses], end[kMaxClasses];
  uint64_t m = 0;
  for (int c = 0; c < k; ++c) {
    at[c] = m;
    m += counts[c];
    end[c] = m;
  }
  for (uint64_t j = 0; j < m; ++j) {
    int best = -1;
    for (int c = 0; c < k; ++c) {
      if (at[c] < end[c] && (best < 0 || pos_by_class[at[c]] < pos_by_class[at[best]])) best = c;
    }
    const uint64_t from = at[best]++;
    if (at[best] < end[best] && pos_by_class[at[best]] <= pos_by_class[from]) return {kClassOrder, best, j, 0};
    pos[j] = pos_by_class[from];
    if (j > 0 && pos[j] == pos[j - 1]) return {kClassOrder, best, j, 0};
    old[j] = old_by_class[from];
  }
  return {};
}

// The m deltas of a chunk whose changes are of classes cls(i) (0 when
// the chunk has one class).
template <typename T, typename Tables = SearchTables, typename ClassOf>
WSYNC_HD inline SparseResult DecodeSparseValuesOf(const RansSpan& val, uint64_t m, ClassOf&& cls, T* delta,
                                                  Tables* tables) {
  constexpr int kBits = static_cast<int>(sizeof(T) * 8);
  uint64_t counts[kMaxClasses] = {};
  for (uint64_t i = 0; i < m; ++i) ++counts[cls(i)];
  BitIn bits(val.bits, val.bit_bytes);
  for (int c = 0; c < kMaxClasses; ++c) {
    if (counts[c] == 0) continue;
    Table t;
    if (!ReadTable(bits, &t)) return {kBadTable, c, 0, 0};
    tables->Set(c, t);
  }
  const uint64_t max_escape = (uint64_t{1} << (kBits - 1)) - ValueBase(kValueEscape);
  RansIn rans(val);
  for (uint64_t i = 0; i < m; ++i) {
    const int s = rans.Next(i, *tables, cls(i));
    uint64_t mag;
    uint64_t neg;
    if (s < kValueEscape) {
      neg = static_cast<uint64_t>(s & 1);
      mag = ValueBase(s) + bits.Get(ValueExtra(s));
    } else {
      neg = bits.Get(1);
      uint64_t extra;
      if (s != kValueEscape || !bits.GetGamma(max_escape, &extra)) return {kDeltaRange, 0, i, 0};
      mag = ValueBase(kValueEscape) + extra;
    }
    const T t = static_cast<T>(mag);
    delta[i] = neg ? static_cast<T>(T{0} - t) : t;
  }
  if (!rans.Finished() || !bits.ExactlyConsumed()) return {kCorruptValues, 0, 0, 0};
  return {};
}

// The same with the classes of the changes' old values under spec (null
// when spec.k == 1).
template <typename T, typename Tables = SearchTables>
WSYNC_HD inline SparseResult DecodeSparseValues(const RansSpan& val, uint64_t m, const ClassSpec& spec, const T* old,
                                                T* delta, Tables* tables) {
  if (spec.k > 1 && old != nullptr) {
    return DecodeSparseValuesOf<T>(val, m, [&](uint64_t i) { return spec.ClassOf(old[i]); }, delta, tables);
  }
  return DecodeSparseValuesOf<T>(val, m, [](uint64_t) { return 0; }, delta, tables);
}

// What an error says, for messages ("position stream: ...").
inline const char* SparseErrorText(SparseError e) {
  switch (e) {
    case kSparseOk: return "ok";
    case kBadClassCounts: return "position stream: class counts do not match the changed elements";
    case kBadTable: return "bad frequency table";
    case kGapOverrun: return "position stream: a gap overruns the chunk";
    case kCorruptPositions: return "position stream: truncated or corrupt";
    case kClassOrder: return "position stream: positions out of order";
    case kDeltaRange: return "value stream: a delta out of range";
    case kCorruptValues: return "value stream: truncated or corrupt";
  }
  return "unknown error";
}

}  // namespace wsync::codec::sparse
