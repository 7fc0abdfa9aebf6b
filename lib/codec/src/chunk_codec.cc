#include "chunk_codec.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <memory>

#include "wsync/util/bytes.h"
#include "range_coder.h"
#include "rans.h"
#include "sweep.h"
#include "zstd_util.h"

namespace wsync::codec::internal {
namespace {

constexpr double kClassPenaltyBits = 48;  // learning cost of one more class
constexpr size_t kMaxDpGroups = 64;

template <typename T>
constexpr int kBits = static_cast<int>(sizeof(T) * 8);

// A stream ready for its rANS pass: the tables its symbols code with and
// the bits that follow the rANS words (the symbols are the caller's).
struct PendingStream {
  RansTable tables[kMaxClasses];
  BitWriter bits;
  RansEncoder rans;
  // The stream: its rANS words (the symbols encoded into `rans`), then bits.
  void AppendTo(std::string* out) {
    rans.Finish(out);
    bits.AppendTo(out);
  }
};

// What the host encoder codes a chunk's change with, one per thread: its
// buffers keep their capacity from one chunk to the next, so that a chunk's
// coding neither allocates nor faults in fresh pages once its thread has
// coded one as large (a page fault costs more than coding its page's
// changes). Held until the thread exits: about 1 MB per worker at RL change
// rates (1-2%), up to about 25 MB after a fully changed 1 MiB chunk (the
// bit writers size for the longest codes).
struct CoderScratch {
  std::vector<uint8_t> value_sym;                // change i's symbol, in position order
  std::vector<uint32_t> gaps;                    // class after class
  std::vector<const RansEncSymbol*> gap_coded;   // gap i's table entry
  PendingStream values, positions;
};

CoderScratch& ThreadCoderScratch() {
  static thread_local CoderScratch scratch;
  return scratch;
}

// ---------------------------------------------------------------- classes

double BinaryEntropyBits(double n, double m) {
  if (m <= 0 || m >= n) return 0;
  double p = m / n;
  return -n * (p * std::log2(p) + (1 - p) * std::log2(1 - p));
}

// Magnitude buckets of the value-cost estimate: the bit length of |delta|.
constexpr int kMagBuckets = 32;

template <typename T>
int MagnitudeBucket(T delta) {
  const T mag = (delta >> (kBits<T> - 1)) & 1 ? static_cast<T>(T{0} - delta) : delta;
  return std::min<int>(std::bit_width(static_cast<uint64_t>(mag)), kMagBuckets - 1);
}

// Bits of coding `counts` (summing to `total`) at their own frequencies;
// buckets from `used` on are empty.
double MixEntropyBits(const double* counts, double total, int used) {
  if (total <= 0) return 0;
  double bits = 0;
  for (int k = 0; k < used; ++k) {
    if (counts[k] > 0) bits -= counts[k] * std::log2(counts[k] / total);
  }
  return bits;
}

// Chooses exponent thresholds minimizing the estimated cost of a class
// split over contiguous exponent ranges: per class, its positions
// N_c * H(M_c / N_c) plus its deltas' magnitudes at the class's own mix
// (the value coder's contexts are per class, and how far a weight moves
// depends on its magnitude), plus a penalty per class; from the base's
// sampled histogram and the old values and deltas of the changes.
template <typename T>
ClassSpec ChooseClassesImpl(size_t n, const uint32_t* sample, const SparseDelta<T>& d, const T* old,
                            const ChunkCodecOptions& options) {
  ClassSpec spec;
  spec.shift = options.exponent.shift;
  spec.mask = options.exponent.mask;
  if (!options.condition || old == nullptr || sample == nullptr || spec.mask == 0 || d.pos.empty()) return spec;

  // The evidence: the histogram's sampled blocks, and in a large chunk the
  // changes in those blocks (both scaled to the chunk; the host encoder then
  // knows the classes before its single sweep), in a small one every change.
  const size_t nexp = size_t{spec.mask} + 1;
  std::vector<uint32_t> changed(nexp, 0);
  std::vector<uint32_t> magnitudes(nexp * kMagBuckets, 0);  // [exponent][bucket]
  const size_t sampled = SampledElements(n);
  const size_t full_blocks = n / kBlock;
  const bool sampled_changes = ClassesFromSampledChanges(n);
  size_t evidence = 0;
  for (size_t i = 0; i < d.pos.size(); ++i) {
    const size_t block = d.pos[i] / kBlock;
    if (sampled_changes && (block % kSampleStride != 0 || block >= full_blocks)) continue;
    const int e = spec.Exponent(old[i]);
    ++changed[e];
    if (!d.delta.empty()) ++magnitudes[e * kMagBuckets + MagnitudeBucket(d.delta[i])];
    ++evidence;
  }
  if (evidence == 0) return spec;
  const double scale = sampled > 0 ? static_cast<double>(n) / sampled : 0.0;
  std::vector<double> all(sample, sample + nexp), chg(nexp);
  const double change_scale = sampled_changes ? scale : 1.0;
  for (size_t e = 0; e < nexp; ++e) chg[e] = changed[e] * change_scale;

  // Groups of consecutive present exponents, at most kMaxDpGroups.
  struct Group {
    int first_exp;
    double all, chg;
    double mag[kMagBuckets];
  };
  std::vector<Group> groups;
  double total = 0;
  for (size_t e = 0; e < nexp; ++e) {
    all[e] = std::max(all[e] * scale, chg[e]);
    total += all[e];
  }
  double per_group = total / kMaxDpGroups;
  for (size_t e = 0; e < nexp; ++e) {
    if (all[e] == 0) continue;
    if (groups.empty() || groups.back().all >= per_group || chg[e] > 0) {
      // A new group where the last is full, and at every exponent that
      // changed, so that change-rate boundaries stay choosable.
      if (groups.size() < kMaxDpGroups || groups.empty()) {
        groups.push_back({static_cast<int>(e), 0, 0, {}});
      }
    }
    groups.back().all += all[e];
    groups.back().chg += chg[e];
    for (int k = 0; k < kMagBuckets; ++k) groups.back().mag[k] += magnitudes[e * kMagBuckets + k] * change_scale;
  }
  const size_t g = groups.size();
  if (g <= 1) return spec;

  std::vector<double> pa(g + 1, 0), pc(g + 1, 0), pm((g + 1) * kMagBuckets, 0);
  for (size_t i = 0; i < g; ++i) {
    pa[i + 1] = pa[i] + groups[i].all;
    pc[i + 1] = pc[i] + groups[i].chg;
    for (int k = 0; k < kMagBuckets; ++k) {
      pm[(i + 1) * kMagBuckets + k] = pm[i * kMagBuckets + k] + groups[i].mag[k];
    }
  }
  // The magnitude buckets in use (at RL rates a handful of the 32): the
  // cost table's inner loop.
  int used = kMagBuckets;
  while (used > 0 && pm[g * kMagBuckets + used - 1] == 0) --used;
  // cost[a * (g + 1) + b]: bits of groups [a, b) as one class.
  std::vector<double> cost_table((g + 1) * (g + 1), 0.0);
  for (size_t a = 0; a < g; ++a) {
    for (size_t b = a + 1; b <= g; ++b) {
      double mix[kMagBuckets];
      double mags = 0;
      for (int k = 0; k < used; ++k) {
        mix[k] = pm[b * kMagBuckets + k] - pm[a * kMagBuckets + k];
        mags += mix[k];
      }
      cost_table[a * (g + 1) + b] = BinaryEntropyBits(pa[b] - pa[a], pc[b] - pc[a]) + MixEntropyBits(mix, mags, used);
    }
  }
  auto cost = [&](size_t a, size_t b) { return cost_table[a * (g + 1) + b]; };
  const int kmax = static_cast<int>(std::min<size_t>(std::clamp(options.max_classes, 1, kMaxClasses), g));
  constexpr double kInf = std::numeric_limits<double>::infinity();
  // dp[k][j]: best cost of groups [0, j) in k classes; from[k][j]: start of the last class.
  std::vector<std::vector<double>> dp(kmax + 1, std::vector<double>(g + 1, kInf));
  std::vector<std::vector<size_t>> from(kmax + 1, std::vector<size_t>(g + 1, 0));
  dp[0][0] = 0;
  for (int k = 1; k <= kmax; ++k) {
    for (size_t j = 1; j <= g; ++j) {
      for (size_t i = k - 1; i < j; ++i) {
        if (dp[k - 1][i] == kInf) continue;
        double c = dp[k - 1][i] + cost(i, j);
        if (c < dp[k][j]) {
          dp[k][j] = c;
          from[k][j] = i;
        }
      }
    }
  }
  int best_k = 1;
  double best = dp[1][g] + kClassPenaltyBits;
  for (int k = 2; k <= kmax; ++k) {
    double c = dp[k][g] + kClassPenaltyBits * k;
    if (c < best) {
      best = c;
      best_k = k;
    }
  }
  spec.k = best_k;
  size_t j = g;
  for (int k = best_k; k >= 2; --k) {
    size_t i = from[k][j];
    spec.thr[k - 2] = static_cast<uint16_t>(groups[i].first_exp);
    j = i;
  }
  return spec;
}

void WriteClassHeader(const ClassSpec& spec, std::string* out) {
  ByteWriter w(out);
  w.U8(static_cast<uint8_t>(spec.k));
  for (int t = 0; t < spec.k - 1; ++t) w.Varint(spec.thr[t]);
}

// Parses the class header at the front of a position stream; *rest is what
// follows it.
bool ReadClassHeader(std::string_view stream, ExponentField ef, ClassSpec* spec,
                     std::string_view* rest, ByteReader* r) {
  uint8_t k = 0;
  if (!r->U8(&k, "class count")) return false;
  if (k < 1 || k > kMaxClasses || (k > 1 && ef.mask == 0)) {
    return r->Fail("class count", "invalid value " + std::to_string(k));
  }
  spec->k = k;
  spec->shift = ef.shift;
  spec->mask = ef.mask;
  for (int t = 0; t < k - 1; ++t) {
    uint64_t v;
    if (!r->VarintAtMost(&v, ef.mask, "class threshold")) return false;
    if (t > 0 && v <= spec->thr[t - 1]) return r->Fail("class threshold", "not ascending");
    spec->thr[t] = static_cast<uint16_t>(v);
  }
  *rest = stream.substr(r->position());
  return true;
}

// ----------------------------------------------------------------- values

// A delta d != 0, read as a signed w-bit number, is one rANS symbol (its
// sign and magnitude bucket, tables per class) plus the magnitude's offset
// in its bucket as plain bits:
//   |d| 1..5: symbol 2(|d|-1) + negative
//   |d| 6..9: symbol 10 + negative, 2 bits of |d| - 6
//   |d| 10..17: symbol 12 + negative, 3 bits of |d| - 10
//   |d| >= 18: symbol 14, the sign bit, Elias gamma of |d| - 18
// Symbol 15 does not occur. At RL learning rates almost every change is one
// unit in the last place.
struct ValueSymbol {
  uint8_t sym;
  uint8_t extra_bits;  // of `extra`, except for the escape
  uint64_t extra;
};

using sparse::kValueEscape;
inline constexpr int kValueFirstWithBits = 10;  // symbols below have no bits
// The tables of the functions in sparse_decode.h, which the device reads.
template <typename F>
constexpr std::array<uint8_t, kRansSymbols> SymbolTable(F f) {
  std::array<uint8_t, kRansSymbols> t{};
  for (int s = 0; s < kRansSymbols; ++s) t[s] = static_cast<uint8_t>(f(s));
  return t;
}
inline constexpr auto kValueBase = SymbolTable(sparse::ValueBase);
inline constexpr auto kValueExtra = SymbolTable(sparse::ValueExtra);

// The encoder's side of kValueBase / kValueExtra (the decoder reads them).
template <typename T>
__attribute__((always_inline)) inline ValueSymbol ValueSymbolOf(T delta) {
  const int neg = static_cast<int>((delta >> (kBits<T> - 1)) & 1);
  const uint64_t mag = static_cast<uint64_t>(neg ? static_cast<T>(T{0} - delta) : delta);
  if (mag >= kValueBase[kValueEscape]) return {kValueEscape, 0, mag - kValueBase[kValueEscape]};
  const int sym = mag < kValueBase[kValueFirstWithBits]        ? static_cast<int>(2 * (mag - 1)) + neg
                  : mag < kValueBase[kValueFirstWithBits + 2] ? kValueFirstWithBits + neg
                                                              : kValueFirstWithBits + 2 + neg;
  return {static_cast<uint8_t>(sym), kValueExtra[sym], mag - kValueBase[sym]};
}

// Prepares a chunk's value stream: each change's symbol (value_sym; coded
// with its class's table) and the bits that refine the rarer, larger ones.
template <typename T>
void PrepareValues(const SparseDelta<T>& d, const std::vector<uint8_t>& cls, CoderScratch* scratch) {
  const size_t m = d.pos.size();
  scratch->value_sym.resize(m);
  uint8_t* sym = scratch->value_sym.data();
  // Two histograms take alternate changes: runs of one symbol (nearly every
  // change is +-1) then do not chain their increments through memory.
  uint32_t counts[2][kMaxClasses][kRansSymbols] = {};
  for (size_t i = 0; i < m; ++i) {
    sym[i] = ValueSymbolOf(d.delta[i]).sym;
    ++counts[i & 1][cls[i]][sym[i]];
  }
  PendingStream& out = scratch->values;
  out.bits.Clear();
  bool refined = false;  // a symbol with bits occurs
  for (int c = 0; c < kMaxClasses; ++c) {
    uint32_t* both = counts[0][c];
    for (int v = 0; v < kRansSymbols; ++v) both[v] += counts[1][c][v];
    if (std::any_of(both, both + kRansSymbols, [](uint32_t v) { return v > 0; })) {
      out.tables[c] = ChooseRansTable(both, &out.bits);
    }
    refined = refined || std::any_of(both + kValueFirstWithBits, both + kRansSymbols, [](uint32_t v) { return v > 0; });
  }
  if (refined) {
    // At most a sign and a gamma code (1 + 127 bits) per change.
    BitWriter::Cursor fields = out.bits.Open(m * 128);
    for (size_t i = 0; i < m; ++i) {
      if (sym[i] < kValueFirstWithBits) continue;  // |d| <= 5: nearly every change at RL rates
      const ValueSymbol v = ValueSymbolOf(d.delta[i]);
      if (v.sym == kValueEscape) {
        fields.Put(static_cast<uint64_t>((d.delta[i] >> (kBits<T> - 1)) & 1), 1);
        fields.PutGamma(v.extra);
      } else {
        fields.Put(v.extra, v.extra_bits);
      }
    }
    out.bits.Close(fields);
  }
}

// Splits a rANS stream into its words and its bits.
bool SplitRansStream(std::string_view stream, std::string_view* words, std::string_view* bits) {
  ByteReader r(stream, "rANS stream");
  uint64_t count = 0;
  if (!r.Varint(&count, "word count") || count < 4 || count > stream.size() / 2) return false;
  std::string_view w;
  if (!r.Bytes(static_cast<size_t>(count) * 2, &w, "words")) return false;
  *words = w;
  *bits = stream.substr(r.position());
  return true;
}

template <typename T>
Status DecodeValues(std::string_view stream, const std::vector<uint8_t>& cls, SparseDelta<T>* out) {
  const size_t m = out->pos.size();
  std::string_view words, raw;
  if (!SplitRansStream(stream, &words, &raw)) return DataLossError("value stream: malformed word count");
  BitReader bits(raw);
  uint64_t counts[kMaxClasses] = {};
  for (size_t i = 0; i < m; ++i) ++counts[cls[i]];
  auto tables = std::make_unique_for_overwrite<RansDecodeTable[]>(kMaxClasses);  // built where used
  for (int c = 0; c < kMaxClasses; ++c) {
    if (counts[c] == 0) continue;
    RansTable t;
    if (!ReadRansTable(&bits, &t)) return DataLossError("value stream: class " + std::to_string(c) + ": bad table");
    tables[c].Build(t);
  }
  RansDecoder dec(words);
  const uint64_t max_escape = (uint64_t{1} << (kBits<T> - 1)) - kValueBase[kValueEscape];
  out->delta.resize(m);
  T* delta = out->delta.data();
  size_t at = 0;  // the delta being decoded (for the error)
  const bool decoded = dec.Run(
      0, m, [&](size_t i) -> const RansDecodeTable& { return tables[cls[i]]; },
      [&](size_t i, uint32_t entry) {
        at = i;
        const uint32_t sym = entry & 0xF;
        uint64_t mag;
        int neg;
        if (sym < kValueEscape) {
          neg = static_cast<int>(sym & 1);
          mag = kValueBase[sym] + bits.Get(kValueExtra[sym]);
        } else {
          neg = static_cast<int>(bits.Get(1));
          uint64_t extra;
          if (sym != kValueEscape || !bits.GetGamma(max_escape, &extra)) return false;
          mag = kValueBase[kValueEscape] + extra;
        }
        const T t = static_cast<T>(mag);
        delta[i] = neg ? static_cast<T>(T{0} - t) : t;
        return true;
      });
  if (!decoded) return DataLossError("value stream: delta " + std::to_string(at) + " out of range");
  if (!dec.Finish() || !bits.ExactlyConsumed()) return DataLossError("value stream: truncated or corrupt");
  return Status::Ok();
}

// Classes of m changes from their old values old_of(i) (all 0 when
// unconditioned).
template <typename OldOf>
void ClassesInto(size_t m, const ClassSpec& spec, OldOf&& old_of, std::vector<uint8_t>* cls) {
  cls->assign(m, 0);
  if (spec.k > 1) {
    const std::vector<uint8_t> class_of = ClassTable(spec);
    for (size_t i = 0; i < m; ++i) (*cls)[i] = class_of[spec.Exponent(old_of(i))];
  }
}

template <typename T>
std::vector<uint8_t> ClassesOf(const T* old, size_t m, const ClassSpec& spec) {
  std::vector<uint8_t> cls;
  ClassesInto(m, spec, [old](size_t i) { return old[i]; }, &cls);
  return cls;
}

// Per-class ranks of the changed positions (ascending, below n), by
// sweeping the class masks of every 64-element word, segment by segment.
// Running counts: total elements, and elements reaching each threshold; a
// class's count before an element is the difference of neighbours.
template <int K, typename T>
void RanksByClassK(const T* base, size_t n, const std::vector<uint32_t>& pos, const ClassSpec& spec,
                   std::vector<uint32_t>* rank) {
  constexpr size_t kSegmentWords = kSweepSegment / kWord;
  const WordMasker<T> masker(spec);
  auto ge = std::make_unique_for_overwrite<WordGe[]>(kSegmentWords);
  uint32_t total = 0;
  uint32_t reach[K - 1] = {};
  size_t i = 0;
  for (size_t seg = 0; seg < n && i < pos.size(); seg += kSegmentWords * kWord) {
    const size_t seg_n = std::min(n - seg, kSegmentWords * kWord);
    masker.template Run<K, false>(base + seg, nullptr, seg_n, nullptr, ge.get());
    for (size_t w = 0; w * kWord < seg_n; ++w) {
      const size_t first = seg + w * kWord;
      const uint64_t valid = WordValid(seg_n, w);
      const uint64_t* g = ge[w];
      for (; i < pos.size() && pos[i] < first + kWord; ++i) {
        const int j = static_cast<int>(pos[i] - first);
        const uint64_t below = (uint64_t{1} << j) - 1;
        int c = 0;
        while (c < K - 1 && ((g[c] >> j) & 1)) ++c;
        const uint32_t upper = c == 0 ? total + std::popcount(valid & below) : reach[c - 1] + std::popcount(g[c - 1] & below);
        const uint32_t lower = c == K - 1 ? 0u : reach[c] + std::popcount(g[c] & below);
        (*rank)[i] = upper - lower;
      }
      total += static_cast<uint32_t>(std::popcount(valid));
      for (int t = 0; t < K - 1; ++t) reach[t] += static_cast<uint32_t>(std::popcount(g[t]));
    }
  }
}

// ----------------------------------------------------------- sparse mode

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
using sparse::kGapEscape;
using sparse::kMaxShift;
inline constexpr auto kGapBase = SymbolTable(sparse::GapBase);
inline constexpr auto kGapExtra = SymbolTable(sparse::GapExtra);
static_assert(kGapBase[8] == 8 && kGapBase[14] == 64 && kGapBase[15] == 128 && kGapExtra[14] == 6);

// The symbol of quotient q (< 128: the table; else the escape).
constexpr std::array<uint8_t, 128> kGapSymbol = [] {
  std::array<uint8_t, 128> t{};
  int s = 0;
  for (int q = 0; q < 128; ++q) {
    while (s + 1 < kGapEscape && q >= kGapBase[s + 1]) ++s;
    t[q] = static_cast<uint8_t>(s);
  }
  return t;
}();

uint8_t GapSymbol(uint64_t q) { return q < 128 ? kGapSymbol[q] : kGapEscape; }

// A histogram of gaps by bit length and leading three bits: it tells a
// gap's symbol at every shift (the quotient's bits are the gap's leading
// ones), so one pass serves every candidate shift.
struct GapHistogram {
  static constexpr int kBins = 33 * 8;
  // bin = bit_width(g) * 8 + g's three leading bits (g itself below 8).
  static int Bin(uint32_t g) {
    // bit_width(g) from an operand that is never zero: std::bit_width
    // branches on zero, and zero gaps are common and unpredictable in a
    // class that changes often.
    const int w = 63 - std::countl_zero((uint64_t{g} << 1) | 1);
    return w * 8 + static_cast<int>(g >> std::max(w - 3, 0));
  }
  uint32_t n[kBins] = {};
};

// The symbol (below the escape) of the gaps in histogram bin b at shift r,
// or kGapEscape for quotients of 128 and more.
uint8_t BinSymbol(int b, int r) {
  const int w = b / 8, lead = b % 8;
  const int qw = w - r;  // the quotient's bit length
  if (qw <= 0) return 0;
  if (qw >= 8) return kGapEscape;
  // Below 8 the quotient is its leading bits; above, its symbol depends on
  // its length and the bit after the leading one only.
  const int q = w <= 3 ? lead >> r : qw <= 3 ? lead >> (3 - qw) : lead << (qw - 3);
  return kGapSymbol[q];
}

// Symbol counts of a class's gaps at three consecutive shifts r0, r0+1,
// r0+2, and the estimated bits of coding them at each.
struct GapCosts {
  uint32_t counts[3][kRansSymbols] = {};
  double bits[3] = {};
};

GapCosts CountGaps(const uint32_t* gaps, size_t count, const GapHistogram& hist, int r0) {
  GapCosts g;
  for (int b = 0; b < GapHistogram::kBins; ++b) {
    if (hist.n[b] == 0) continue;
    for (int t = 0; t < 3; ++t) g.counts[t][BinSymbol(b, r0 + t)] += hist.n[b];
  }
  // Escapes (rare: 32 times the mean gap and more) cost their gamma codes.
  uint64_t escape_bits[3] = {};
  if (g.counts[0][kGapEscape] != 0) {
    const uint64_t escape_at = uint64_t{kGapBase[kGapEscape]} << r0;
    for (size_t i = 0; i < count; ++i) {
      if (gaps[i] < escape_at) continue;
      for (int t = 0; t < 3; ++t) {
        const uint64_t q = uint64_t{gaps[i]} >> (r0 + t);
        if (q >= kGapBase[kGapEscape]) escape_bits[t] += static_cast<uint64_t>(GammaBits(q - kGapBase[kGapEscape]));
      }
    }
  }
  for (int t = 0; t < 3; ++t) {
    uint64_t extra = escape_bits[t] + static_cast<uint64_t>(count) * static_cast<uint64_t>(r0 + t);
    for (int s = 0; s < kRansSymbols; ++s) extra += uint64_t{g.counts[t][s]} * kGapExtra[s];
    g.bits[t] = static_cast<double>(extra) + RansCostBits(g.counts[t]);
  }
  return g;
}

// The ranks of a chunk's changes grouped by class: class c's, ascending,
// are rank[c][0 .. count[c]).
struct ClassRanks {
  const uint32_t* rank[kMaxClasses] = {};
  size_t count[kMaxClasses] = {};
};

// Groups ranks given in position order by the changes' classes (a counting
// sort: class after class, each in position order) into *storage.
ClassRanks GroupRanks(const std::vector<uint8_t>& cls, const uint32_t* rank, std::vector<uint32_t>* storage) {
  ClassRanks g;
  for (uint8_t c : cls) ++g.count[c];
  storage->resize(cls.size());
  size_t fill[kMaxClasses];
  for (size_t c = 0, start = 0; c < kMaxClasses; start += g.count[c++]) {
    fill[c] = start;
    g.rank[c] = storage->data() + start;
  }
  for (size_t i = 0; i < cls.size(); ++i) (*storage)[fill[cls[i]]++] = rank[i];
  return g;
}

// Prepares a sparse chunk's position stream: its class header goes to *out,
// each gap's table entry to gap_coded (class after class), and the bits.
void PreparePositions(const ClassRanks& ranks, const ClassSpec& spec, CoderScratch* scratch, std::string* out) {
  WriteClassHeader(spec, out);
  // Each class's gaps (class after class), sum and histogram. Within a
  // class nothing carries from one change to the next but its rank, and
  // two histograms take alternate gaps, so that runs of gaps in one bin do
  // not chain their increments.
  size_t start[kMaxClasses + 1] = {};
  for (int c = 0; c < kMaxClasses; ++c) start[c + 1] = start[c] + ranks.count[c];
  std::vector<uint32_t>& gaps = scratch->gaps;
  gaps.resize(start[kMaxClasses]);
  uint64_t sum[kMaxClasses] = {};
  auto hist = std::make_unique<GapHistogram[]>(2 * static_cast<size_t>(spec.k));
  for (int c = 0; c < spec.k; ++c) {
    const uint32_t* r = ranks.rank[c];
    uint32_t* g = gaps.data() + start[c];
    GapHistogram& even = hist[2 * c];
    GapHistogram& odd = hist[2 * c + 1];
    uint64_t total = 0;
    const size_t count = ranks.count[c];
    for (size_t i = 0; i < count; ++i) {
      g[i] = r[i] - (i == 0 ? 0 : r[i - 1] + 1);
      total += g[i];
      ++(i % 2 ? odd : even).n[GapHistogram::Bin(g[i])];
    }
    for (int b = 0; b < GapHistogram::kBins; ++b) even.n[b] += odd.n[b];
    sum[c] = total;
  }

  PendingStream& stream = scratch->positions;
  BitWriter& bits = stream.bits;
  bits.Clear();
  for (int c = 0; c < spec.k; ++c) bits.PutGamma(ranks.count[c]);
  int shift[kMaxClasses] = {};
  RansTable* tables = stream.tables;
  for (int c = 0; c < spec.k; ++c) {
    const size_t count = ranks.count[c];
    if (count == 0) continue;
    // The shift that puts the mean quotient near 4, or a neighbour.
    const uint64_t mean = sum[c] / count;
    const int r0 = std::clamp(static_cast<int>(std::bit_width(mean / 4)) - 2, 0, kMaxShift - 2);
    const GapCosts costs = CountGaps(gaps.data() + start[c], count, hist[2 * c], r0);
    const int best = static_cast<int>(std::min_element(costs.bits, costs.bits + 3) - costs.bits);
    shift[c] = r0 + best;
    const uint32_t* best_counts = costs.counts[best];
    bits.Put(static_cast<uint64_t>(shift[c]), 5);
    tables[c] = ChooseRansTable(best_counts, &bits);
  }
  // The refining bits in order, and each gap's rANS symbol with its table.
  std::vector<const RansEncSymbol*>& coded = scratch->gap_coded;
  coded.resize(gaps.size());
  // At most a gamma code (127 bits) and r <= 31 low bits per gap.
  BitWriter::Cursor fields = bits.Open(gaps.size() * 160);
  for (int c = 0; c < spec.k; ++c) {
    const int r = shift[c];
    const RansEncSymbol* enc = tables[c].enc.data();
    for (size_t i = start[c]; i < start[c + 1]; ++i) {
      const uint64_t g = gaps[i];
      const uint64_t q = g >> r;
      const uint8_t s = GapSymbol(q);
      coded[i] = enc + s;
      const uint64_t low = g & ((uint64_t{1} << r) - 1);
      if (s == kGapEscape) {
        fields.PutGamma(q - kGapBase[kGapEscape]);
        fields.Put(low, r);
      } else {
        fields.Put(((q - kGapBase[s]) << r) | low, kGapExtra[s] + r);
      }
    }
  }
  bits.Close(fields);
}

// Decodes the per-class ranks of a sparse chunk; positions follow from
// them alone when k == 1, else from the base (ResolveRanks).
Status DecodeSparseRanks(std::string_view coded, size_t n, uint64_t changed, ChunkPositions* out) {
  const ClassSpec& spec = out->spec;
  std::string_view words, raw;
  if (!SplitRansStream(coded, &words, &raw)) return DataLossError("position stream: malformed word count");
  BitReader bits(raw);
  uint64_t counts[kMaxClasses];
  uint64_t sum = 0;
  for (int c = 0; c < spec.k; ++c) {
    if (!bits.GetGamma(changed - sum, &counts[c])) {
      return DataLossError("position stream: class " + std::to_string(c) + " count exceeds the " +
                           std::to_string(changed) + " changed elements");
    }
    sum += counts[c];
  }
  if (sum != changed) {
    return DataLossError("position stream: class counts sum to " + std::to_string(sum) +
                         ", directory says " + std::to_string(changed));
  }
  int shift[kMaxClasses] = {};
  auto tables = std::make_unique_for_overwrite<RansDecodeTable[]>(spec.k);  // built where used
  for (int c = 0; c < spec.k; ++c) {
    if (counts[c] == 0) continue;
    shift[c] = static_cast<int>(bits.Get(5));
    RansTable t;
    if (!ReadRansTable(&bits, &t)) return DataLossError("position stream: class " + std::to_string(c) + ": bad table");
    tables[c].Build(t);
  }
  // Target ranks per class, ascending.
  out->class_counts.assign(counts, counts + spec.k);
  out->ranks.resize(changed);
  uint32_t* rank_out = out->ranks.data();
  RansDecoder dec(words);
  size_t first = 0;
  for (int c = 0; c < spec.k; ++c) {
    uint64_t next = 0;
    const int r = shift[c];
    const uint64_t low_mask = (uint64_t{1} << r) - 1;
    const RansDecodeTable& table = tables[c];
    const bool decoded = dec.Run(
        first, counts[c], [&](size_t) -> const RansDecodeTable& { return table; },
        [&](size_t, uint32_t entry) {
          const uint32_t s = entry & 0xF;
          uint64_t q = 0;
          uint64_t low;
          bool ok = true;
          if (s != kGapEscape) {
            const uint64_t v = bits.Get(kGapExtra[s] + r);
            q = kGapBase[s] + (v >> r);
            low = v & low_mask;
          } else {
            ok = bits.GetGamma(n, &q);
            q += kGapBase[kGapEscape];
            low = bits.Get(r);
          }
          const uint64_t gap = (q << r) | low;
          if (!ok || q > n || next >= n || gap > n - 1 - next) return false;
          *rank_out++ = static_cast<uint32_t>(next + gap);
          next = next + gap + 1;
          return true;
        });
    if (!decoded) {
      return DataLossError("position stream: class " + std::to_string(c) + " gap " +
                           std::to_string(rank_out - out->ranks.data() - static_cast<ptrdiff_t>(first)) +
                           " overruns the chunk of " + std::to_string(n) + " elements");
    }
    first += counts[c];
  }
  if (!dec.Finish() || !bits.ExactlyConsumed()) return DataLossError("position stream: truncated or corrupt");

  if (spec.k == 1) {
    out->pos = std::move(out->ranks);
    out->ranks.clear();
    out->class_counts.clear();
    return Status::Ok();
  }
  out->ranked = true;
  return Status::Ok();
}

// Elements of class c in a chunk (for error messages).
template <typename T>
size_t ClassSize(const T* base, size_t n, const ClassSpec& spec, int c) {
  size_t count = 0;
  for (size_t i = 0; i < n; ++i) count += spec.ClassOf(base[i]) == c;
  return count;
}

}  // namespace

template <typename T>
Status ResolveRanks(const T* base, size_t n, ChunkPositions* cp) {
  if (!cp->ranked) return Status::Ok();
  const ClassSpec& spec = cp->spec;
  // The ranks are stored class after class.
  std::vector<const uint32_t*> ranks(spec.k);
  const uint32_t* next = cp->ranks.data();
  for (int c = 0; c < spec.k; ++c) {
    ranks[c] = next;
    next += cp->class_counts[c];
  }
  std::vector<uint64_t> done(spec.k);
  cp->pos.resize(cp->ranks.size() + 2);
  const size_t found =
      ResolveRankSweep(base, n, spec, ranks.data(), cp->class_counts.data(), cp->pos.data(), done.data());
  cp->pos.resize(found);
  if (found != cp->ranks.size()) {
    for (int c = 0; c < spec.k; ++c) {
      if (done[c] < cp->class_counts[c]) {
        return DataLossError("position stream: class " + std::to_string(c) + " rank " +
                             std::to_string(ranks[c][done[c]]) + " beyond its " +
                             std::to_string(ClassSize(base, n, spec, c)) + " elements");
      }
    }
    return DataLossError("position stream: ranks beyond their classes");
  }
  cp->ranked = false;
  cp->ranks.clear();
  cp->class_counts.clear();
  return Status::Ok();
}

namespace {

// ------------------------------------------------------------- runs mode

struct RunModels {
  EGModel unchanged;
  EGModel changed;
};

size_t CountRuns(const std::vector<uint32_t>& pos) {
  size_t runs = 0;
  for (size_t i = 0; i < pos.size(); ++i) runs += (i == 0 || pos[i] != pos[i - 1] + 1) ? 1 : 0;
  return runs;
}

void EncodeRunPositions(const std::vector<uint32_t>& pos, const ClassSpec& spec, std::string* out) {
  WriteClassHeader(spec, out);
  auto models = std::make_unique<RunModels>();
  RangeEncoder enc(out);
  uint32_t cur = 0;
  size_t i = 0;
  while (i < pos.size()) {
    size_t j = i + 1;
    while (j < pos.size() && pos[j] == pos[j - 1] + 1) ++j;
    enc.EncodeEG(models->unchanged, pos[i] - cur);
    enc.EncodeEG(models->changed, j - i - 1);
    cur = pos[j - 1] + 1;
    i = j;
  }
  enc.Finish();
}

Status DecodeRunPositions(std::string_view coded, size_t n, uint64_t changed, std::vector<uint32_t>* pos) {
  auto models = std::make_unique<RunModels>();
  RangeDecoder dec(coded);
  pos->clear();
  pos->reserve(changed);
  uint64_t cur = 0;
  while (pos->size() < changed) {
    uint64_t skip, len;
    if (!dec.DecodeEG(models->unchanged, n - cur, &skip) || cur + skip >= n) {
      return DataLossError("run stream: run overruns the chunk of " + std::to_string(n) + " elements");
    }
    cur += skip;
    const uint64_t left = std::min<uint64_t>(n - cur, changed - pos->size());
    if (!dec.DecodeEG(models->changed, left - 1, &len)) {
      return DataLossError("run stream: changed run overruns the chunk or the changed count");
    }
    for (uint64_t k = 0; k <= len; ++k) pos->push_back(static_cast<uint32_t>(cur + k));
    cur += len + 1;
  }
  if (dec.overrun() > 4 || dec.corrupt()) return DataLossError("run stream: truncated or corrupt");
  return Status::Ok();
}

// ----------------------------------------------------------- bitmap mode

void EncodeBitmapPositions(const std::vector<uint32_t>& pos, size_t n, const ClassSpec& spec,
                           int zstd_level, std::string* out) {
  WriteClassHeader(spec, out);
  std::string bits((n + 7) / 8, '\0');
  for (uint32_t p : pos) bits[p >> 3] = static_cast<char>(bits[p >> 3] | (1 << (p & 7)));
  ZstdCompress(bits, zstd_level, out);
}

Status DecodeBitmapPositions(std::string_view coded, size_t n, uint64_t changed, std::vector<uint32_t>* pos) {
  WSYNC_RETURN_IF_ERROR(ZstdCheckFrameSize(coded, (n + 7) / 8, "bitmap stream"));
  std::string bits((n + 7) / 8, '\0');
  WSYNC_RETURN_IF_ERROR(ZstdDecompressExact(coded, bits.data(), bits.size(), "bitmap stream"));
  if (n % 8 != 0 && (static_cast<uint8_t>(bits.back()) >> (n % 8)) != 0) {
    return DataLossError("bitmap stream: bits set past the chunk's end");
  }
  pos->clear();
  for (size_t i = 0; i < bits.size(); ++i) {
    uint32_t byte = static_cast<uint8_t>(bits[i]);
    while (byte != 0) {
      if (pos->size() == changed) {
        return DataLossError("bitmap stream: more than the " + std::to_string(changed) + " changed elements");
      }
      pos->push_back(static_cast<uint32_t>(i * 8 + std::countr_zero(byte)));
      byte &= byte - 1;
    }
  }
  if (pos->size() != changed) {
    return DataLossError("bitmap stream: " + std::to_string(pos->size()) + " bits set, directory says " +
                         std::to_string(changed));
  }
  return Status::Ok();
}

// ------------------------------------------------------------ byte planes

template <typename T>
void ToPlanes(const T* x, size_t n, std::string* planes) {
  planes->resize(n * sizeof(T));
  for (size_t b = 0; b < sizeof(T); ++b) {
    char* dst = planes->data() + b * n;
    for (size_t i = 0; i < n; ++i) dst[i] = static_cast<char>(x[i] >> (8 * b));
  }
}

template <typename T>
void FromPlanes(const std::string& planes, size_t n, T* x) {
  std::fill(x, x + n, T{0});
  for (size_t b = 0; b < sizeof(T); ++b) {
    const auto* src = reinterpret_cast<const uint8_t*>(planes.data() + b * n);
    for (size_t i = 0; i < n; ++i) x[i] |= static_cast<T>(static_cast<T>(src[i]) << (8 * b));
  }
}

template <typename T>
void EncodeDense(const SparseDelta<T>& d, size_t n, int zstd_level, std::string* out) {
  std::vector<T> dense(n, T{0});
  for (size_t i = 0; i < d.pos.size(); ++i) dense[d.pos[i]] = d.delta[i];
  std::string planes;
  ToPlanes(dense.data(), n, &planes);
  ZstdCompress(planes, zstd_level, out);
}

template <typename T>
Status DecodeDense(std::string_view coded, size_t n, uint64_t changed, SparseDelta<T>* out) {
  WSYNC_RETURN_IF_ERROR(ZstdCheckFrameSize(coded, n * sizeof(T), "dense stream"));
  std::string planes(n * sizeof(T), '\0');
  WSYNC_RETURN_IF_ERROR(ZstdDecompressExact(coded, planes.data(), planes.size(), "dense stream"));
  std::vector<T> dense(n);
  FromPlanes(planes, n, dense.data());
  out->Clear();
  for (size_t i = 0; i < n; ++i) {
    if (dense[i] != 0) {
      out->pos.push_back(static_cast<uint32_t>(i));
      out->delta.push_back(dense[i]);
    }
  }
  if (out->pos.size() != changed) {
    return DataLossError("dense stream: " + std::to_string(out->pos.size()) +
                         " nonzero deltas, directory says " + std::to_string(changed));
  }
  return Status::Ok();
}

}  // namespace

// ------------------------------------------------------------- public part

template <typename T>
void DiffChunk(const T* base, const T* target, size_t n, SparseDelta<T>* out) {
  const size_t full = n / kBlock * kBlock;
  for (size_t b = 0; b < full; b += kBlock) {
    if (BlockEqual(base + b, target + b)) continue;
    uint32_t m = NeMask(base + b, target + b);
    while (m != 0) {
      const size_t i = b + std::countr_zero(m);
      out->pos.push_back(static_cast<uint32_t>(i));
      out->delta.push_back(static_cast<T>(target[i] - base[i]));
      m &= m - 1;
    }
  }
  for (size_t i = full; i < n; ++i) {
    if (base[i] != target[i]) {
      out->pos.push_back(static_cast<uint32_t>(i));
      out->delta.push_back(static_cast<T>(target[i] - base[i]));
    }
  }
}

size_t SampledElements(size_t n) {
  const size_t blocks = n / kBlock;
  return (blocks + kSampleStride - 1) / kSampleStride * kBlock;
}

template <typename T>
void SampleHistogram(const T* base, size_t n, ExponentField exponent, uint32_t* hist) {
  std::fill(hist, hist + size_t{exponent.mask} + 1, 0u);
  if (exponent.mask == 0) return;
  ClassSpec spec;
  spec.shift = exponent.shift;
  spec.mask = exponent.mask;
  // Eight interleaved histograms, element j of a group of eight counting in
  // the j-th: runs of equal exponents (the common case) would otherwise
  // wait on each other's increments.
  constexpr int kParts = 8;
  static_assert(kBlock % kParts == 0);
  const size_t bins = size_t{exponent.mask} + 1;
  std::vector<uint32_t> part(kParts * bins, 0);
  const size_t blocks = n / kBlock;
  for (size_t b = 0; b < blocks; b += kSampleStride) {
    const T* x = base + b * kBlock;
    for (int j = 0; j < kBlock; j += kParts) {
#pragma GCC unroll 8
      for (int k = 0; k < kParts; ++k) ++part[k * bins + spec.Exponent(x[j + k])];
    }
  }
  for (size_t e = 0; e < bins; ++e) {
    uint32_t sum = 0;
    for (int k = 0; k < kParts; ++k) sum += part[k * bins + e];
    hist[e] = sum;
  }
}

template <typename T>
ClassSpec ChooseClasses(size_t n, const uint32_t* sample_hist, const SparseDelta<T>& d, const T* old,
                        const ChunkCodecOptions& options) {
  return ChooseClassesImpl(n, sample_hist, d, old, options);
}

bool NeedsRanks(size_t n, size_t m, const ClassSpec& spec) { return m > 0 && m * 2 <= n && spec.k > 1; }

template <typename T>
void RanksByClass(const T* base, size_t n, const std::vector<uint32_t>& pos, const ClassSpec& spec,
                  std::vector<uint32_t>* rank) {
  rank->assign(pos.size(), 0);
  static_assert(kMaxClasses == 8);
  switch (spec.k) {
    case 1: std::copy(pos.begin(), pos.end(), rank->begin()); return;
    case 2: return RanksByClassK<2>(base, n, pos, spec, rank);
    case 3: return RanksByClassK<3>(base, n, pos, spec, rank);
    case 4: return RanksByClassK<4>(base, n, pos, spec, rank);
    case 5: return RanksByClassK<5>(base, n, pos, spec, rank);
    case 6: return RanksByClassK<6>(base, n, pos, spec, rank);
    case 7: return RanksByClassK<7>(base, n, pos, spec, rank);
    default: return RanksByClassK<8>(base, n, pos, spec, rank);
  }
}

namespace {

// Codes the change in the smallest mode, from each change's class (in
// position order) and, when sparse mode is tried (m * 2 <= n), the ranks
// grouped by class.
template <typename T>
EncodedChunk EncodeChunkCoded(size_t n, const SparseDelta<T>& d, const std::vector<uint8_t>& cls,
                              const ClassRanks& ranks, const ClassSpec& spec, int zstd_level) {
  EncodedChunk best;
  const size_t m = d.pos.size();
  best.changed = m;
  if (m == 0) return best;

  const size_t runs = CountRuns(d.pos);
  const bool try_sparse = m * 2 <= n;
  const bool try_runs = runs * 4 <= m || !try_sparse;
  const bool try_bitmap = m * 32 > n;
  const bool try_dense = m * 4 > n;

  // Every mode but dense codes the values in the same stream.
  CoderScratch& scratch = ThreadCoderScratch();
  PrepareValues(d, cls, &scratch);
  PendingStream& values = scratch.values;
  const uint8_t* sym = scratch.value_sym.data();
  auto value_symbol = [&](size_t i) -> const RansEncSymbol& { return values.tables[cls[i]].enc[sym[i]]; };
  std::string val, sparse;
  if (try_sparse) {
    // Both streams' rANS passes at once (their dependency chains overlap).
    PreparePositions(ranks, spec, &scratch, &sparse);
    const RansEncSymbol* const* gap = scratch.gap_coded.data();
    RansEncoder::EncodePair(&values.rans, m, value_symbol, &scratch.positions.rans, scratch.gap_coded.size(),
                            [&](size_t i) -> const RansEncSymbol& { return *gap[i]; });
    scratch.positions.AppendTo(&sparse);
  } else {
    values.rans.Encode(m, value_symbol);
  }
  values.AppendTo(&val);

  size_t best_size = 0;
  auto consider = [&](ChunkMode mode, std::string pos, size_t val_size) {
    if (best.mode == ChunkMode::kEmpty || pos.size() + val_size < best_size) {
      best.mode = mode;
      best.pos = std::move(pos);
      best_size = best.pos.size() + val_size;
    }
  };
  if (try_sparse) consider(ChunkMode::kSparse, std::move(sparse), val.size());
  if (try_runs) {
    std::string pos;
    EncodeRunPositions(d.pos, spec, &pos);
    consider(ChunkMode::kRuns, std::move(pos), val.size());
  }
  if (try_bitmap) {
    std::string pos;
    EncodeBitmapPositions(d.pos, n, spec, zstd_level, &pos);
    consider(ChunkMode::kBitmap, std::move(pos), val.size());
  }
  if (try_dense) {
    std::string pos;
    EncodeDense(d, n, zstd_level, &pos);
    consider(ChunkMode::kDense, std::move(pos), 0);
  }
  if (best.mode != ChunkMode::kDense) best.val = std::move(val);
  return best;
}

// One class: the positions are the ranks.
ClassRanks PositionsAsRanks(const std::vector<uint32_t>& pos) {
  ClassRanks g;
  g.rank[0] = pos.data();
  g.count[0] = pos.size();
  return g;
}

}  // namespace

template <typename T>
EncodedChunk EncodeChunkStaged(size_t n, const SparseDelta<T>& d, const T* old, const ClassSpec& spec,
                               const uint32_t* rank, int zstd_level) {
  const size_t m = d.pos.size();
  const std::vector<uint8_t> cls = ClassesOf(old, m, spec);
  std::vector<uint32_t> grouped;
  const ClassRanks ranks = !NeedsRanks(n, m, spec) ? PositionsAsRanks(d.pos) : GroupRanks(cls, rank, &grouped);
  return EncodeChunkCoded(n, d, cls, ranks, spec, zstd_level);
}

namespace {

// The base's values at the given positions.
template <typename T>
std::vector<T> GatherAt(const T* base, const std::vector<uint32_t>& pos) {
  std::vector<T> out(pos.size());
  for (size_t i = 0; i < pos.size(); ++i) out[i] = base[pos[i]];
  return out;
}

// ChooseClasses on the base's sampled histogram.
template <typename T>
ClassSpec ChooseClassesOnBase(const T* base, size_t n, const SparseDelta<T>& evidence, const T* old,
                              const ChunkCodecOptions& options) {
  std::vector<uint32_t> hist(size_t{options.exponent.mask} + 1);
  SampleHistogram(base, n, options.exponent, hist.data());
  return ChooseClasses(n, hist.data(), evidence, old, options);
}

}  // namespace

template <typename T>
EncodedChunk EncodeChunk(const T* base, size_t n, const SparseDelta<T>& d,
                         const ChunkCodecOptions& options) {
  if (d.pos.empty()) return EncodedChunk{};
  const bool conditioned = base != nullptr && options.condition && options.exponent.mask != 0;
  const std::vector<T> old = conditioned ? GatherAt(base, d.pos) : std::vector<T>();
  const ClassSpec spec = conditioned ? ChooseClassesOnBase(base, n, d, old.data(), options)
                                     : ChooseClasses<T>(n, nullptr, d, nullptr, options);
  std::vector<uint32_t> rank;
  if (NeedsRanks(n, d.pos.size(), spec)) RanksByClass(base, n, d.pos, spec, &rank);
  return EncodeChunkStaged(n, d, old.empty() ? nullptr : old.data(), spec, rank.data(), options.zstd_level);
}

template <typename T>
ClassSpec ChooseChunkClasses(const T* base, const T* target, size_t n, const ChunkCodecOptions& options) {
  if (!options.condition || options.exponent.mask == 0) {
    return ChooseClasses<T>(n, nullptr, SparseDelta<T>{}, nullptr, options);  // unconditioned
  }
  SparseDelta<T> evidence;
  std::vector<T> old;
  if (ClassesFromSampledChanges(n)) {
    SampleChanges(base, target, n, &evidence, &old);
  } else {
    // A small chunk (in cache): every change, then the sweep.
    DiffChunk(base, target, n, &evidence);
    old = GatherAt(base, evidence.pos);
  }
  return ChooseClassesOnBase(base, n, evidence, old.data(), options);
}

template <typename T>
EncodedChunk EncodeChunkPair(const T* base, const T* target, size_t n, const ChunkCodecOptions& options,
                             const ClassSpec* classes, const std::function<void(size_t, size_t)>& segment_done) {
  const ClassSpec spec = classes != nullptr ? *classes : ChooseChunkClasses(base, target, n, options);
  // The sweep's output, like the coder's scratch, is the thread's own and
  // keeps its capacity from chunk to chunk (see CoderScratch).
  static thread_local ChunkSweep<T> sweep;
  SweepChunk(base, target, n, spec, &sweep, segment_done);
  if (sweep.d.pos.empty()) return EncodedChunk{};
  if (spec.k == 1) {
    return EncodeChunkCoded(n, sweep.d, std::vector<uint8_t>(sweep.d.pos.size(), 0), PositionsAsRanks(sweep.d.pos),
                            spec, options.zstd_level);
  }
  ClassRanks ranks;
  for (int c = 0; c < spec.k; ++c) {
    ranks.rank[c] = sweep.rank[c].data();
    ranks.count[c] = sweep.rank[c].size();
  }
  return EncodeChunkCoded(n, sweep.d, sweep.cls, ranks, spec, options.zstd_level);
}

template <typename T>
Status DecodeChunkPositions(ChunkMode mode, uint64_t changed, std::string_view pos, std::string_view val,
                            size_t n, ExponentField exponent, ChunkPositions* cp, SparseDelta<T>* out) {
  cp->Clear();  // not replaced: a reused cp keeps its buffers' capacity
  out->Clear();
  if (changed > n) {
    return DataLossError(std::to_string(changed) + " changed elements in a chunk of " + std::to_string(n));
  }
  switch (mode) {
    case ChunkMode::kEmpty:
      if (changed != 0 || !pos.empty() || !val.empty()) {
        return DataLossError("empty chunk with changes or streams");
      }
      return Status::Ok();
    case ChunkMode::kDense:
      if (!val.empty()) return DataLossError("dense chunk with a value stream");
      return DecodeDense(pos, n, changed, out);
    case ChunkMode::kSparse:
    case ChunkMode::kRuns:
    case ChunkMode::kBitmap:
      break;
    default:
      return DataLossError("unknown chunk mode " + std::to_string(static_cast<int>(mode)));
  }
  if (changed == 0) return DataLossError("non-empty chunk mode with no change");
  ByteReader r(pos, "position stream");
  std::string_view coded;
  if (!ReadClassHeader(pos, exponent, &cp->spec, &coded, &r)) return r.status();
  cp->values_pending = true;
  if (mode == ChunkMode::kSparse) return DecodeSparseRanks(coded, n, changed, cp);
  if (mode == ChunkMode::kRuns) return DecodeRunPositions(coded, n, changed, &cp->pos);
  return DecodeBitmapPositions(coded, n, changed, &cp->pos);
}

template <typename T>
Status DecodeChunkValues(std::string_view val, const ChunkPositions& cp, const T* old, SparseDelta<T>* out) {
  if (!cp.values_pending) return Status::Ok();
  if (cp.ranked) return FailedPreconditionError("chunk positions are still ranks; resolve them first");
  if (cp.spec.k > 1 && old == nullptr) {
    return FailedPreconditionError("chunk is coded relative to the base's exponents; the base is needed");
  }
  out->pos = cp.pos;
  return DecodeValues(val, ClassesOf(old, cp.pos.size(), cp.spec), out);
}

template <typename T>
Status DecodeChunk(ChunkMode mode, uint64_t changed, std::string_view pos, std::string_view val,
                   const T* base, size_t n, ExponentField exponent, SparseDelta<T>* out) {
  // The thread's own, kept from chunk to chunk (like the encoder's
  // CoderScratch): the ranks' and classes' buffers keep their capacity.
  static thread_local ChunkPositions cp;
  static thread_local std::vector<uint8_t> cls;
  WSYNC_RETURN_IF_ERROR(DecodeChunkPositions(mode, changed, pos, val, n, exponent, &cp, out));
  if (!cp.values_pending) return Status::Ok();
  if (cp.spec.k > 1) {
    if (base == nullptr) {
      return FailedPreconditionError("chunk is coded relative to the base's exponents; the base is needed");
    }
    WSYNC_RETURN_IF_ERROR(ResolveRanks(base, n, &cp));
  }
  // The classes straight from the base (DecodeChunkValues's work without a
  // gathered copy of the old values, or of the positions).
  const uint32_t* at = cp.pos.data();
  ClassesInto(cp.pos.size(), cp.spec, [base, at](size_t i) { return base[at[i]]; }, &cls);
  out->pos = std::move(cp.pos);
  return DecodeValues(val, cls, out);
}

bool ChunkNeedsBase(ChunkMode mode, std::string_view pos) {
  if (mode != ChunkMode::kSparse && mode != ChunkMode::kRuns && mode != ChunkMode::kBitmap) return false;
  return !pos.empty() && static_cast<uint8_t>(pos[0]) > 1;
}

Status LocateSparseStreams(std::string_view pos, std::string_view val, ExponentField exponent,
                           sparse::ChunkStreams* out) {
  ByteReader r(pos, "position stream");
  std::string_view coded;
  if (!ReadClassHeader(pos, exponent, &out->spec, &coded, &r)) return r.status();
  auto span = [](std::string_view stream, sparse::RansSpan* s) {
    std::string_view words, bits;
    if (!SplitRansStream(stream, &words, &bits)) return false;
    *s = {reinterpret_cast<const uint8_t*>(words.data()), words.size() / 2,
          reinterpret_cast<const uint8_t*>(bits.data()), bits.size()};
    return true;
  };
  if (!span(coded, &out->pos)) return DataLossError("position stream: malformed word count");
  if (!span(val, &out->val)) return DataLossError("value stream: malformed word count");
  return Status::Ok();
}

template <typename T>
void ScatterAdd(T* x, const SparseDelta<T>& d, bool undo) {
  const size_t m = d.pos.size();
  if (undo) {
    for (size_t i = 0; i < m; ++i) x[d.pos[i]] = static_cast<T>(x[d.pos[i]] - d.delta[i]);
  } else {
    for (size_t i = 0; i < m; ++i) x[d.pos[i]] = static_cast<T>(x[d.pos[i]] + d.delta[i]);
  }
}

template <typename T>
void EncodeKeyframeChunk(const T* values, size_t n, int zstd_level, std::string* out) {
  std::string planes;
  ToPlanes(values, n, &planes);
  ZstdCompress(planes, zstd_level, out);
}

template <typename T>
Status DecodeKeyframeChunk(std::string_view stream, size_t n, T* out) {
  WSYNC_RETURN_IF_ERROR(ZstdCheckFrameSize(stream, n * sizeof(T), "keyframe stream"));
  std::string planes(n * sizeof(T), '\0');
  WSYNC_RETURN_IF_ERROR(ZstdDecompressExact(stream, planes.data(), planes.size(), "keyframe stream"));
  FromPlanes(planes, n, out);
  return Status::Ok();
}

#define WSYNC_INSTANTIATE(T)                                                                        \
  template void DiffChunk<T>(const T*, const T*, size_t, SparseDelta<T>*);                          \
  template void SampleHistogram<T>(const T*, size_t, ExponentField, uint32_t*);                      \
  template ClassSpec ChooseClasses<T>(size_t, const uint32_t*, const SparseDelta<T>&, const T*,      \
                                      const ChunkCodecOptions&);                                    \
  template void RanksByClass<T>(const T*, size_t, const std::vector<uint32_t>&, const ClassSpec&,    \
                                std::vector<uint32_t>*);                                            \
  template EncodedChunk EncodeChunkStaged<T>(size_t, const SparseDelta<T>&, const T*,               \
                                             const ClassSpec&, const uint32_t*, int);               \
  template EncodedChunk EncodeChunk<T>(const T*, size_t, const SparseDelta<T>&,                     \
                                       const ChunkCodecOptions&);                                   \
  template ClassSpec ChooseChunkClasses<T>(const T*, const T*, size_t, const ChunkCodecOptions&);     \
  template EncodedChunk EncodeChunkPair<T>(const T*, const T*, size_t, const ChunkCodecOptions&,     \
                                           const ClassSpec*, const std::function<void(size_t, size_t)>&); \
  template Status DecodeChunkPositions<T>(ChunkMode, uint64_t, std::string_view, std::string_view,  \
                                          size_t, ExponentField, ChunkPositions*, SparseDelta<T>*); \
  template Status ResolveRanks<T>(const T*, size_t, ChunkPositions*);                               \
  template Status DecodeChunkValues<T>(std::string_view, const ChunkPositions&, const T*,           \
                                       SparseDelta<T>*);                                            \
  template Status DecodeChunk<T>(ChunkMode, uint64_t, std::string_view, std::string_view, const T*, \
                                 size_t, ExponentField, SparseDelta<T>*);                           \
  template void ScatterAdd<T>(T*, const SparseDelta<T>&, bool);                                     \
  template void EncodeKeyframeChunk<T>(const T*, size_t, int, std::string*);                        \
  template Status DecodeKeyframeChunk<T>(std::string_view, size_t, T*);

WSYNC_INSTANTIATE(uint8_t)
WSYNC_INSTANTIATE(uint16_t)
WSYNC_INSTANTIATE(uint32_t)
WSYNC_INSTANTIATE(uint64_t)
#undef WSYNC_INSTANTIATE

}  // namespace wsync::codec::internal
