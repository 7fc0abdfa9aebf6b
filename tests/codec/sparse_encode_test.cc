// The sparse chunk's encoding agent (wsync/codec/sparse_encode.h) as the
// device runs it (one chunk per thread, a bounded output, its tables of
// frequencies and starts) against the host codec's chunk coder: random
// chunks of every width, density and class count that the host codes in
// mode 1 without weighing another mode give the same bytes, those where it
// weighs others give the same chunk once they are weighed (ChooseMode),
// chunks it never codes sparse are refused; too little room is reported,
// with nothing written past it; and the fixed-point costs and symbol
// functions are the format's.
#include "wsync/codec/sparse_encode.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "chunk_codec.h"
#include "chunk_coders.h"
#include "random_chunk.h"

namespace wsync::codec::internal {
namespace {

struct AgentOut {
  sparse::SparseEncodeResult result;
  std::string pos, val;
};

// The agent on a chunk, given room for pos_cap and val_cap bytes; checks
// that nothing is written past them.
template <typename T>
AgentOut RunAgent(size_t n, const SparseDelta<T>& d, const std::vector<T>& old, const std::vector<uint32_t>& rank,
                  const ClassSpec& spec, size_t pos_cap, size_t val_cap) {
  const size_t m = d.pos.size();
  sparse::SparseChunkIn<T> in;
  in.n = n;
  in.m = m;
  in.pos = d.pos.data();
  in.delta = d.delta.data();
  in.old = spec.k > 1 ? old.data() : nullptr;
  in.rank = spec.k > 1 ? rank.data() : nullptr;
  in.spec = spec;
  std::vector<uint32_t> grouped(m);
  std::vector<uint16_t> words(m + 1);
  auto work = std::make_unique<sparse::SparseEncodeWork>();
  constexpr size_t kGuard = 64;
  std::vector<uint8_t> pos(pos_cap + kGuard, 0xA5), val(val_cap + kGuard, 0x5A);
  AgentOut out;
  out.result = sparse::EncodeSparseChunk<T>(in, {grouped.data(), words.data(), work.get()}, pos.data(), pos_cap,
                                            val.data(), val_cap, sparse::kLog2Table.data());
  for (size_t i = pos_cap; i < pos.size(); ++i) EXPECT_EQ(pos[i], 0xA5) << "position stream written past its room";
  for (size_t i = val_cap; i < val.size(); ++i) EXPECT_EQ(val[i], 0x5A) << "value stream written past its room";
  if (out.result.code == sparse::kSparseEncoded) {
    out.pos.assign(reinterpret_cast<const char*>(pos.data()), out.result.pos_bytes);
    out.val.assign(reinterpret_cast<const char*>(val.data()), out.result.val_bytes);
  }
  return out;
}

template <typename T>
void CheckRandomChunks(DType dtype, uint32_t seed) {
  std::mt19937_64 rng(seed);
  const ExponentField ef = ExponentFieldOf(dtype);
  int encoded = 0, conditioned = 0, refused = 0, weighed = 0, weighed_sparse = 0;
  for (size_t n : {1, 40, 1000, 5000, 70000, 300000}) {
    for (double density : {0.0005, 0.004, 0.02, 0.04, 0.2, 0.7}) {
      for (bool runs : {false, true}) {
        std::vector<T> base;
        SparseDelta<T> d;
        RandomChunk<T>(n, density, runs, ef, rng, &base, &d);
        if (d.pos.empty()) continue;
        std::vector<T> target = base;
        for (size_t i = 0; i < d.pos.size(); ++i) target[d.pos[i]] = static_cast<T>(target[d.pos[i]] + d.delta[i]);
        ChunkCodecOptions options;
        options.exponent = ef;
        const ClassSpec spec = ChooseChunkClasses<T>(base.data(), target.data(), n, options);
        std::vector<T> old(d.pos.size());
        for (size_t i = 0; i < d.pos.size(); ++i) old[i] = base[d.pos[i]];
        std::vector<uint32_t> rank;
        if (NeedsRanks(n, d.pos.size(), spec)) RanksByClass<T>(base.data(), n, d.pos, spec, &rank);
        const EncodedChunk host = EncodeChunkStaged<T>(n, d, spec.k > 1 ? old.data() : nullptr, spec,
                                                       rank.empty() ? nullptr : rank.data(), options.zstd_level);
        const std::string where = "n " + std::to_string(n) + " density " + std::to_string(density) +
                                  (runs ? " runs" : "") + " k " + std::to_string(spec.k);
        const size_t m = d.pos.size();
        const AgentOut agent = RunAgent<T>(n, d, old, rank, spec, 1024 + 16 * m, 1024 + 16 * m);
        if (!sparse::SparseTried(n, m)) {
          EXPECT_EQ(agent.result.code, sparse::kSparseNotTried) << where;
          ++refused;
          continue;
        }
        ASSERT_EQ(agent.result.code, sparse::kSparseEncoded) << where;
        const bool sparse_only = sparse::SparseOnly(n, m, CountRuns(d.pos));
        ASSERT_EQ(agent.result.sparse_only != 0, sparse_only) << where;
        if (sparse_only) {
          ASSERT_EQ(host.mode, ChunkMode::kSparse) << where;
          ASSERT_EQ(agent.pos, host.pos) << where;
          ASSERT_EQ(agent.val, host.val) << where;
        } else {
          // The other modes weighed against the agent's streams.
          const EncodedChunk chosen = ChooseMode<T>(n, d, spec, options.zstd_level, agent.pos, agent.val);
          ASSERT_EQ(chosen.mode, host.mode) << where;
          ASSERT_EQ(chosen.pos, host.pos) << where;
          ASSERT_EQ(chosen.val, host.val) << where;
          ++weighed;
          weighed_sparse += host.mode == ChunkMode::kSparse ? 1 : 0;
        }
        ++encoded;
        conditioned += spec.k > 1 ? 1 : 0;
      }
    }
  }
  EXPECT_GE(encoded, 8);
  EXPECT_GE(refused, 4);
  EXPECT_GE(weighed, 4);
  EXPECT_GE(weighed_sparse, 1) << "no weighed chunk stayed sparse";
  EXPECT_GT(weighed, weighed_sparse) << "no weighed chunk took another mode";
  if (ef.mask != 0) {
    EXPECT_GE(conditioned, 4);
  }
}

TEST(SparseEncodeAgent, EncodesRandomChunksAsTheHostCodecDoes) {
  ForEachCodedDType([](auto zero, DType dtype, uint32_t seed) { CheckRandomChunks<decltype(zero)>(dtype, seed); });
}

// Too little room for either stream is reported at any size, and nothing
// is written past the room given.
TEST(SparseEncodeAgent, ReportsAFullOutputAndWritesNothingPastIt) {
  std::mt19937_64 rng(7);
  const ExponentField ef = ExponentFieldOf(DType::kBF16);
  std::vector<uint16_t> base;
  SparseDelta<uint16_t> d;
  RandomChunk<uint16_t>(100000, 0.01, false, ef, rng, &base, &d);
  const ClassSpec spec;  // one class: no ranks needed
  const size_t m = d.pos.size();
  const AgentOut whole = RunAgent<uint16_t>(base.size(), d, {}, {}, spec, 1024 + 16 * m, 1024 + 16 * m);
  ASSERT_EQ(whole.result.code, sparse::kSparseEncoded);
  for (size_t cap : {size_t{0}, size_t{1}, size_t{5}, whole.pos.size() / 2, whole.pos.size() - 1}) {
    const AgentOut cut = RunAgent<uint16_t>(base.size(), d, {}, {}, spec, cap, 1024 + 16 * m);
    EXPECT_EQ(cut.result.code, sparse::kOutputFull) << "position room " << cap;
  }
  for (size_t cap : {size_t{0}, size_t{3}, whole.val.size() / 2, whole.val.size() - 1}) {
    const AgentOut cut = RunAgent<uint16_t>(base.size(), d, {}, {}, spec, 1024 + 16 * m, cap);
    EXPECT_EQ(cut.result.code, sparse::kOutputFull) << "value room " << cap;
  }
  const AgentOut exact = RunAgent<uint16_t>(base.size(), d, {}, {}, spec, whole.pos.size(), whole.val.size());
  EXPECT_EQ(exact.result.code, sparse::kSparseEncoded);
  EXPECT_EQ(exact.pos, whole.pos);
  EXPECT_EQ(exact.val, whole.val);
}

TEST(SparseEncodeAgent, FixedPointLog2IsTheFloorOfLog2) {
  for (uint32_t f = 1; f <= sparse::kScale; ++f) {
    const double exact = std::log2(static_cast<double>(f)) * (1u << sparse::kCostFraction);
    const double got = sparse::kLog2Table[f];
    EXPECT_LE(got, exact + 1e-6) << f;
    EXPECT_GT(got, exact - 2) << f;  // the truncation of each squaring loses at most a unit or so
  }
}

TEST(SparseEncodeAgent, GapSymbolsAreTheFormatsBuckets) {
  for (uint64_t q = 0; q < 1000; ++q) {
    int expected = sparse::kGapEscape;
    for (int s = 0; s < sparse::kGapEscape; ++s) {
      if (q >= sparse::GapBase(s) && q < sparse::GapBase(s + 1)) expected = s;
    }
    EXPECT_EQ(sparse::GapSymbol(q), expected) << q;
  }
}

}  // namespace
}  // namespace wsync::codec::internal
