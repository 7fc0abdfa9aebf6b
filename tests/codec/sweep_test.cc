// The host codec's fused sweeps against brute-force references: the encode
// sweep (diff, old values, class ranks, segments; the staged encoder's ranks
// of given positions agree), rank resolution (ranks back to positions,
// ranks beyond their class), the class-mask kernels
// (hostile thresholds included) and the streaming block digest.
#include "sweep.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <utility>
#include <vector>

#include "block_hasher.h"
#include "wsync/codec/checksum.h"

namespace wsync::codec::internal {
namespace {

// A spec over the exponent field of T's float of the same width (the
// integer widths use a made-up field), with k classes and random ascending
// thresholds; threshold 0 now and then.
template <typename T>
ClassSpec RandomSpec(int k, std::mt19937_64& rng) {
  ClassSpec spec;
  if constexpr (sizeof(T) == 2) {
    spec.shift = 7;
    spec.mask = 0xFF;
  } else if constexpr (sizeof(T) == 4) {
    spec.shift = 23;
    spec.mask = 0xFF;
  } else {
    spec.shift = 3;
    spec.mask = 0xF;
  }
  spec.k = k;
  std::vector<int> thr;
  while (static_cast<int>(thr.size()) < k - 1) {
    const int t = rng() % 5 == 0 ? 0 : static_cast<int>(rng() % (spec.mask + 1));
    if (std::find(thr.begin(), thr.end(), t) == thr.end()) thr.push_back(t);
  }
  std::sort(thr.begin(), thr.end());
  for (int t = 0; t < k - 1; ++t) spec.thr[t] = static_cast<uint16_t>(thr[t]);
  return spec;
}

// Values whose exponents crowd around the thresholds' range, and a target
// that differs from them at the given density.
template <typename T>
void RandomPair(size_t n, double density, std::mt19937_64& rng, std::vector<T>* base, std::vector<T>* target) {
  base->resize(n);
  target->resize(n);
  std::bernoulli_distribution change(density);
  for (size_t i = 0; i < n; ++i) {
    (*base)[i] = static_cast<T>(rng());
    T t = (*base)[i];
    if (change(rng)) t = static_cast<T>(t + 1 + rng() % 7);
    (*target)[i] = t;
  }
}

template <typename T>
void CheckSweep(size_t n, double density, int k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<T> base, target;
  RandomPair(n, density, rng, &base, &target);
  const ClassSpec spec = RandomSpec<T>(k, rng);
  ChunkSweep<T> got;
  size_t next_segment = 0;
  SweepChunk(base.data(), target.data(), n, spec, &got, [&](size_t begin, size_t len) {
    ASSERT_EQ(begin, next_segment);
    ASSERT_GT(len, 0u);
    next_segment = begin + len;
  });
  EXPECT_EQ(next_segment, n);

  // Per element: the changes in order, each with its class, and each
  // class's ranks (its changes' ranks among its elements) in order.
  std::vector<uint32_t> seen(k, 0);
  std::vector<std::vector<uint32_t>> by_class(k);
  size_t m = 0;
  for (size_t i = 0; i < n; ++i) {
    const int c = spec.ClassOf(base[i]);
    if (base[i] != target[i]) {
      ASSERT_LT(m, got.d.pos.size()) << "n " << n << " change at " << i << " missing";
      ASSERT_EQ(got.d.pos[m], i);
      ASSERT_EQ(got.d.delta[m], static_cast<T>(target[i] - base[i]));
      if (k > 1) {
        ASSERT_EQ(got.cls[m], c) << "n " << n << " k " << k << " position " << i;
      }
      by_class[c].push_back(seen[c]);
      ++m;
    }
    ++seen[c];
  }
  EXPECT_EQ(got.d.pos.size(), m);
  EXPECT_EQ(got.d.delta.size(), m);
  for (int c = 0; c < kMaxClasses; ++c) {
    if (k > 1 && c < k) {
      EXPECT_EQ(got.rank[c], by_class[c]) << "n " << n << " k " << k << " class " << c;
    } else {
      EXPECT_TRUE(got.rank[c].empty()) << "class " << c;
    }
  }
  if (k == 1) {
    EXPECT_TRUE(got.cls.empty());
  }

  if (k > 1) {
    // The staged encoder's ranks (positions given) are the sweep's.
    std::vector<uint32_t> ranks_given;
    RanksByClass(base.data(), n, got.d.pos, spec, &ranks_given);
    std::vector<std::vector<uint32_t>> given_by_class(k);
    for (size_t i = 0; i < m; ++i) given_by_class[got.cls[i]].push_back(ranks_given[i]);
    EXPECT_EQ(given_by_class, by_class);

    // The ranks back to positions, class after class.
    std::vector<const uint32_t*> ranks(k);
    std::vector<uint64_t> counts(k);
    for (int c = 0; c < k; ++c) {
      ranks[c] = got.rank[c].data();
      counts[c] = got.rank[c].size();
    }
    std::vector<uint32_t> pos(m + 2);
    std::vector<uint64_t> done(k);
    const size_t found = ResolveRankSweep(base.data(), n, spec, ranks.data(), counts.data(), pos.data(), done.data());
    ASSERT_EQ(found, m);
    pos.resize(m);
    EXPECT_EQ(pos, got.d.pos);
  }
}

// Every test of this suite runs on both vector paths: the baseline, and
// AVX-512 where the host has it (skipped elsewhere).
class SweepOnPath : public testing::TestWithParam<SimdPath> {
 protected:
  void SetUp() override {
    if (GetParam() == SimdPath::kAvx512 && !HostHasAvx512()) GTEST_SKIP() << "this CPU has no AVX-512 (F, BW)";
    before_ = SetSimdPathForTesting(GetParam());
  }
  void TearDown() override { SetSimdPathForTesting(before_); }

 private:
  SimdPath before_ = SimdPath::kBaseline;
};

INSTANTIATE_TEST_SUITE_P(Paths, SweepOnPath, testing::Values(SimdPath::kBaseline, SimdPath::kAvx512),
                         [](const testing::TestParamInfo<SimdPath>& info) {
                           return info.param == SimdPath::kAvx512 ? "Avx512" : "Baseline";
                         });

TEST_P(SweepOnPath, MatchesBruteForceOverSizesDensitiesAndClassCounts) {
  uint64_t seed = 1;
  for (size_t n : {size_t{0}, size_t{1}, size_t{31}, size_t{32}, size_t{33}, size_t{63}, size_t{64}, size_t{65},
                   size_t{1000}, kSweepSegment - 1, kSweepSegment, kSweepSegment + 1, 2 * kSweepSegment + 77}) {
    for (double density : {0.0, 1e-3, 0.02, 0.5, 1.0}) {
      for (int k = 1; k <= kMaxClasses; ++k) {
        SCOPED_TRACE("n " + std::to_string(n) + " density " + std::to_string(density) + " k " + std::to_string(k));
        CheckSweep<uint16_t>(n, density, k, seed++);
        CheckSweep<uint8_t>(n, density, std::min(k, 4), seed++);
        CheckSweep<uint32_t>(n, density, k, seed++);
      }
    }
  }
}

// The word masks against the portable per-element logic, at every length
// of a last partial word, for BF16's and FP16's exponent fields, with
// exponents crowding the thresholds (0 and the field's maximum included).
template <int K>
void CheckWordMasks(std::mt19937_64& rng) {
  for (const auto& [shift, mask] : {std::pair{7, 0xFF}, std::pair{10, 0x1F}}) {
    ClassSpec spec;
    spec.k = K;
    spec.shift = static_cast<uint8_t>(shift);
    spec.mask = static_cast<uint16_t>(mask);
    std::vector<int> thr;
    while (static_cast<int>(thr.size()) < K - 1) {
      const int t = rng() % 4 == 0 ? (rng() % 2 == 0 ? 0 : mask) : static_cast<int>(rng() % (mask + 1));
      if (std::find(thr.begin(), thr.end(), t) == thr.end()) thr.push_back(t);
    }
    std::sort(thr.begin(), thr.end());
    for (int t = 0; t < K - 1; ++t) spec.thr[t] = static_cast<uint16_t>(thr[t]);
    const WordMasker<uint16_t> masker(spec);
    for (size_t len : {size_t{1}, size_t{31}, size_t{32}, size_t{33}, size_t{63}, size_t{64}, size_t{65}, size_t{640},
                       size_t{700}}) {
      std::vector<uint16_t> x(len), y(len);
      for (size_t i = 0; i < len; ++i) {
        const int e = K > 1 ? (spec.thr[rng() % (K - 1)] + static_cast<int>(rng() % 3) - 1) & mask : 0;
        x[i] = static_cast<uint16_t>((rng() & ~(mask << shift)) | (e << shift));
        y[i] = rng() % 3 == 0 ? static_cast<uint16_t>(rng()) : x[i];
      }
      const size_t words = (len + kWord - 1) / kWord;
      std::vector<uint64_t> ne(words, ~uint64_t{0});
      std::vector<WordGe> ge(words);
      masker.Run<K, true>(x.data(), y.data(), len, ne.data(), ge.data());
      for (size_t w = 0; w < words; ++w) {
        uint64_t want_ne = 0;
        uint64_t want_ge[kMaxClasses - 1] = {};
        for (size_t j = 0; j < kWord && w * kWord + j < len; ++j) {
          const size_t i = w * kWord + j;
          want_ne |= uint64_t{x[i] != y[i]} << j;
          for (int t = 0; t < K - 1; ++t) want_ge[t] |= uint64_t{spec.Exponent(x[i]) >= spec.thr[t]} << j;
        }
        ASSERT_EQ(ne[w], want_ne) << "len " << len << " word " << w;
        for (int t = 0; t < K - 1; ++t) {
          ASSERT_EQ(ge[w][t], want_ge[t]) << "len " << len << " word " << w << " threshold " << spec.thr[t];
        }
      }
    }
  }
}

TEST_P(SweepOnPath, WordMasksMatchPortableLogic) {
  std::mt19937_64 rng(13);
  for (int trial = 0; trial < 50; ++trial) {
    CheckWordMasks<1>(rng);
    CheckWordMasks<2>(rng);
    CheckWordMasks<5>(rng);
    CheckWordMasks<8>(rng);
  }
}

TEST_P(SweepOnPath, RankBeyondItsClassIsReported) {
  std::mt19937_64 rng(7);
  std::vector<uint16_t> base, target;
  RandomPair<uint16_t>(5000, 0.05, rng, &base, &target);
  ClassSpec spec = RandomSpec<uint16_t>(3, rng);
  spec.thr[0] = 100;
  spec.thr[1] = 150;
  size_t size[3] = {};
  for (uint16_t x : base) ++size[spec.ClassOf(x)];
  // Class 1: its first rank is fine, its second one past its last member.
  std::vector<uint32_t> r1 = {0, static_cast<uint32_t>(size[1])};
  const uint32_t* ranks[3] = {nullptr, r1.data(), nullptr};
  const uint64_t counts[3] = {0, 2, 0};
  std::vector<uint32_t> pos(4);
  uint64_t done[3];
  const size_t found = ResolveRankSweep(base.data(), base.size(), spec, ranks, counts, pos.data(), done);
  EXPECT_EQ(found, 1u);
  EXPECT_EQ(done[1], 1u);
}

// The bit deposit the rank resolution uses, against its definition (and
// both forms, where the host has pdep).
TEST(Sweep, DepositBitsMatchesDefinition) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 20000; ++trial) {
    uint64_t m = rng(), v = rng();
    if (trial % 4 == 1) m &= rng() & rng();   // sparse masks
    if (trial % 4 == 2) m |= rng() | rng();   // dense ones
    if (trial % 16 == 3) m = trial % 32 == 3 ? 0 : ~uint64_t{0};
    uint64_t want = 0;
    int taken = 0;
    for (int j = 0; j < 64; ++j) {
      if ((m >> j) & 1) want |= ((v >> taken++) & 1) << j;
    }
    ASSERT_EQ(DepositBitsPortable(v, m), want) << "m " << m << " v " << v;
    ASSERT_EQ(DepositBits(v, m, true), want);
    ASSERT_EQ(DepositBits(v, m, false), want);
  }
}

TEST(Sweep, ClassMaskKernelMatchesPortableLogic) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 2000; ++trial) {
    const ClassSpec spec = RandomSpec<uint16_t>(2 + trial % (kMaxClasses - 1), rng);
    uint16_t x[kBlock];
    for (auto& v : x) v = static_cast<uint16_t>(rng());
    if (trial % 3 == 0) {
      for (auto& v : x) v = static_cast<uint16_t>((v & 0x807F) | ((spec.thr[trial % (spec.k - 1)] + rng() % 3 - 1) & 0xFF) << 7);
    }
    uint32_t want[kMaxClasses - 1], got[kMaxClasses - 1];
    BlockGeMasks(spec, x, kBlock, want);
    const GeKernel<uint16_t> kernel(spec);
    kernel(x, got);
    for (int t = 0; t < spec.k - 1; ++t) ASSERT_EQ(got[t], want[t]) << "trial " << trial << " threshold " << spec.thr[t];
  }
}

TEST(BlockHasher, PiecesDigestLikeTheWholeBlock) {
  std::mt19937_64 rng(5);
  std::vector<uint8_t> data(3 * 1000 * 1000);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  for (size_t len : {size_t{0}, size_t{1}, size_t{240}, size_t{1024}, size_t{1} << 20, data.size()}) {
    BlockHasher h;
    size_t at = 0;
    while (at < len) {
      const size_t take = std::min<size_t>(len - at, 1 + rng() % 70000);
      h.Update(data.data() + at, take);
      at += take;
    }
    EXPECT_EQ(h.Digest(), BlockDigest(data.data(), len)) << len;
    h.Reset();
    h.Update(data.data(), len);
    EXPECT_EQ(h.Digest(), BlockDigest(data.data(), len)) << len;
  }
}

}  // namespace
}  // namespace wsync::codec::internal
