#include "range_coder.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace wsync::codec::internal {
namespace {

TEST(RangeCoder, ExpGolombRoundTripsEveryMagnitude) {
  std::mt19937_64 rng(1);
  std::vector<uint64_t> values;
  for (int bits = 0; bits <= 64; ++bits) {
    for (int i = 0; i < 50; ++i) {
      uint64_t v = bits == 0 ? 0 : rng() >> (64 - bits);
      values.push_back(v);
    }
  }
  values.push_back(UINT64_MAX);
  values.push_back(UINT64_MAX - 1);
  std::string out;
  {
    RangeEncoder enc(&out);
    EGModel m;
    BitModel b;
    for (uint64_t v : values) {
      enc.EncodeEG(m, v);
      enc.Encode(b, static_cast<int>(v & 1));
      enc.EncodeDirect(v, 13);
    }
    enc.Finish();
  }
  RangeDecoder dec(out);
  EGModel m;
  BitModel b;
  for (uint64_t v : values) {
    uint64_t got = 0;
    ASSERT_TRUE(dec.DecodeEG(m, UINT64_MAX, &got));
    ASSERT_EQ(got, v);
    ASSERT_EQ(dec.Decode(b), static_cast<int>(v & 1));
    ASSERT_EQ(dec.DecodeDirect(13), v & ((1u << 13) - 1));
  }
  EXPECT_LE(dec.overrun(), 4u);
}

TEST(RangeCoder, SkewedBitsCostLittle) {
  std::string out;
  RangeEncoder enc(&out);
  BitModel m;
  for (int i = 0; i < 100000; ++i) enc.Encode(m, i % 1000 == 0);
  enc.Finish();
  // H(0.001) = 0.0114 bits: ~143 bytes; allow for adaptation.
  EXPECT_LT(out.size(), 400u);
}

TEST(RangeCoder, DecodeEGRejectsValuesAboveMax) {
  std::string out;
  RangeEncoder enc(&out);
  EGModel m;
  enc.EncodeEG(m, 1000);
  enc.Finish();
  RangeDecoder dec(out);
  EGModel m2;
  uint64_t v;
  EXPECT_FALSE(dec.DecodeEG(m2, 999, &v));
}

TEST(RangeCoder, EmptyInputDecodesWithoutReadingOutside) {
  RangeDecoder dec("");
  EGModel m;
  uint64_t v;
  for (int i = 0; i < 100; ++i) (void)dec.DecodeEG(m, 1 << 20, &v);
  EXPECT_GT(dec.overrun(), 4u);
}

}  // namespace
}  // namespace wsync::codec::internal
