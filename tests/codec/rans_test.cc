// The static-model rANS coder and its bit stream: the encoder (rans.h)
// against the decoder both codecs run (sparse_decode.h, with either
// lookup): round trips of random symbol sequences over random tables
// (skewed, uniform, one symbol of probability 1), streams with words
// missing, extra or flipped, Elias gamma over the whole 64-bit range, and
// malformed table headers.
#include "rans.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <vector>

#include "wsync/codec/sparse_decode.h"
#include "wsync/util/bytes.h"

namespace wsync::codec::internal {
namespace {

// Counts of a random distribution over a random subset of the alphabet.
std::vector<uint32_t> RandomCounts(std::mt19937_64& rng) {
  std::vector<uint32_t> counts(kRansSymbols, 0);
  const int present = 1 + static_cast<int>(rng() % kRansSymbols);
  for (int i = 0; i < present; ++i) {
    const int s = static_cast<int>(rng() % kRansSymbols);
    // Skewed: some symbols dominate, some are rare.
    counts[s] += rng() % 3 == 0 ? static_cast<uint32_t>(1 + rng() % 3) : static_cast<uint32_t>(1 + rng() % 5000);
  }
  return counts;
}

// Symbols drawn in proportion to counts (so every present symbol may occur).
std::vector<uint8_t> Draw(const std::vector<uint32_t>& counts, size_t n, std::mt19937_64& rng) {
  std::vector<uint32_t> cum(kRansSymbols + 1, 0);
  for (int s = 0; s < kRansSymbols; ++s) cum[s + 1] = cum[s] + counts[s];
  std::vector<uint8_t> out(n);
  for (auto& x : out) {
    const uint32_t v = static_cast<uint32_t>(rng() % cum[kRansSymbols]);
    x = static_cast<uint8_t>(std::upper_bound(cum.begin(), cum.end(), v) - cum.begin() - 1);
  }
  return out;
}

sparse::BitIn BitsOf(std::string_view s) { return sparse::BitIn(reinterpret_cast<const uint8_t*>(s.data()), s.size()); }

sparse::RansSpan WordsOf(std::string_view w) {
  return {reinterpret_cast<const uint8_t*>(w.data()), w.size() / 2, nullptr, 0};
}

struct Coded {
  std::string stream;
  size_t word_bytes = 0;
};

// Codes n symbols, each with table[ctx[i]], tables first in the bit stream.
Coded Encode(const std::vector<std::vector<uint32_t>>& counts, const std::vector<uint8_t>& ctx,
             const std::vector<uint8_t>& sym, std::vector<RansTable>* tables) {
  BitWriter bits;
  tables->clear();
  for (const auto& c : counts) tables->push_back(ChooseRansTable(c.data(), &bits));
  RansEncoder enc;
  enc.Encode(sym.size(), [&](size_t i) -> const RansEncSymbol& { return (*tables)[ctx[i]].enc[sym[i]]; });
  Coded out;
  enc.Finish(&out.stream);
  out.word_bytes = out.stream.size();
  bits.AppendTo(&out.stream);
  return out;
}

TEST(Rans, RandomSequencesRoundTrip) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int contexts = 1 + static_cast<int>(rng() % 4);
    std::vector<std::vector<uint32_t>> counts;
    for (int c = 0; c < contexts; ++c) counts.push_back(RandomCounts(rng));
    const size_t n = trial % 10 == 0 ? trial % 3 : static_cast<size_t>(rng() % 20000);
    std::vector<uint8_t> ctx(n), sym(n);
    for (size_t i = 0; i < n; ++i) ctx[i] = static_cast<uint8_t>(rng() % contexts);
    for (int c = 0; c < contexts; ++c) {
      const auto drawn = Draw(counts[c], n, rng);
      for (size_t i = 0; i < n; ++i) {
        if (ctx[i] == c) sym[i] = drawn[i];
      }
    }
    std::vector<RansTable> tables;
    const Coded coded = Encode(counts, ctx, sym, &tables);

    // The word count, then the words, then the bits.
    std::string_view stream = coded.stream;
    ByteReader header(stream, "rANS stream");
    uint64_t words = 0;
    ASSERT_TRUE(header.Varint(&words, "word count"));
    const size_t at = header.position();
    ASSERT_EQ(at + words * 2, coded.word_bytes);
    sparse::BitIn bits = BitsOf(stream.substr(coded.word_bytes));
    auto search = std::make_unique<sparse::SearchTables>();
    auto slots = std::make_unique<sparse::SlotTables>();
    for (int c = 0; c < contexts; ++c) {
      sparse::Table t;
      ASSERT_TRUE(sparse::ReadTable(bits, &t));
      EXPECT_TRUE(std::equal(tables[c].freq.begin(), tables[c].freq.end(), t.freq));
      search->Set(c, t);
      slots->Set(c, t);
    }
    // Both lookups, the device's and the host's.
    sparse::RansIn by_search(WordsOf(stream.substr(at, words * 2)));
    sparse::RansIn by_slot(WordsOf(stream.substr(at, words * 2)));
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
      bad += by_search.Next(i, *search, ctx[i]) != sym[i];
      bad += by_slot.Next(i, *slots, ctx[i]) != sym[i];
    }
    EXPECT_EQ(bad, 0u) << "trial " << trial;
    EXPECT_TRUE(by_search.Finished());
    EXPECT_TRUE(by_slot.Finished());
    EXPECT_TRUE(bits.ExactlyConsumed());
  }
}

TEST(Rans, PairedEncodeGivesEachStreamItsOwnBytes) {
  // EncodePair runs two streams' passes in one loop; each stream must come
  // out as Encode alone makes it, whatever the two lengths (equal, odd,
  // one empty or far longer), and encoders reused from a longer stream
  // must not carry anything over.
  std::mt19937_64 rng(11);
  RansEncoder reused_a, reused_b;
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<std::vector<uint32_t>> counts = {RandomCounts(rng), RandomCounts(rng)};
    std::vector<RansTable> tables;
    BitWriter ignored;
    for (const auto& c : counts) tables.push_back(ChooseRansTable(c.data(), &ignored));
    const size_t na = trial % 7 == 0 ? 0 : static_cast<size_t>(rng() % 5000);
    const size_t nb = trial % 3 == 0 ? na : trial % 11 == 0 ? 0 : static_cast<size_t>(rng() % 5000);
    const std::vector<uint8_t> a = Draw(counts[0], na, rng), b = Draw(counts[1], nb, rng);
    auto sym_a = [&](size_t i) -> const RansEncSymbol& { return tables[0].enc[a[i]]; };
    auto sym_b = [&](size_t i) -> const RansEncSymbol& { return tables[1].enc[b[i]]; };

    RansEncoder alone_a, alone_b;
    alone_a.Encode(na, sym_a);
    alone_b.Encode(nb, sym_b);
    std::string want_a, want_b;
    alone_a.Finish(&want_a);
    alone_b.Finish(&want_b);

    RansEncoder::EncodePair(&reused_a, na, sym_a, &reused_b, nb, sym_b);
    std::string got_a, got_b;
    reused_a.Finish(&got_a);
    reused_b.Finish(&got_b);
    EXPECT_EQ(got_a, want_a) << "trial " << trial << ": " << na << " and " << nb << " symbols";
    EXPECT_EQ(got_b, want_b) << "trial " << trial << ": " << na << " and " << nb << " symbols";
  }
}

TEST(Rans, CertainSymbolCostsNoWords) {
  std::vector<uint32_t> counts(kRansSymbols, 0);
  counts[3] = 100000;
  std::vector<RansTable> tables;
  const Coded coded = Encode({counts}, std::vector<uint8_t>(100000, 0), std::vector<uint8_t>(100000, 3), &tables);
  EXPECT_EQ(tables[0].freq[3], kRansScale);
  // Varint 4, the two states, and the table header (P = 0: 4 + 16 bits).
  EXPECT_EQ(coded.word_bytes, 1u + 8u);
  EXPECT_EQ(coded.stream.size(), coded.word_bytes + 3);
}

TEST(Rans, DecoderDetectsMissingAndExtraWords) {
  std::mt19937_64 rng(3);
  std::vector<uint32_t> counts = {500, 300, 100, 50, 25, 10, 5, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  const std::vector<uint8_t> sym = Draw(counts, 5000, rng);
  std::vector<RansTable> tables;
  const Coded coded = Encode({counts}, std::vector<uint8_t>(sym.size(), 0), sym, &tables);
  const std::string words = coded.stream.substr(2, coded.word_bytes - 2);  // a 2-byte varint here
  sparse::Table t;
  std::copy(tables[0].freq.begin(), tables[0].freq.end(), t.freq);
  std::copy(tables[0].start.begin(), tables[0].start.end(), t.start);
  sparse::SearchTables lookup;
  lookup.Set(0, t);
  auto decodes = [&](std::string_view w) {
    sparse::RansIn dec(WordsOf(w));
    for (size_t i = 0; i < sym.size(); ++i) dec.Next(i, lookup, 0);
    return dec.Finished();
  };
  ASSERT_TRUE(decodes(words));
  EXPECT_FALSE(decodes(words.substr(0, words.size() - 2)));
  EXPECT_FALSE(decodes(words + std::string(2, '\x5a')));
  std::string flipped = words;
  flipped[words.size() / 2] ^= 0x10;
  EXPECT_FALSE(decodes(flipped));
}

TEST(BitStream, GammaAndFieldsRoundTrip) {
  std::mt19937_64 rng(11);
  std::vector<uint64_t> values = {0, 1, 2, 3, 1ull << 31, (1ull << 32) - 1, 1ull << 32, (1ull << 63) - 1,
                                  (1ull << 63), ~0ull - 1};
  for (int i = 0; i < 2000; ++i) values.push_back(rng() >> (rng() % 64));
  BitWriter w;
  // Half through the writer, half through a cursor.
  const size_t half = values.size() / 2;
  for (size_t i = 0; i < half; ++i) {
    w.PutGamma(values[i]);
    w.Put(values[i] & 0x1F, 5);
    w.Put(values[i] & 0xFFFFFFFFu, 32);
    w.Put(values[i] >> 32, 32);
  }
  BitWriter::Cursor c = w.Open((values.size() - half) * (127 + 5 + 64));
  for (size_t i = half; i < values.size(); ++i) {
    c.PutGamma(values[i]);
    c.Put(values[i] & 0x1F, 5);
    c.Put(values[i], 64);
  }
  w.Close(c);
  std::string s;
  w.AppendTo(&s);
  sparse::BitIn r = BitsOf(s);
  for (uint64_t v : values) {
    uint64_t got;
    ASSERT_TRUE(r.GetGamma(~0ull - 1, &got));
    EXPECT_EQ(got, v);
    EXPECT_EQ(r.Get(5), v & 0x1F);
    EXPECT_EQ(r.GetWide(64), v);
  }
  EXPECT_TRUE(r.ExactlyConsumed());
  EXPECT_FALSE(r.overrun());
}

TEST(BitStream, GammaAboveItsLimitOrPastTheEndFails) {
  BitWriter w;
  w.PutGamma(1000);
  std::string s;
  w.AppendTo(&s);
  uint64_t v;
  sparse::BitIn over = BitsOf(s);
  EXPECT_FALSE(over.GetGamma(999, &v));
  sparse::BitIn ok = BitsOf(s);
  EXPECT_TRUE(ok.GetGamma(1000, &v));
  EXPECT_EQ(v, 1000u);
  // All zeros: no terminating one within 64 bits.
  const std::string zero_bytes(16, '\0');
  sparse::BitIn zeros = BitsOf(zero_bytes);
  EXPECT_FALSE(zeros.GetGamma(~0ull, &v));
  const std::string no_bytes;
  sparse::BitIn empty = BitsOf(no_bytes);
  EXPECT_FALSE(empty.GetGamma(~0ull, &v));
  EXPECT_EQ(empty.Get(56), 0u);
  EXPECT_TRUE(empty.overrun());
}

TEST(RansTableHeader, MalformedHeadersAreRejected) {
  auto read = [](const BitWriter& w) {
    std::string s;
    w.AppendTo(&s);
    sparse::BitIn r = BitsOf(s);
    sparse::Table t;
    return sparse::ReadTable(r, &t);
  };
  {  // precision above 10
    BitWriter w;
    w.Put(11, 4);
    w.Put(1, 16);
    EXPECT_FALSE(read(w));
  }
  {  // no symbol
    BitWriter w;
    w.Put(4, 4);
    w.Put(0, 16);
    EXPECT_FALSE(read(w));
  }
  {  // more symbols than 2^P slots
    BitWriter w;
    w.Put(1, 4);
    w.Put(0x7, 16);
    EXPECT_FALSE(read(w));
  }
  {  // the first frequency leaves nothing for the last
    BitWriter w;
    w.Put(2, 4);
    w.Put(0x3, 16);
    w.PutGamma(3);  // freq 4 of 4
    EXPECT_FALSE(read(w));
  }
  {  // well formed: 3 of 4 and 1 of 4
    BitWriter w;
    w.Put(2, 4);
    w.Put(0x3, 16);
    w.PutGamma(2);
    std::string s;
    w.AppendTo(&s);
    sparse::BitIn r = BitsOf(s);
    sparse::Table t;
    ASSERT_TRUE(sparse::ReadTable(r, &t));
    EXPECT_EQ(t.freq[0], 3 * kRansScale / 4);
    EXPECT_EQ(t.freq[1], kRansScale / 4);
    EXPECT_EQ(t.start[1], 3 * kRansScale / 4);
  }
}

TEST(RansTableHeader, ChosenTablesCostAboutTheEntropy) {
  // 1000 symbols, 90% / 10%: entropy 469 bits; the table adds a header.
  std::vector<uint32_t> counts(kRansSymbols, 0);
  counts[0] = 900;
  counts[5] = 100;
  const double bits = RansCostBits(counts.data());
  EXPECT_GT(bits, 469.0);
  EXPECT_LT(bits, 469.0 + 40.0);
  BitWriter w;
  const RansTable t = ChooseRansTable(counts.data(), &w);
  EXPECT_EQ(t.freq[0] + t.freq[5], kRansScale);
  EXPECT_NEAR(t.freq[0], 0.9 * kRansScale, 0.02 * kRansScale);
}

}  // namespace
}  // namespace wsync::codec::internal
