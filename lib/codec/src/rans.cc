#include "rans.h"

#include <cmath>

#include "wsync/util/bytes.h"

namespace wsync::codec::internal {
namespace {

// log2(f) for f in [0, 2^10] (entry 0 unused).
const std::array<double, kRansScale + 1>& Log2Table() {
  static const std::array<double, kRansScale + 1> table = [] {
    std::array<double, kRansScale + 1> t{};
    for (uint32_t f = 1; f <= kRansScale; ++f) t[f] = std::log2(static_cast<double>(f));
    return t;
  }();
  return table;
}

// What every precision's normalization starts from: q10[s] = floor(c_s
// 2^10 / total), from which floor(c_s 2^p / total) = q10[s] >> (10 - p)
// (nested floor division), so the divisions are done once per table.
struct Shares {
  uint64_t q10[kRansSymbols] = {};
  int present = 0;
  int largest = -1;  // the most frequent symbol (the first, on a tie)
};

Shares SharesOf(const uint32_t* counts) {
  Shares sh;
  uint64_t total = 0;
  for (int s = 0; s < kRansSymbols; ++s) {
    total += counts[s];
    sh.present += counts[s] > 0;
    if (counts[s] > 0 && (sh.largest < 0 || counts[s] > counts[sh.largest])) sh.largest = s;
  }
  if (total == 0) return sh;
  for (int s = 0; s < kRansSymbols; ++s) sh.q10[s] = (uint64_t{counts[s]} << kRansPrecision) / total;
  return sh;
}

// Frequencies at precision p (summing to 2^p, every present symbol >= 1,
// the largest taking the rounding); false when p cannot hold them.
bool Normalize(const uint32_t* counts, const Shares& sh, int p, uint32_t* freq) {
  const uint64_t scale = uint64_t{1} << p;
  if (sh.present == 0 || scale < static_cast<uint64_t>(sh.present)) return false;
  int64_t sum = 0;
  for (int s = 0; s < kRansSymbols; ++s) {
    freq[s] = counts[s] == 0 ? 0 : static_cast<uint32_t>(std::max<uint64_t>(1, sh.q10[s] >> (kRansPrecision - p)));
    sum += freq[s];
  }
  const int64_t fixed = static_cast<int64_t>(freq[sh.largest]) + static_cast<int64_t>(scale) - sum;
  if (fixed < 1) return false;
  freq[sh.largest] = static_cast<uint32_t>(fixed);
  return true;
}

double HeaderBits(const uint32_t* freq) {
  double bits = 4 + kRansSymbols;
  int last = -1;
  for (int s = 0; s < kRansSymbols; ++s) {
    if (freq[s] > 0) last = s;
  }
  for (int s = 0; s < last; ++s) {
    if (freq[s] > 0) bits += GammaBits(freq[s] - 1);
  }
  return bits;
}

// The best precision for these counts and its cost; -1 if all are zero.
int BestPrecision(const uint32_t* counts, const Shares& sh, double* cost) {
  const auto& lg = Log2Table();
  int best = -1;
  double best_cost = 0;
  for (int p = 0; p <= kRansPrecision; ++p) {
    uint32_t freq[kRansSymbols];
    if (!Normalize(counts, sh, p, freq)) continue;
    double bits = HeaderBits(freq);
    for (int s = 0; s < kRansSymbols; ++s) {
      if (counts[s] > 0) bits += counts[s] * (p - lg[freq[s]]);
    }
    if (best < 0 || bits < best_cost) {
      best = p;
      best_cost = bits;
    }
  }
  *cost = best < 0 ? 0 : best_cost;
  return best;
}

RansTable Scaled(const uint32_t* freq, int p) {
  RansTable t;
  uint32_t start = 0;
  for (int s = 0; s < kRansSymbols; ++s) {
    t.freq[s] = static_cast<uint16_t>(freq[s] << (kRansPrecision - p));
    t.start[s] = static_cast<uint16_t>(start);
    if (t.freq[s] > 0) {
      const uint64_t f = t.freq[s];
      t.enc[s] = {((uint64_t{1} << 63) + f - 1) / f, t.freq[s], start, kRansScale - t.freq[s]};
    }
    start += t.freq[s];
  }
  return t;
}

}  // namespace

double RansCostBits(const uint32_t* counts) {
  double cost;
  BestPrecision(counts, SharesOf(counts), &cost);
  return cost;
}

RansTable ChooseRansTable(const uint32_t* counts, BitWriter* w) {
  double cost;
  const Shares sh = SharesOf(counts);
  const int p = BestPrecision(counts, sh, &cost);
  uint32_t freq[kRansSymbols];
  Normalize(counts, sh, p, freq);
  w->Put(static_cast<uint64_t>(p), 4);
  uint32_t mask = 0;
  int last = -1;
  for (int s = 0; s < kRansSymbols; ++s) {
    if (freq[s] > 0) {
      mask |= 1u << s;
      last = s;
    }
  }
  w->Put(mask, kRansSymbols);
  for (int s = 0; s < last; ++s) {
    if (freq[s] > 0) w->PutGamma(freq[s] - 1);
  }
  return Scaled(freq, p);
}

void RansEncoder::Finish(std::string* out) {
  const size_t count = words_.size() + 4;
  ByteWriter(out).Varint(count);
  const size_t at = out->size();
  out->resize(at + 2 * count);
  char* w = out->data() + at;
  auto word = [&](uint32_t v) {
    w[0] = static_cast<char>(v & 0xFF);
    w[1] = static_cast<char>((v >> 8) & 0xFF);
    w += 2;
  };
  word(state_[0] >> 16);
  word(state_[0] & 0xFFFF);
  word(state_[1] >> 16);
  word(state_[1] & 0xFFFF);
  for (size_t i = words_.size(); i-- > 0;) word(words_[i]);
}

}  // namespace wsync::codec::internal
