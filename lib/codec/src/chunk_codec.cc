#include "chunk_codec.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <memory>

#include "bytes.h"
#include "range_coder.h"
#include "sweep.h"
#include "zstd_util.h"

namespace wsync::codec::internal {
namespace {

constexpr double kClassPenaltyBits = 48;  // learning cost of one more class
constexpr size_t kMaxDpGroups = 64;

template <typename T>
constexpr int kBits = static_cast<int>(sizeof(T) * 8);

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

// Bits of coding `counts` (summing to `total`) at their own frequencies.
double MixEntropyBits(const double* counts, double total) {
  if (total <= 0) return 0;
  double bits = 0;
  for (int k = 0; k < kMagBuckets; ++k) {
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
  // cost[a * (g + 1) + b]: bits of groups [a, b) as one class.
  std::vector<double> cost_table((g + 1) * (g + 1), 0.0);
  for (size_t a = 0; a < g; ++a) {
    for (size_t b = a + 1; b <= g; ++b) {
      double mix[kMagBuckets];
      double mags = 0;
      for (int k = 0; k < kMagBuckets; ++k) {
        mix[k] = pm[b * kMagBuckets + k] - pm[a * kMagBuckets + k];
        mags += mix[k];
      }
      cost_table[a * (g + 1) + b] = BinaryEntropyBits(pa[b] - pa[a], pc[b] - pc[a]) + MixEntropyBits(mix, mags);
    }
  }
  auto cost = [&](size_t a, size_t b) { return cost_table[a * (g + 1) + b]; };
  const int kmax = static_cast<int>(std::min<size_t>(kMaxClasses, g));
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

// A delta s != 0 (as a signed w-bit number) is coded as its sign, whether
// |s| == 1 (the common case at RL learning rates), and else |s| - 2 as an
// Exp-Golomb code; contexts are per class, the sign's also per old sign.
struct ValueModels {
  BitModel sign[kMaxClasses][2];
  BitModel one[kMaxClasses];
  EGModel mag[kMaxClasses];
};

template <typename T>
int OldSign(const T* old, size_t i, const ClassSpec& spec) {
  return spec.k > 1 ? static_cast<int>((old[i] >> (kBits<T> - 1)) & 1) : 0;
}

template <typename T>
void EncodeValues(const T* old, const SparseDelta<T>& d, const std::vector<uint8_t>& cls,
                  const ClassSpec& spec, std::string* out) {
  auto models = std::make_unique<ValueModels>();
  RangeEncoder enc(out);
  for (size_t i = 0; i < d.pos.size(); ++i) {
    const int c = cls[i];
    const T delta = d.delta[i];
    const int neg = static_cast<int>((delta >> (kBits<T> - 1)) & 1);
    const T mag = neg ? static_cast<T>(T{0} - delta) : delta;
    enc.Encode(models->sign[c][OldSign(old, i, spec)], neg);
    enc.Encode(models->one[c], mag != 1);
    if (mag != 1) enc.EncodeEG(models->mag[c], static_cast<uint64_t>(mag) - 2);
  }
  enc.Finish();
}

template <typename T>
Status DecodeValues(std::string_view stream, const T* old, const std::vector<uint8_t>& cls,
                    const ClassSpec& spec, SparseDelta<T>* out) {
  auto models = std::make_unique<ValueModels>();
  RangeDecoder dec(stream);
  const uint64_t max = (uint64_t{1} << (kBits<T> - 1)) - 2;
  out->delta.resize(out->pos.size());
  for (size_t i = 0; i < out->pos.size(); ++i) {
    const int c = cls[i];
    const int neg = dec.Decode(models->sign[c][OldSign(old, i, spec)]);
    uint64_t u = 0;
    if (dec.Decode(models->one[c])) {
      if (!dec.DecodeEG(models->mag[c], max, &u)) {
        return DataLossError("value stream: delta " + std::to_string(i) + " out of range");
      }
      u += 1;
    }
    const T mag = static_cast<T>(u + 1);
    out->delta[i] = neg ? static_cast<T>(T{0} - mag) : mag;
  }
  if (dec.overrun() > 4 || dec.corrupt()) return DataLossError("value stream: truncated or corrupt");
  return Status::Ok();
}

// Classes of the changes from their old values (all 0 when unconditioned).
template <typename T>
std::vector<uint8_t> ClassesOf(const T* old, size_t m, const ClassSpec& spec) {
  std::vector<uint8_t> cls(m, 0);
  if (spec.k > 1) {
    const std::vector<uint8_t> class_of = ClassTable(spec);
    for (size_t i = 0; i < m; ++i) cls[i] = class_of[spec.Exponent(old[i])];
  }
  return cls;
}

// ----------------------------------------------------------- sparse mode

// Gaps between the ranks of a class's changes are Golomb-Rice coded: the
// quotient gap >> r in unary with adaptive contexts (escaping to Exp-Golomb
// past kUnary), the r low bits at probability 1/2. r is chosen per class
// from the mean gap, so a class changing with probability p costs close to
// H(p) per element.
constexpr int kUnary = 16;
constexpr int kMaxRice = 31;

struct SparseModels {
  EGModel count;
  BitModel quotient[kMaxClasses][kUnary];
  EGModel escape[kMaxClasses];
};

int RiceParameter(uint64_t gap_sum, uint64_t count) {
  if (count == 0) return 0;
  // Golomb's optimal divisor for a geometric source is about 0.69 * mean.
  const double m = 0.69 * static_cast<double>(gap_sum) / static_cast<double>(count);
  int r = 0;
  while (r < kMaxRice && static_cast<double>(uint64_t{2} << r) <= m) ++r;
  return r;
}

// Per-class ranks of the changed positions, by sweeping the class masks of
// every block.
template <typename T>
void RanksByClassImpl(const T* base, size_t n, const std::vector<uint32_t>& pos, const ClassSpec& spec,
                      std::vector<uint8_t>* cls, std::vector<uint32_t>* rank) {
  cls->assign(pos.size(), 0);
  rank->assign(pos.size(), 0);
  if (spec.k == 1) {
    std::copy(pos.begin(), pos.end(), rank->begin());
    return;
  }
  // Running counts: total elements, and elements reaching each threshold.
  // A class's count before position j is the difference of neighbours.
  const ClassScanner<T> scan(spec);
  const int k = spec.k;
  uint32_t total = 0;
  uint32_t reach[kMaxClasses - 1] = {};
  uint32_t ge[kMaxClasses - 1] = {};
  size_t i = 0;
  const size_t blocks = (n + kBlock - 1) / kBlock;
  for (size_t b = 0; b < blocks && i < pos.size(); ++b) {
    const uint32_t valid = scan.BlockGe(base, n, b, ge);
    const size_t end = (b + 1) * kBlock;
    for (; i < pos.size() && pos[i] < end; ++i) {
      const int j = static_cast<int>(pos[i] - b * kBlock);
      const uint32_t below = (1u << j) - 1;
      const int c = ClassAt(ge, k, j);
      const uint32_t upper = c == 0 ? total + std::popcount(valid & below) : reach[c - 1] + std::popcount(ge[c - 1] & below);
      const uint32_t lower = c == k - 1 ? 0u : reach[c] + std::popcount(ge[c] & below);
      (*cls)[i] = static_cast<uint8_t>(c);
      (*rank)[i] = upper - lower;
    }
    total += static_cast<uint32_t>(std::popcount(valid));
    for (int t = 0; t < k - 1; ++t) reach[t] += static_cast<uint32_t>(std::popcount(ge[t]));
  }
}

void EncodeSparsePositions(const std::vector<uint8_t>& cls, const uint32_t* rank, const ClassSpec& spec,
                           std::string* out) {
  WriteClassHeader(spec, out);
  // The gaps bucketed by class (a counting sort: class after class, each
  // in position order).
  size_t count[kMaxClasses] = {};
  for (uint8_t c : cls) ++count[c];
  size_t start[kMaxClasses + 1] = {};
  for (int c = 0; c < kMaxClasses; ++c) start[c + 1] = start[c] + count[c];
  std::vector<uint32_t> gaps(cls.size());
  size_t fill[kMaxClasses];
  std::copy(start, start + kMaxClasses, fill);
  uint32_t next[kMaxClasses] = {};
  uint64_t sum[kMaxClasses] = {};
  for (size_t i = 0; i < cls.size(); ++i) {
    const int c = cls[i];
    const uint32_t g = rank[i] - next[c];
    gaps[fill[c]++] = g;
    sum[c] += g;
    next[c] = rank[i] + 1;
  }
  int rice[kMaxClasses];
  for (int c = 0; c < spec.k; ++c) {
    rice[c] = RiceParameter(sum[c], count[c]);
    out->push_back(static_cast<char>(rice[c]));
  }
  auto models = std::make_unique<SparseModels>();
  RangeEncoder enc(out);
  for (int c = 0; c < spec.k; ++c) enc.EncodeEG(models->count, count[c]);
  for (int c = 0; c < spec.k; ++c) {
    const int r = rice[c];
    BitModel* q = models->quotient[c];
    for (size_t gi = start[c]; gi < start[c + 1]; ++gi) {
      const uint32_t g = gaps[gi];
      const uint32_t quotient = g >> r;
      const uint32_t unary = quotient < kUnary ? quotient : kUnary;
      for (uint32_t j = 0; j < unary; ++j) enc.Encode(q[j], 1);
      if (quotient < kUnary) {
        enc.Encode(q[quotient], 0);
      } else {
        enc.EncodeEG(models->escape[c], quotient - kUnary);
      }
      if (r > 0) enc.EncodeDirect(g, r);
    }
  }
  enc.Finish();
}

// Decodes the per-class ranks of a sparse chunk; positions follow from
// them alone when k == 1, else from the base (ResolveRanks).
Status DecodeSparseRanks(std::string_view coded, size_t n, uint64_t changed, ChunkPositions* out) {
  const ClassSpec& spec = out->spec;
  if (coded.size() < static_cast<size_t>(spec.k)) return DataLossError("position stream: truncated Rice parameters");
  int rice[kMaxClasses];
  for (int c = 0; c < spec.k; ++c) {
    rice[c] = static_cast<uint8_t>(coded[c]);
    if (rice[c] > kMaxRice) return DataLossError("position stream: Rice parameter " + std::to_string(rice[c]));
  }
  coded.remove_prefix(spec.k);
  auto models = std::make_unique<SparseModels>();
  RangeDecoder dec(coded);
  uint64_t counts[kMaxClasses];
  uint64_t sum = 0;
  for (int c = 0; c < spec.k; ++c) {
    if (!dec.DecodeEG(models->count, changed - sum, &counts[c])) {
      return DataLossError("position stream: class " + std::to_string(c) + " count exceeds the " +
                           std::to_string(changed) + " changed elements");
    }
    sum += counts[c];
  }
  if (sum != changed) {
    return DataLossError("position stream: class counts sum to " + std::to_string(sum) +
                         ", directory says " + std::to_string(changed));
  }
  // Target ranks per class, ascending.
  out->class_counts.assign(counts, counts + spec.k);
  out->ranks.resize(changed);
  uint32_t* rank_out = out->ranks.data();
  for (int c = 0; c < spec.k; ++c) {
    uint64_t next = 0;
    const int r = rice[c];
    BitModel* q = models->quotient[c];
    for (uint64_t i = 0; i < counts[c]; ++i) {
      uint64_t quotient = 0;
      while (quotient < kUnary && dec.Decode(q[quotient])) ++quotient;
      uint64_t escaped = 0;
      const bool escape_ok = quotient < kUnary || dec.DecodeEG(models->escape[c], n >> r, &escaped);
      quotient += escaped;
      const uint64_t gap = (quotient << r) | (r > 0 ? dec.DecodeDirect(r) : 0);
      if (!escape_ok || next >= n || gap > n - 1 - next) {
        return DataLossError("position stream: class " + std::to_string(c) + " gap " +
                             std::to_string(i) + " overruns the chunk of " + std::to_string(n) +
                             " elements");
      }
      *rank_out++ = static_cast<uint32_t>(next + gap);
      next = next + gap + 1;
    }
  }
  if (dec.overrun() > 4 || dec.corrupt()) return DataLossError("position stream: truncated or corrupt");

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
  // Four interleaved histograms: runs of equal exponents (the common case)
  // would otherwise wait on each other's increments.
  const size_t bins = size_t{exponent.mask} + 1;
  std::vector<uint32_t> part(4 * bins, 0);
  const size_t blocks = n / kBlock;
  for (size_t b = 0; b < blocks; b += kSampleStride) {
    const T* x = base + b * kBlock;
    for (int j = 0; j < kBlock; j += 4) {
      ++part[spec.Exponent(x[j])];
      ++part[bins + spec.Exponent(x[j + 1])];
      ++part[2 * bins + spec.Exponent(x[j + 2])];
      ++part[3 * bins + spec.Exponent(x[j + 3])];
    }
  }
  for (size_t e = 0; e < bins; ++e) hist[e] = part[e] + part[bins + e] + part[2 * bins + e] + part[3 * bins + e];
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
  std::vector<uint8_t> cls;
  RanksByClassImpl(base, n, pos, spec, &cls, rank);
}

template <typename T>
EncodedChunk EncodeChunkStaged(size_t n, const SparseDelta<T>& d, const T* old, const ClassSpec& spec,
                               const uint32_t* rank, int zstd_level) {
  EncodedChunk best;
  const size_t m = d.pos.size();
  best.changed = m;
  if (m == 0) return best;

  const size_t runs = CountRuns(d.pos);
  const bool try_sparse = m * 2 <= n;
  const bool try_runs = runs * 4 <= m || !try_sparse;
  const bool try_bitmap = m * 32 > n;
  const bool try_dense = m * 4 > n;

  auto consider = [&](ChunkMode mode, std::string pos, const std::string& val) {
    if (best.mode == ChunkMode::kEmpty || pos.size() + val.size() < best.pos.size() + best.val.size()) {
      best.mode = mode;
      best.pos = std::move(pos);
      best.val = val;
    }
  };

  const std::vector<uint8_t> cls = ClassesOf(old, m, spec);
  std::string val;
  EncodeValues(old, d, cls, spec, &val);
  if (try_sparse) {
    std::string pos;
    EncodeSparsePositions(cls, spec.k > 1 ? rank : d.pos.data(), spec, &pos);
    consider(ChunkMode::kSparse, std::move(pos), val);
  }
  if (try_runs) {
    std::string pos;
    EncodeRunPositions(d.pos, spec, &pos);
    consider(ChunkMode::kRuns, std::move(pos), val);
  }
  if (try_bitmap) {
    std::string pos;
    EncodeBitmapPositions(d.pos, n, spec, zstd_level, &pos);
    consider(ChunkMode::kBitmap, std::move(pos), val);
  }
  if (try_dense) {
    std::string pos;
    EncodeDense(d, n, zstd_level, &pos);
    consider(ChunkMode::kDense, std::move(pos), std::string());
  }
  return best;
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
EncodedChunk EncodeChunkPair(const T* base, const T* target, size_t n, const ChunkCodecOptions& options,
                             const std::function<void(size_t, size_t)>& segment_done) {
  ClassSpec spec = ChooseClasses<T>(n, nullptr, SparseDelta<T>{}, nullptr, options);  // unconditioned
  if (options.condition && options.exponent.mask != 0) {
    SparseDelta<T> evidence;
    std::vector<T> old;
    if (ClassesFromSampledChanges(n)) {
      SampleChanges(base, target, n, &evidence, &old);
    } else {
      // A small chunk (in cache): every change, then the sweep below.
      DiffChunk(base, target, n, &evidence);
      old = GatherAt(base, evidence.pos);
    }
    spec = ChooseClassesOnBase(base, n, evidence, old.data(), options);
  }
  ChunkSweep<T> sweep;
  SweepChunk(base, target, n, spec, &sweep, segment_done);
  if (sweep.d.pos.empty()) return EncodedChunk{};
  return EncodeChunkStaged(n, sweep.d, spec.k > 1 ? sweep.old.data() : nullptr, spec, sweep.rank.data(),
                           options.zstd_level);
}

template <typename T>
Status DecodeChunkPositions(ChunkMode mode, uint64_t changed, std::string_view pos, std::string_view val,
                            size_t n, ExponentField exponent, ChunkPositions* cp, SparseDelta<T>* out) {
  *cp = ChunkPositions{};
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
  return DecodeValues(val, old, ClassesOf(old, cp.pos.size(), cp.spec), cp.spec, out);
}

template <typename T>
Status DecodeChunk(ChunkMode mode, uint64_t changed, std::string_view pos, std::string_view val,
                   const T* base, size_t n, ExponentField exponent, SparseDelta<T>* out) {
  ChunkPositions cp;
  WSYNC_RETURN_IF_ERROR(DecodeChunkPositions(mode, changed, pos, val, n, exponent, &cp, out));
  if (!cp.values_pending) return Status::Ok();
  std::vector<T> old;
  if (cp.spec.k > 1) {
    if (base == nullptr) {
      return FailedPreconditionError("chunk is coded relative to the base's exponents; the base is needed");
    }
    WSYNC_RETURN_IF_ERROR(ResolveRanks(base, n, &cp));
    old = GatherAt(base, cp.pos);
  }
  return DecodeChunkValues(val, cp, old.empty() ? nullptr : old.data(), out);
}

bool ChunkNeedsBase(ChunkMode mode, std::string_view pos) {
  if (mode != ChunkMode::kSparse && mode != ChunkMode::kRuns && mode != ChunkMode::kBitmap) return false;
  return !pos.empty() && static_cast<uint8_t>(pos[0]) > 1;
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
  template EncodedChunk EncodeChunkPair<T>(const T*, const T*, size_t, const ChunkCodecOptions&,     \
                                           const std::function<void(size_t, size_t)>&);             \
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
