#include "wsync/codec/bf16.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

namespace wsync::codec {
namespace {

// Produced by Debian's torch 1.13.1 on CPU:
//   torch.tensor(bits, dtype=torch.int32).view(torch.float32)
//        .to(torch.bfloat16).view(torch.int16)
constexpr struct {
  uint32_t f32;
  uint16_t bf16;
} kTorch[] = {
    {0x00000000, 0x0000}, {0x80000000, 0x8000},  // signed zeros
    {0x3F800000, 0x3F80}, {0xBF800000, 0xBF80},  // +-1
    {0x7F800000, 0x7F80}, {0xFF800000, 0xFF80},  // +-inf
    {0x7FC00000, 0xFFFF}, {0xFFC00000, 0xFFFF},  // NaNs
    {0x7F800001, 0xFFFF}, {0xFF812345, 0xFFFF}, {0x7FFFFFFF, 0xFFFF},
    {0x3F808000, 0x3F80},  // tie, even below: down
    {0x3F818000, 0x3F82},  // tie, odd below: up
    {0x3F808001, 0x3F81}, {0x3F807FFF, 0x3F80}, {0x3F80FFFF, 0x3F81},
    {0x7F7FFFFF, 0x7F80},  // max float rounds to inf
    {0x7F7F8000, 0x7F80}, {0x7F7F7FFF, 0x7F7F},
    {0x00000001, 0x0000}, {0x00008000, 0x0000}, {0x00018000, 0x0002},  // subnormals
    {0x80008000, 0x8000}, {0x807FFFFF, 0x8080}, {0x00400000, 0x0040},
    {0x3EAAAAAB, 0x3EAB}, {0xC2F6E979, 0xC2F7}, {0x33800000, 0x3380},
};

TEST(Bf16, MatchesTorchKnownAnswers) {
  for (const auto& c : kTorch) {
    EXPECT_EQ(Fp32BitsToBf16Bits(c.f32), c.bf16) << std::hex << c.f32;
  }
}

TEST(Bf16, RoundsToNearestEvenOnRandomValues) {
  // Reference: pick the nearer of the two BF16 neighbours by exact arithmetic.
  std::mt19937 rng(1);
  for (int i = 0; i < 1000000; ++i) {
    uint32_t bits = rng();
    if ((bits & 0x7F800000u) == 0x7F800000u) continue;  // inf/NaN tested above
    uint16_t got = Fp32BitsToBf16Bits(bits);
    uint32_t lo = bits & 0xFFFF0000u, rem = bits & 0xFFFFu;
    uint16_t want = static_cast<uint16_t>(lo >> 16);
    if (rem > 0x8000u || (rem == 0x8000u && (want & 1))) ++want;
    ASSERT_EQ(got, want) << std::hex << bits;
  }
}

TEST(Bf16, BulkCastEqualsScalar) {
  std::vector<uint32_t> src(1000);
  std::mt19937 rng(2);
  for (auto& v : src) v = rng();
  std::vector<uint16_t> dst(src.size());
  CastFp32ToBf16(src.data(), dst.data(), src.size());
  for (size_t i = 0; i < src.size(); ++i) ASSERT_EQ(dst[i], Fp32BitsToBf16Bits(src[i]));
}

}  // namespace
}  // namespace wsync::codec
