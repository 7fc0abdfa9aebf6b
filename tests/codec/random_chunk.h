// Random chunks for the tests of the sparse coding agents: what a chunk's
// change looks like to the chunk coder, at any width and density.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "chunk_codec.h"

namespace wsync::codec::internal {

// A random chunk of n elements of width sizeof(T): base values spread over
// the exponent range (so that classes form), changes at `density` whose
// probability falls with the exponent, mostly unit deltas, some large; with
// `runs`, changes tend to follow each other (runs of neighbours).
template <typename T>
void RandomChunk(size_t n, double density, bool runs, ExponentField ef, std::mt19937_64& rng, std::vector<T>* base,
                 SparseDelta<T>* d) {
  base->resize(n);
  d->Clear();
  std::uniform_real_distribution<double> u(0, 1);
  for (size_t p = 0; p < n; ++p) {
    (*base)[p] = static_cast<T>(rng());
    const double e = ef.mask == 0 ? 0.5 : static_cast<double>(((*base)[p] >> ef.shift) & ef.mask) / ef.mask;
    const bool after = runs && !d->pos.empty() && d->pos.back() + 1 == p && u(rng) < 0.7;
    if (!after && u(rng) >= density * 2 * (1 - e)) continue;
    T delta = static_cast<T>(1 + rng() % 3);
    if (rng() % 16 == 0) delta = static_cast<T>(rng());
    if (rng() % 64 == 0) delta = static_cast<T>(7 + rng() % 12);
    if (delta == 0) delta = 1;
    if (rng() % 2) delta = static_cast<T>(T{0} - delta);
    d->pos.push_back(static_cast<uint32_t>(p));
    d->delta.push_back(delta);
  }
}

// check(T{}, dtype, seed) for a dtype of every width, two more of 16 bits.
template <typename F>
void ForEachCodedDType(F&& check) {
  check(uint16_t{}, DType::kBF16, 1);
  check(uint16_t{}, DType::kF16, 2);
  check(uint16_t{}, DType::kI16, 3);
  check(uint32_t{}, DType::kF32, 4);
  check(uint8_t{}, DType::kF8E4M3, 5);
  check(uint64_t{}, DType::kF64, 6);
}

}  // namespace wsync::codec::internal
