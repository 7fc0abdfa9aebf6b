// The sparse chunk's decoding agents (wsync/codec/sparse_decode.h) as the
// device runs them (one chunk per thread, SearchTables, ranks resolved over
// the base's classes and merged by MergeClassLists) against the host
// codec's decoding of the same chunk (SlotTables, the rank sweep, the staged
// merge): random chunks of every width, density and class count decode to
// the same positions and deltas, and corrupted streams fail exactly where
// the host fails (and otherwise decode to the same bits).
#include "wsync/codec/sparse_decode.h"

#include <gtest/gtest.h>

#include <optional>
#include <random>
#include <vector>

#include "chunk_codec.h"
#include "random_chunk.h"

namespace wsync::codec::internal {
namespace {

struct Decoded {
  std::vector<uint32_t> pos;
  std::vector<uint64_t> delta;
  bool operator==(const Decoded&) const = default;
};

// The host codec's decoding of a chunk (nullopt: rejected).
template <typename T>
std::optional<Decoded> HostDecode(const EncodedChunk& e, const std::vector<T>& base, ExponentField ef) {
  SparseDelta<T> d;
  if (!DecodeChunk<T>(e.mode, e.changed, e.pos, e.val, base.data(), base.size(), ef, &d).ok()) return std::nullopt;
  return Decoded{d.pos, std::vector<uint64_t>(d.delta.begin(), d.delta.end())};
}

// The agents' decoding, with the base's classes resolving ranks as the
// device's rank kernel does (nullopt: rejected).
template <typename T>
std::optional<Decoded> AgentDecode(const EncodedChunk& e, const std::vector<T>& base, ExponentField ef) {
  sparse::ChunkStreams s;
  const size_t n = base.size();
  if (e.changed == 0 || e.changed > n || !LocateSparseStreams(e.pos, e.val, ef, &s).ok()) return std::nullopt;
  const int k = s.spec.k;
  uint64_t counts[kMaxClasses] = {};
  std::vector<uint32_t> ranks(e.changed);
  sparse::SearchTables tables;  // the device's lookup (the host codec's decoder uses SlotTables)
  if (!sparse::DecodeSparseRanks(s.pos, n, e.changed, k, counts, ranks.data(), &tables).ok()) {
    return std::nullopt;
  }
  Decoded out;
  std::vector<T> old(e.changed);
  if (k == 1) {
    out.pos = ranks;
  } else {
    // Rank r of class c -> the r-th element of class c in the base.
    std::vector<std::vector<uint32_t>> members(k);
    for (size_t p = 0; p < n; ++p) members[s.spec.ClassOf(base[p])].push_back(static_cast<uint32_t>(p));
    std::vector<uint32_t> by_class(e.changed);
    std::vector<T> old_by_class(e.changed);
    size_t i = 0;
    for (int c = 0; c < k; ++c) {
      for (uint64_t j = 0; j < counts[c]; ++j, ++i) {
        if (ranks[i] >= members[c].size()) return std::nullopt;
        by_class[i] = members[c][ranks[i]];
        old_by_class[i] = base[by_class[i]];
      }
    }
    out.pos.resize(e.changed);
    if (!sparse::MergeClassLists(by_class.data(), old_by_class.data(), counts, k, out.pos.data(), old.data()).ok()) {
      return std::nullopt;
    }
  }
  std::vector<T> delta(e.changed);
  if (!sparse::DecodeSparseValues<T>(s.val, e.changed, s.spec, k > 1 ? old.data() : nullptr, delta.data(), &tables)
           .ok()) {
    return std::nullopt;
  }
  out.delta.assign(delta.begin(), delta.end());
  return out;
}

template <typename T>
void CheckRandomChunks(DType dtype, uint32_t seed) {
  std::mt19937_64 rng(seed);
  const ExponentField ef = ExponentFieldOf(dtype);
  int sparse_chunks = 0, conditioned = 0;
  for (size_t n : {1, 7, 64, 1000, 5000, 70000}) {
    for (double density : {0.001, 0.01, 0.05, 0.2}) {
      std::vector<T> base;
      SparseDelta<T> d;
      RandomChunk<T>(n, density, false, ef, rng, &base, &d);
      if (d.pos.empty()) continue;
      ChunkCodecOptions options;
      options.exponent = ef;
      const EncodedChunk e = EncodeChunk<T>(base.data(), n, d, options);
      if (e.mode != ChunkMode::kSparse) continue;
      ++sparse_chunks;
      conditioned += static_cast<uint8_t>(e.pos[0]) > 1 ? 1 : 0;
      const auto host = HostDecode<T>(e, base, ef);
      ASSERT_TRUE(host.has_value()) << "n " << n << " density " << density;
      const auto agent = AgentDecode<T>(e, base, ef);
      ASSERT_TRUE(agent.has_value()) << "n " << n << " density " << density;
      ASSERT_EQ(*agent, *host) << "n " << n << " density " << density;
      ASSERT_EQ(agent->pos, d.pos);
    }
  }
  EXPECT_GE(sparse_chunks, 8);
  if (ef.mask != 0) {
    EXPECT_GE(conditioned, 2);
  }
}

TEST(SparseDecodeAgents, DecodeRandomChunksAsTheHostCodecDoes) {
  ForEachCodedDType([](auto zero, DType dtype, uint32_t seed) { CheckRandomChunks<decltype(zero)>(dtype, seed); });
}

// Every single-byte corruption and truncation of a chunk's streams: the
// agents reject it exactly when the host decoder does, and otherwise decode
// the same bits.
template <typename T>
void CheckCorruptions(DType dtype, double density, uint32_t seed) {
  std::mt19937_64 rng(seed);
  const ExponentField ef = ExponentFieldOf(dtype);
  std::vector<T> base;
  SparseDelta<T> d;
  RandomChunk<T>(20000, density, false, ef, rng, &base, &d);
  ChunkCodecOptions options;
  options.exponent = ef;
  const EncodedChunk clean = EncodeChunk<T>(base.data(), base.size(), d, options);
  ASSERT_EQ(clean.mode, ChunkMode::kSparse);
  int rejected = 0, cases = 0;
  auto check = [&](const EncodedChunk& e, const std::string& what) {
    const auto host = HostDecode<T>(e, base, ef);
    const auto agent = AgentDecode<T>(e, base, ef);
    ASSERT_EQ(agent.has_value(), host.has_value()) << what;
    if (host) {
      ASSERT_EQ(*agent, *host) << what;
    }
    rejected += host ? 0 : 1;
    ++cases;
  };
  for (int stream = 0; stream < 2; ++stream) {
    const std::string& bytes = stream == 0 ? clean.pos : clean.val;
    for (size_t at = 0; at < bytes.size(); ++at) {
      for (uint8_t flip : {uint8_t{0x01}, uint8_t{0x80}, static_cast<uint8_t>(1 + rng() % 255)}) {
        EncodedChunk e = clean;
        std::string& s = stream == 0 ? e.pos : e.val;
        s[at] = static_cast<char>(s[at] ^ flip);
        check(e, "stream " + std::to_string(stream) + " byte " + std::to_string(at) + " ^ " + std::to_string(flip));
      }
      EncodedChunk e = clean;
      (stream == 0 ? e.pos : e.val).resize(at);
      check(e, "stream " + std::to_string(stream) + " cut at " + std::to_string(at));
    }
  }
  EXPECT_GT(rejected, cases / 2);
  EXPECT_GT(cases, 1000);
}

TEST(SparseDecodeAgents, RejectCorruptStreamsExactlyAsTheHostCodecDoes) {
  CheckCorruptions<uint16_t>(DType::kBF16, 0.02, 11);
  CheckCorruptions<uint32_t>(DType::kF32, 0.05, 12);
  CheckCorruptions<uint8_t>(DType::kU8, 0.03, 13);
}

TEST(SparseDecodeAgents, SymbolFunctionsAreTheFormatsTables) {
  const uint32_t gap_base[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 128};
  const int gap_extra[16] = {0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 3, 3, 4, 4, 6, 0};
  const uint32_t value_base[15] = {1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 10, 10, 18};
  const int value_extra[15] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 3, 3, 0};
  for (int s = 0; s < 16; ++s) {
    EXPECT_EQ(sparse::GapBase(s), gap_base[s]) << s;
    EXPECT_EQ(sparse::GapExtra(s), gap_extra[s]) << s;
    if (s < 15) {
      EXPECT_EQ(sparse::ValueBase(s), value_base[s]) << s;
      EXPECT_EQ(sparse::ValueExtra(s), value_extra[s]) << s;
    }
  }
}

}  // namespace
}  // namespace wsync::codec::internal
