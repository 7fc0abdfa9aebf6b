// Classes (docs/patch-format.md "Classes"): the encoder's choice of exponent
// thresholds and the class header.
#include "chunk_coders.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace wsync::codec::internal {
namespace {

constexpr double kClassPenaltyBits = 48;  // learning cost of one more class
constexpr size_t kMaxDpGroups = 64;


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

}  // namespace

void WriteClassHeader(const ClassSpec& spec, std::string* out) {
  ByteWriter w(out);
  w.U8(static_cast<uint8_t>(spec.k));
  for (int t = 0; t < spec.k - 1; ++t) w.Varint(spec.thr[t]);
}

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


template <typename T>
ClassSpec ChooseClasses(size_t n, const uint32_t* sample_hist, const SparseDelta<T>& d, const T* old,
                        const ChunkCodecOptions& options) {
  return ChooseClassesImpl(n, sample_hist, d, old, options);
}

#define WSYNC_INSTANTIATE(T) \
  template ClassSpec ChooseClasses<T>(size_t, const uint32_t*, const SparseDelta<T>&, const T*, const ChunkCodecOptions&);

WSYNC_FOR_EACH_WIDTH(WSYNC_INSTANTIATE)
#undef WSYNC_INSTANTIATE

}  // namespace wsync::codec::internal
