// The device kernels' per-element logic (wsync/cuda/logic.h), run on the CPU
// against libxxhash and the host codec, bit for bit. Runs without a GPU.
#include "wsync/cuda/logic.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <random>
#include <vector>

#include "wsync/codec/checksum.h"

namespace wsync::cuda::logic {
namespace {

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

TEST(Xxh3Logic, MatchesLibxxhashAtEveryLengthUpTo4096) {
  const auto data = RandomBytes(4096 + 7, 1);
  for (size_t len = 0; len <= 4096; ++len) {
    ASSERT_EQ(Xxh3(data.data(), len), XXH3_64bits(data.data(), len)) << "length " << len;
  }
}

TEST(Xxh3Logic, MatchesLibxxhashAtUnalignedStarts) {
  const auto data = RandomBytes(5000, 2);
  for (size_t off = 1; off < 8; ++off) {
    for (size_t len : {17, 129, 241, 1024, 1025, 4000}) {
      ASSERT_EQ(Xxh3(data.data() + off, len), XXH3_64bits(data.data() + off, len)) << off << " " << len;
    }
  }
}

TEST(Xxh3Logic, LanesMergeToTheChecksumBlockDigest) {
  const auto data = RandomBytes(codec::kChecksumBlockBytes + 100, 3);
  for (size_t len : {size_t{241}, size_t{65536} + 13, codec::kChecksumBlockBytes}) {
    uint64_t acc[8];
    for (int lane = 0; lane < 8; ++lane) acc[lane] = Xxh3LongLane(data.data(), len, lane);
    EXPECT_EQ(Xxh3Merge(acc, len), codec::BlockDigest(data.data(), len)) << len;
  }
}

TEST(Xxh3Logic, BlockSumsAndScrambleChainGiveTheLanes) {
  const auto data = RandomBytes(codec::kChecksumBlockBytes, 5);
  for (size_t len : {size_t{241}, size_t{1024}, size_t{1025}, size_t{4096} + 65, codec::kChecksumBlockBytes}) {
    uint64_t acc[8];
    for (int lane = 0; lane < 8; ++lane) {
      uint64_t a = Xxh3InitAcc(lane);
      for (size_t b = 0; b < Xxh3FullBlocks(len); ++b) {
        a = Xxh3Scramble(a + Xxh3BlockSum(data.data() + b * kHashBlockBytes, lane), Xxh3ScrambleKey(lane));
      }
      acc[lane] = Xxh3TailLane(a, data.data(), len, lane);
    }
    EXPECT_EQ(Xxh3Merge(acc, len), XXH3_64bits(data.data(), len)) << len;
  }
}

TEST(Xxh3Logic, TheWarpsBlockSumsAreTheLanesBlockSums) {
  std::mt19937_64 rng(7);
  std::vector<uint8_t> data(kHashBlockBytes * 8 + 8);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  for (size_t at : {size_t{0}, size_t{1}, size_t{3}, size_t{kHashBlockBytes * 3 + 5}}) {
    uint64_t sums[8];
    Xxh3WarpBlockSums(data.data() + at, sums);
    for (int lane = 0; lane < 8; ++lane) EXPECT_EQ(sums[lane], Xxh3BlockSum(data.data() + at, lane)) << at << " " << lane;
  }
}

TEST(BlockLogic, ClassCountsRanksAndSelectAgree) {
  std::mt19937 rng(4);
  codec::ClassSpec spec;
  spec.k = 4;
  spec.shift = 7;
  spec.mask = 0xFF;
  spec.thr[0] = 100;
  spec.thr[1] = 118;
  spec.thr[2] = 125;
  for (int trial = 0; trial < 2000; ++trial) {
    uint16_t x[codec::kBlock];
    for (auto& v : x) v = static_cast<uint16_t>((rng() % 40 + 95) << 7 | (rng() & 0x807F));
    const int len = 1 + static_cast<int>(rng() % codec::kBlock);
    uint32_t counts[codec::kMaxClasses];
    BlockClassCounts(spec, x, len, counts);
    uint32_t seen[codec::kMaxClasses] = {};
    for (int j = 0; j < len; ++j) {
      const int c = spec.ClassOf(x[j]);
      ASSERT_EQ(ClassCountBelow(spec, x, len, c, j), seen[c]);
      ASSERT_EQ(ClassSelect(spec, x, len, c, seen[c]), j);
      ++seen[c];
    }
    for (int c = 0; c < codec::kMaxClasses; ++c) ASSERT_EQ(counts[c], seen[c]);
  }
}

TEST(BlockLogic, LayoutSamplesEverySixteenthFullBlockOfAChunk) {
  Layout l{.n = 3 * 1024 + 5, .chunk_elems = 1024};  // 32 blocks per chunk
  std::vector<uint64_t> sampled;
  for (uint64_t b = 0; b < l.Blocks(); ++b) {
    if (l.Sampled(b)) sampled.push_back(b);
  }
  EXPECT_EQ(sampled, (std::vector<uint64_t>{0, 16, 32, 48, 64, 80}));
  EXPECT_EQ(l.BlockLen(l.Blocks() - 1), 5);
  EXPECT_EQ(l.Chunks(), 4u);
}

}  // namespace
}  // namespace wsync::cuda::logic
