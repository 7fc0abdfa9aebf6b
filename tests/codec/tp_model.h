// A small tensor-parallel model for tests: canonical tensors, and each
// rank's runtime tensors laid out as vLLM lays them (fused qkv with
// replicated kv heads when TP exceeds them, row- and column-parallel, padded
// vocabulary).
#pragma once

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "test_tensors.h"
#include "wsync/codec/codec.h"

namespace wsync::testing {

using codec::DType;
using codec::Piece;
using codec::RuntimeTensor;

constexpr uint64_t kHidden = 48, kQ = 64, kKv = 16, kVocab = 100, kVocabPadded = 128;

inline std::vector<OwnedTensor> CanonicalModel(std::mt19937_64& rng) {
  return {
      RandomTensor("q_proj", DType::kBF16, {kQ, kHidden}, rng),
      RandomTensor("k_proj", DType::kBF16, {kKv, kHidden}, rng),
      RandomTensor("v_proj", DType::kBF16, {kKv, kHidden}, rng),
      RandomTensor("q_bias", DType::kBF16, {kQ}, rng),
      RandomTensor("o_proj", DType::kBF16, {kHidden, kQ}, rng),
      RandomTensor("norm", DType::kBF16, {kHidden}, rng),
      RandomTensor("embed", DType::kBF16, {kVocab, kHidden}, rng),
      RandomTensor("down", DType::kBF16, {700, 1600}, rng),  // column-parallel cells of several chunks
  };
}

// Move-only: the layout's views point into the tensors' storage.
struct Rank {
  Rank() = default;
  Rank(Rank&&) = default;
  Rank& operator=(Rank&&) = default;
  Rank(const Rank&) = delete;
  std::vector<OwnedTensor> tensors;  // runtime storage
  std::vector<RuntimeTensor> layout;
};

constexpr uint16_t kUntouched = 0xABCD;

// Rank r of TP tp, its tensors filled with kUntouched.
inline Rank MakeRank(uint64_t tp, uint64_t r) {
  Rank rank;
  const uint64_t q = kQ / tp, kv_heads = 2, head = kKv / kv_heads;
  // kv rows of this rank: a slice of the heads, or one replicated head.
  const uint64_t kv = tp <= kv_heads ? kKv / tp : head;
  const uint64_t kv_start = tp <= kv_heads ? r * kv : (r * kv_heads / tp) * head;
  const uint64_t vocab = kVocabPadded / tp, vocab_start = r * vocab;
  const uint64_t vocab_rows = vocab_start >= kVocab ? 0 : std::min(vocab, kVocab - vocab_start);
  const uint64_t down_cols = 1600 / tp;
  auto add = [&](const std::string& name, std::vector<uint64_t> shape, std::vector<Piece> pieces) {
    OwnedTensor t{name, DType::kBF16, shape, {}};
    uint64_t n = 1;
    for (auto d : shape) n *= d;
    t.bytes.resize(n * 2);
    for (uint64_t i = 0; i < n; ++i) std::memcpy(t.bytes.data() + 2 * i, &kUntouched, 2);
    rank.tensors.push_back(std::move(t));
    rank.layout.push_back(RuntimeTensor{{}, std::move(pieces)});
  };
  add("qkv", {q + 2 * kv, kHidden},
      {{"q_proj", {r * q, 0}, {q, kHidden}, {0, 0}},
       {"k_proj", {kv_start, 0}, {kv, kHidden}, {q, 0}},
       {"v_proj", {kv_start, 0}, {kv, kHidden}, {q + kv, 0}}});
  add("qkv_bias", {q}, {{"q_bias", {r * q}, {q}, {0}}});
  add("o", {kHidden, q}, {{"o_proj", {0, r * q}, {kHidden, q}, {0, 0}}});
  add("norm", {kHidden}, {{"norm", {0}, {kHidden}, {0}}});
  std::vector<Piece> vocab_pieces;
  if (vocab_rows > 0) vocab_pieces.push_back({"embed", {vocab_start, 0}, {vocab_rows, kHidden}, {0, 0}});
  add("embed", {vocab, kHidden}, vocab_pieces);
  add("down", {700, down_cols}, {{"down", {0, r * down_cols}, {700, down_cols}, {0, 0}}});
  for (size_t i = 0; i < rank.tensors.size(); ++i) {
    auto& t = rank.tensors[i];
    rank.layout[i].view = {t.name, t.dtype, t.shape, t.bytes.data()};
  }
  return rank;
}

// Copies every piece of the rank out of the canonical tensors.
inline void Fill(Rank* rank, const std::vector<OwnedTensor>& canonical) {
  for (const RuntimeTensor& rt : rank->layout) {
    const uint64_t rcols = rt.view.shape.size() > 1 ? rt.view.shape[1] : 1;
    for (const Piece& p : rt.pieces) {
      const OwnedTensor& c = *std::find_if(canonical.begin(), canonical.end(),
                                           [&](const OwnedTensor& t) { return t.name == p.canonical; });
      const uint64_t ccols = c.shape.size() > 1 ? c.shape[1] : 1;
      const uint64_t rows = p.extent[0], cols = p.extent.size() > 1 ? p.extent[1] : 1;
      const uint64_t c0 = p.start.size() > 1 ? p.start[1] : 0;
      const uint64_t rc0 = p.runtime_start.size() > 1 ? p.runtime_start[1] : 0;
      for (uint64_t i = 0; i < rows; ++i) {
        std::memcpy(rt.view.data + ((p.runtime_start[0] + i) * rcols + rc0) * 2,
                    c.bytes.data() + ((p.start[0] + i) * ccols + c0) * 2, cols * 2);
      }
    }
  }
}

// The rank's tensors as they should be: kUntouched where no piece lies.
inline std::vector<OwnedTensor> Expected(uint64_t tp, uint64_t r, const std::vector<OwnedTensor>& canonical) {
  Rank want = MakeRank(tp, r);
  Fill(&want, canonical);
  return want.tensors;
}

inline std::vector<Rank> MakeRanks(uint64_t tp) {
  std::vector<Rank> out;
  for (uint64_t r = 0; r < tp; ++r) out.push_back(MakeRank(tp, r));
  return out;
}

inline std::vector<std::vector<RuntimeTensor>> Layouts(std::vector<Rank>& ranks) {
  std::vector<std::vector<RuntimeTensor>> out;
  for (auto& r : ranks) out.push_back(r.layout);
  return out;
}

// A version of the model as the parts of two sources (tensors [0, 4) and
// the rest), each coded with its tensors' grids: as patches v0 -> v1 and as
// keyframes of v1.
struct TwoParts {
  std::vector<std::string> patches, keyframes;
};
inline TwoParts TwoSourceParts(const std::vector<OwnedTensor>& v0, const std::vector<OwnedTensor>& v1,
                               const std::vector<codec::TileGrid>& grids) {
  TwoParts out;
  const auto bv = buffers::Views(v0), tv = buffers::Views(v1);
  for (auto [b, e] : {std::pair<size_t, size_t>{0, 4}, {4, v0.size()}}) {
    codec::EncodeOptions o;
    for (const auto& g : grids) {
      for (size_t t = b; t < e; ++t) {
        if (v0[t].name == g.tensor) o.grids.push_back(g);
      }
    }
    out.patches.push_back(*codec::EncodePatch(std::span(bv).subspan(b, e - b), std::span(tv).subspan(b, e - b), o));
    out.keyframes.push_back(*codec::EncodeKeyframe(std::span(tv).subspan(b, e - b), o));
  }
  return out;
}

}  // namespace wsync::testing
