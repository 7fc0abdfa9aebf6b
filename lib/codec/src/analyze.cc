// Empirical entropy bounds of a change (what a patch is measured against).
#include <cmath>
#include <unordered_map>
#include <vector>

#include "wsync/codec/codec.h"
#include "wsync/util/text.h"

namespace wsync::codec {
namespace {

double H(double n, double m) {
  if (m <= 0 || m >= n) return 0;
  double p = m / n;
  return -n * (p * std::log2(p) + (1 - p) * std::log2(1 - p));
}

double EntropyBits(const std::unordered_map<uint64_t, uint64_t>& counts) {
  uint64_t m = 0;
  for (const auto& kv : counts) m += kv.second;
  double bits = 0;
  for (const auto& kv : counts) {
    bits -= static_cast<double>(kv.second) * std::log2(static_cast<double>(kv.second) / static_cast<double>(m));
  }
  return bits;
}

// Delta counts per base exponent (exact for every width).
using DeltaCounts = std::unordered_map<uint64_t, std::unordered_map<uint64_t, uint64_t>>;

template <typename T>
void Accumulate(const T* base, const T* target, uint64_t n, ExponentField ef, DiffStats* s,
                std::unordered_map<uint64_t, uint64_t>* deltas, DeltaCounts* by_exponent) {
  std::vector<uint64_t> all(size_t{ef.mask} + 1, 0), chg(size_t{ef.mask} + 1, 0);
  uint64_t m = 0;
  for (uint64_t i = 0; i < n; ++i) {
    const size_t e = (static_cast<uint64_t>(base[i]) >> ef.shift) & ef.mask;
    ++all[e];
    if (base[i] != target[i]) {
      ++m;
      ++chg[e];
      const uint64_t d = static_cast<T>(target[i] - base[i]);
      ++(*deltas)[d];
      ++(*by_exponent)[e][d];
    }
  }
  s->elements += n;
  s->changed += m;
  s->dense_bytes += n * sizeof(T);
  s->position_bits_order0 += H(static_cast<double>(n), static_cast<double>(m));
  for (size_t e = 0; e < all.size(); ++e) {
    s->position_bits_conditional += H(static_cast<double>(all[e]), static_cast<double>(chg[e]));
  }
}

}  // namespace

StatusOr<DiffStats> AnalyzeDiff(std::span<const TensorView> base, std::span<const TensorView> target) {
  if (base.size() != target.size()) return InvalidArgumentError("base and target differ in tensor count");
  DiffStats stats;
  for (size_t i = 0; i < base.size(); ++i) {
    const TensorView& b = base[i];
    const TensorView& t = target[i];
    if (b.name != t.name || b.dtype != t.dtype || b.shape != t.shape) {
      return InvalidArgumentError("tensor " + std::to_string(i) + " (" + Quoted(b.name) + ") differs in name, dtype or shape");
    }
    // Deltas are counted per tensor: the value entropy is a per-tensor sum.
    std::unordered_map<uint64_t, uint64_t> deltas;
    DeltaCounts by_exponent;
    const uint64_t n = b.NumElements();
    const ExponentField ef = ExponentFieldOf(b.dtype);
    switch (DTypeWidth(b.dtype)) {
      case 1: Accumulate(b.data, t.data, n, ef, &stats, &deltas, &by_exponent); break;
      case 2: Accumulate(reinterpret_cast<const uint16_t*>(b.data), reinterpret_cast<const uint16_t*>(t.data), n, ef, &stats, &deltas, &by_exponent); break;
      case 4: Accumulate(reinterpret_cast<const uint32_t*>(b.data), reinterpret_cast<const uint32_t*>(t.data), n, ef, &stats, &deltas, &by_exponent); break;
      default: Accumulate(reinterpret_cast<const uint64_t*>(b.data), reinterpret_cast<const uint64_t*>(t.data), n, ef, &stats, &deltas, &by_exponent); break;
    }
    stats.value_bits_order0 += EntropyBits(deltas);
    for (const auto& kv : by_exponent) stats.value_bits_conditional += EntropyBits(kv.second);
  }
  return stats;
}

}  // namespace wsync::codec
