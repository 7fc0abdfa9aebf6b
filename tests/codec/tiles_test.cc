// Tile grids and pieces (docs/patch-format.md, "Tiles"; codec.h, "Pieces"):
// gridded patches round-trip for every shape and grid, and a sink holding
// tensor-parallel shards of fused runtime tensors applies exactly its part,
// bit for bit, from the whole patch or from its selection.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <set>

#include "test_tensors.h"
#include "tp_model.h"
#include "wsync/codec/checksum.h"
#include "wsync/codec/codec.h"
#include "wsync/codec/staged.h"
#include "wsync/util/thread_pool.h"

namespace wsync::codec {
namespace {

using testing::OwnedTensor;
using testing::Perturb;
using testing::RandomTensor;
using testing::CanonicalModel;
using testing::Expected;
using testing::Fill;
using testing::kQ;
using testing::kUntouched;
using testing::Layouts;
using testing::MakeRank;
using testing::MakeRanks;
using testing::Rank;

using buffers::MutableViews;
using buffers::Views;

std::vector<OwnedTensor> PerturbAll(const std::vector<OwnedTensor>& ts, double density, std::mt19937_64& rng) {
  std::vector<OwnedTensor> out;
  for (const auto& t : ts) out.push_back(Perturb(t, density, rng));
  return out;
}

// Random strictly ascending cuts inside (0, n).
std::vector<uint64_t> RandomCuts(uint64_t n, std::mt19937_64& rng) {
  std::vector<uint64_t> cuts;
  if (n < 2) return cuts;
  const int k = static_cast<int>(rng() % 4);
  for (int i = 0; i < k; ++i) cuts.push_back(1 + rng() % (n - 1));
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  return cuts;
}

TEST(Tiles, GriddedPatchesRoundTripForEveryShapeAndGrid) {
  std::mt19937_64 rng(7);
  ThreadPool pool(4);
  for (int round = 0; round < 12; ++round) {
    std::vector<OwnedTensor> base = {
        RandomTensor("matrix", DType::kBF16, {1000, 1500}, rng),  // cells of several chunks, starting mid-row
        RandomTensor("cube", DType::kF32, {24, 10, 30}, rng),
        RandomTensor("vector", DType::kBF16, {333}, rng),
        RandomTensor("scalar", DType::kF32, {}, rng),
        RandomTensor("bytes", DType::kU8, {50, 40}, rng),
    };
    const double density = round % 3 == 0 ? 0.3 : 0.01;
    std::vector<OwnedTensor> target = PerturbAll(base, density, rng);
    EncodeOptions o;
    o.pool = round % 2 ? &pool : nullptr;
    o.grids = {{"matrix", RandomCuts(1000, rng), RandomCuts(1500, rng)},
               {"cube", RandomCuts(24, rng), RandomCuts(300, rng)},
               {"vector", RandomCuts(333, rng), {}},
               {"bytes", {25}, {1, 39}}};
    auto patch = EncodePatch(Views(base), Views(target), o);
    ASSERT_TRUE(patch.ok()) << patch.status().message();
    auto work = base;
    ASSERT_TRUE(codec::Apply(*patch, MutableViews(work), {}).ok());
    EXPECT_TRUE(testing::SameBits(work, target)) << "round " << round;

    auto keyframe = EncodeKeyframe(Views(target), o);
    ASSERT_TRUE(keyframe.ok());
    auto cold = PerturbAll(base, 1.0, rng);
    ASSERT_TRUE(codec::Apply(*keyframe, MutableViews(cold), {}).ok());
    EXPECT_TRUE(testing::SameBits(cold, target));

    // Merges chain over gridded patches: one patch from base to the third.
    auto third = PerturbAll(target, density, rng);
    auto second = EncodePatch(Views(target), Views(third), o);
    ASSERT_TRUE(second.ok());
    auto merged = MergePatches(*patch, *second, Views(base), o);
    ASSERT_TRUE(merged.ok()) << merged.status().message();
    work = base;
    ASSERT_TRUE(codec::Apply(*merged, MutableViews(work), {}).ok());
    EXPECT_TRUE(testing::SameBits(work, third));
    auto merged_keyframe = MergePatches(*keyframe, *second, {}, o);
    ASSERT_TRUE(merged_keyframe.ok()) << merged_keyframe.status().message();
    cold = PerturbAll(base, 1.0, rng);
    ASSERT_TRUE(codec::Apply(*merged_keyframe, MutableViews(cold), {}).ok());
    EXPECT_TRUE(testing::SameBits(cold, third));

    auto info = InspectPatch(*patch);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->tensors[3].row_cuts.size() + info->tensors[3].col_cuts.size(), 0u) << "the scalar has no grid";
    EXPECT_EQ(info->tensors[4].row_cuts, std::vector<uint64_t>{25});
  }
}

// The checksum of a tensor laid out in the bytes of its cells, one cell
// after the other in row-major order (the reference for the format's
// "Checksums": 1 MiB blocks of each cell in turn).
uint64_t CellBlocksChecksum(const OwnedTensor& t, const TileGrid& g) {
  const uint64_t rows = t.shape.empty() ? 1 : t.shape[0];
  const uint64_t width = DTypeWidth(t.dtype), cols = t.bytes.size() / width / rows;
  auto bands = [](std::vector<uint64_t> cuts, uint64_t n) {
    cuts.insert(cuts.begin(), 0);
    cuts.push_back(n);
    return cuts;
  };
  const auto rb = bands(g.row_cuts, rows), cb = bands(g.col_cuts, cols);
  std::vector<uint64_t> digests;
  for (size_t i = 0; i + 1 < rb.size(); ++i) {
    for (size_t j = 0; j + 1 < cb.size(); ++j) {
      std::vector<uint8_t> cell;
      for (uint64_t r = rb[i]; r < rb[i + 1]; ++r) {
        const uint8_t* row = t.bytes.data() + (r * cols + cb[j]) * width;
        cell.insert(cell.end(), row, row + (cb[j + 1] - cb[j]) * width);
      }
      for (size_t at = 0; at < cell.size(); at += kChecksumBlockBytes) {
        digests.push_back(BlockDigest(cell.data() + at, std::min(kChecksumBlockBytes, cell.size() - at)));
      }
    }
  }
  return CombineBlockDigests(digests);
}

// A gridded tensor's checksum is taken over its cells' blocks, in the sweep
// (no pass of its own): its flat checksum when the cells are flat runs at
// 1 MiB boundaries (rows cut there), another when cut by columns or
// elsewhere; patches, keyframes and a hashed base alike, and
// TensorChecksumOf / SetChecksum with the grids compute the same.
TEST(Tiles, TensorChecksumsAreTakenOverTheCells) {
  std::mt19937_64 rng(5);
  std::vector<OwnedTensor> base = {RandomTensor("rows", DType::kBF16, {2048, 1024}, rng),
                                   RandomTensor("cols", DType::kBF16, {1024, 1536}, rng),
                                   RandomTensor("odd", DType::kBF16, {1000, 1000}, rng),
                                   RandomTensor("both", DType::kF32, {700, 900}, rng)};
  auto target = PerturbAll(base, 0.01, rng);
  EncodeOptions o;
  o.grids = {{"rows", {512, 1536}, {}}, {"cols", {}, {768}}, {"odd", {333}, {}}, {"both", {350}, {100, 450}}};
  ThreadPool pool(3);
  auto patch = EncodePatch(Views(base), Views(target), o);
  auto keyframe = EncodeKeyframe(Views(target), o);
  ASSERT_TRUE(patch.ok() && keyframe.ok());
  auto p = InspectPatch(*patch), k = InspectPatch(*keyframe);
  for (size_t t = 0; t < target.size(); ++t) {
    const uint64_t cells = CellBlocksChecksum(target[t], o.grids[t]);
    EXPECT_EQ(p->tensors[t].target_checksum, cells) << target[t].name;
    EXPECT_EQ(k->tensors[t].target_checksum, cells) << target[t].name;
    auto of = TensorChecksumOf(Views(target)[t], &o.grids[t], &pool);
    ASSERT_TRUE(of.ok());
    EXPECT_EQ(*of, cells) << target[t].name;
    const uint64_t flat = TensorChecksum(target[t].bytes.data(), target[t].bytes.size());
    EXPECT_EQ(cells == flat, t == 0) << target[t].name << ": flat only when the cells are 1 MiB-aligned runs";
  }
  auto base_sum = SetChecksum(Views(base), o.grids, &pool);
  ASSERT_TRUE(base_sum.ok());
  EXPECT_EQ(p->base_set_checksum, *base_sum);
  EXPECT_NE(p->base_set_checksum, SetChecksum(Views(base)));
  EXPECT_EQ(TensorChecksumOf(Views(target)[1], nullptr).value(),
            TensorChecksum(target[1].bytes.data(), target[1].bytes.size()));
  TileGrid misfit{"cols", {}, {1536}};
  EXPECT_EQ(TensorChecksumOf(Views(target)[1], &misfit).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(SetChecksum(Views(target), std::vector<TileGrid>{{"nope", {1}, {}}}).status().code(),
            StatusCode::kInvalidArgument);
  // The tile digests (taken from the blocks where a chunk is one) verify.
  auto work = base;
  Status s = codec::Apply(*patch, MutableViews(work), {});
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_TRUE(testing::SameBits(work, target));
  std::vector<uint8_t> half(512 * 1024 * 2);
  std::memcpy(half.data(), base[0].bytes.data() + half.size(), half.size());
  std::vector<RuntimeTensor> layout = {{{"half", DType::kBF16, {512, 1024}, half.data()}, {{"rows", {512, 0}, {512, 1024}, {0, 0}}}}};
  s = codec::Apply(*patch, layout, {});
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(0, std::memcmp(half.data(), target[0].bytes.data() + half.size(), half.size()));
}

// Column tiles of several chunks each, chunks starting mid-row (each
// gathered from its rows): the patch is the same with and without threads,
// applies bit for bit whole and to a column shard, and its digests hold.
TEST(Tiles, ColumnTilesOfManyChunksRoundTrip) {
  std::mt19937_64 rng(11);
  std::vector<OwnedTensor> base = {RandomTensor("down", DType::kBF16, {2048, 2100}, rng),
                                   RandomTensor("wide", DType::kF32, {300, 3000}, rng)};
  auto target = PerturbAll(base, 0.02, rng);
  EncodeOptions o;
  o.grids = {{"down", {}, {700, 1400}}, {"wide", {100}, {1000, 2000}}};
  auto serial = EncodePatch(Views(base), Views(target), o);
  ThreadPool pool(3);
  o.pool = &pool;
  auto parallel = EncodePatch(Views(base), Views(target), o);
  ASSERT_TRUE(serial.ok() && parallel.ok());
  EXPECT_EQ(*serial, *parallel);
  auto info = InspectPatch(*serial);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tensors[0].chunks, 9u) << "three cells of 1.43 M elements: three chunks each";
  auto work = base;
  ASSERT_TRUE(codec::Apply(*serial, MutableViews(work), {}).ok());
  EXPECT_TRUE(testing::SameBits(work, target));
  std::vector<uint8_t> shard(2048 * 700 * 2);
  for (size_t r = 0; r < 2048; ++r) {
    std::memcpy(shard.data() + r * 1400, base[0].bytes.data() + (r * 2100 + 700) * 2, 1400);
  }
  std::vector<RuntimeTensor> layout = {
      {{"down.shard", DType::kBF16, {2048, 700}, shard.data()}, {{"down", {0, 700}, {2048, 700}, {0, 0}}}}};
  Status s = codec::Apply(*serial, layout, {});
  ASSERT_TRUE(s.ok()) << s.message();
  for (size_t r = 0; r < 2048; ++r) {
    ASSERT_EQ(0, std::memcmp(shard.data() + r * 1400, target[0].bytes.data() + (r * 2100 + 700) * 2, 1400)) << r;
  }
}

TEST(Tiles, AGridChangesNothingForTensorsWithoutOne) {
  std::mt19937_64 rng(3);
  std::vector<OwnedTensor> base = {RandomTensor("a", DType::kBF16, {512, 1024}, rng),
                                   RandomTensor("b", DType::kBF16, {300, 200}, rng)};
  auto target = PerturbAll(base, 0.01, rng);
  EncodeOptions flat, gridded;
  gridded.grids = {{"b", {150}, {}}};
  auto p0 = EncodePatch(Views(base), Views(target), flat);
  auto p1 = EncodePatch(Views(base), Views(target), gridded);
  ASSERT_TRUE(p0.ok() && p1.ok());
  auto i0 = InspectPatch(*p0), i1 = InspectPatch(*p1);
  EXPECT_EQ(i0->tensors[0].position_bytes + i0->tensors[0].value_bytes,
            i1->tensors[0].position_bytes + i1->tensors[0].value_bytes);
  EXPECT_EQ(i0->tensors[0].target_checksum, i1->tensors[0].target_checksum);
  EXPECT_EQ(i1->tensors[1].target_checksum, CellBlocksChecksum(target[1], gridded.grids[0]));
  EXPECT_EQ(i1->tensors[1].chunks, 2u);
}


class TensorParallel : public ::testing::TestWithParam<uint64_t> {};

TEST_P(TensorParallel, EveryRankAppliesExactlyItsPiecesFromThePatchOrItsSelection) {
  const uint64_t tp = GetParam();
  std::mt19937_64 rng(tp);
  const auto v0 = CanonicalModel(rng);
  const auto v1 = PerturbAll(v0, 0.02, rng);
  const auto v2 = PerturbAll(v1, 0.02, rng);
  std::vector<Rank> ranks = MakeRanks(tp);
  EncodeOptions o;
  o.grids = GridsFor(Layouts(ranks), Views(v0));
  for (const Rank& r : ranks) {
    Status s = ValidatePieces(r.layout, Views(v0), o.grids);
    ASSERT_TRUE(s.ok()) << s.message();
    if (tp > 1) {
      EXPECT_EQ(ValidatePieces(r.layout, Views(v0), {}).code(), StatusCode::kFailedPrecondition)
          << "shards of ungridded tensors";
    }
  }
  o.target_version = 1;
  auto keyframe = EncodeKeyframe(Views(v1), o);
  o.base_version = 1;
  o.target_version = 2;
  auto patch = EncodePatch(Views(v1), Views(v2), o);
  ASSERT_TRUE(keyframe.ok() && patch.ok()) << patch.status().message();
  const uint64_t whole = patch->size();
  uint64_t selected_payload = 0;
  for (uint64_t r = 0; r < tp; ++r) {
    // Cold start from the keyframe's selection, then the patch (whole for
    // even ranks, selected for odd ones).
    auto kf = SelectForPieces(*keyframe, ranks[r].layout);
    ASSERT_TRUE(kf.ok()) << kf.status().message();
    ASSERT_TRUE(codec::Apply(*kf, ranks[r].layout, {}).ok());
    EXPECT_TRUE(testing::SameBits(ranks[r].tensors, Expected(tp, r, v1))) << "rank " << r << " after the keyframe";
    auto sel = SelectForPieces(*patch, ranks[r].layout);
    ASSERT_TRUE(sel.ok()) << sel.status().message();
    auto info = InspectPatch(*sel);
    ASSERT_TRUE(info.ok());
    selected_payload += info->total_bytes - info->header_bytes;
    EXPECT_EQ(codec::Apply(*sel, MutableViews(ranks[r].tensors), {}).code(), StatusCode::kFailedPrecondition)
        << "a selection is not a whole patch";
    Status s = codec::Apply(r % 2 ? *sel : *patch, ranks[r].layout, {});
    ASSERT_TRUE(s.ok()) << s.message();
    EXPECT_TRUE(testing::SameBits(ranks[r].tensors, Expected(tp, r, v2))) << "rank " << r;
    if (tp > 1) {
      EXPECT_LT(sel->size(), whole) << "rank " << r;
    }
  }
  // Together the selections carry the patch once, plus the replicated kv
  // heads once per replica.
  auto info = InspectPatch(*patch);
  EXPECT_GE(selected_payload, info->total_bytes - info->header_bytes);
  EXPECT_LT(selected_payload, (info->total_bytes - info->header_bytes) * 5 / 4 + 4096);
}

INSTANTIATE_TEST_SUITE_P(Degrees, TensorParallel, ::testing::Values(1, 2, 4, 8));

TEST(Tiles, ACorruptTileFailsTheRankThatHoldsItAndNoOther) {
  std::mt19937_64 rng(11);
  const auto v0 = CanonicalModel(rng);
  const auto v1 = PerturbAll(v0, 0.05, rng);
  std::vector<Rank> ranks = MakeRanks(2);
  for (auto& r : ranks) Fill(&r, v0);
  EncodeOptions o;
  o.grids = GridsFor(Layouts(ranks), Views(v0));
  auto patch = EncodePatch(Views(v0), Views(v1), o);
  ASSERT_TRUE(patch.ok());
  // Rank 0's selection: every byte of its payload belongs to rank 0.
  auto sel0 = SelectForPieces(*patch, ranks[0].layout);
  ASSERT_TRUE(sel0.ok());
  auto info = InspectPatch(*sel0);
  const auto before = ranks[0].tensors;
  int detected = 0;
  for (int trial = 0; trial < 20; ++trial) {
    std::string bad = *sel0;
    const size_t at = info->header_bytes + rng() % (bad.size() - info->header_bytes);
    bad[at] = static_cast<char>(bad[at] ^ (1 << (rng() % 8)));
    ApplyOptions skip;
    skip.verify_patch_checksum = false;  // reach the tile digests
    Status s = codec::Apply(bad, ranks[0].layout, skip);
    ASSERT_FALSE(s.ok()) << "trial " << trial;
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.message();
    EXPECT_TRUE(testing::SameBits(ranks[0].tensors, before)) << "undone: " << s.message();
    ++detected;
  }
  EXPECT_EQ(detected, 20);
  // The other rank never reads those bytes: its selection applies.
  auto sel1 = SelectForPieces(*patch, ranks[1].layout);
  ASSERT_TRUE(codec::Apply(*sel1, ranks[1].layout, {}).ok());
  EXPECT_TRUE(testing::SameBits(ranks[1].tensors, Expected(2, 1, v1)));
  // Recovered: the intact patch applies to rank 0.
  ASSERT_TRUE(codec::Apply(*patch, ranks[0].layout, {}).ok());
  EXPECT_TRUE(testing::SameBits(ranks[0].tensors, Expected(2, 0, v1)));
}

TEST(Tiles, PiecesNotHoldingTheBaseAreRefusedAndUntouched) {
  std::mt19937_64 rng(12);
  const auto v0 = CanonicalModel(rng);
  const auto v1 = PerturbAll(v0, 0.05, rng);
  std::vector<Rank> ranks;
  ranks.push_back(MakeRank(2, 0));
  Fill(&ranks[0], PerturbAll(v0, 0.01, rng));  // not v0
  EncodeOptions o;
  o.grids = GridsFor(Layouts(ranks), Views(v0));
  auto patch = EncodePatch(Views(v0), Views(v1), o);
  const auto before = ranks[0].tensors;
  Status s = codec::Apply(*patch, ranks[0].layout, {});
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.message();
  EXPECT_NE(s.message().find("do not hold its base"), std::string::npos) << s.message();
  EXPECT_TRUE(testing::SameBits(ranks[0].tensors, before));
}

TEST(Tiles, LayoutsTheGridDoesNotHoldAreRefusedNamingThePiece) {
  std::mt19937_64 rng(13);
  const auto v0 = CanonicalModel(rng);
  const auto v1 = PerturbAll(v0, 0.05, rng);
  std::vector<Rank> tp2 = MakeRanks(2);
  EncodeOptions o;
  o.grids = GridsFor(Layouts(tp2), Views(v0));
  auto patch = EncodePatch(Views(v0), Views(v1), o);
  ASSERT_TRUE(patch.ok());
  Rank tp4 = MakeRank(4, 1);
  Status s = codec::Apply(*patch, tp4.layout, {});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("runtime tensor 'qkv' piece 0 (of 'q_proj')"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("tile grid does not include this layout"), std::string::npos) << s.message();

  // An ungridded tensor held in part.
  auto flat = EncodePatch(Views(v0), Views(v1), EncodeOptions{});
  s = codec::Apply(*flat, tp2[0].layout, {});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("does not grid"), std::string::npos) << s.message();

  // A tensor the patch lacks: Apply and the staged plan (the device's) refuse
  // it alike.
  Rank other = MakeRank(2, 0);
  other.layout[0].pieces[0].canonical = "nope";
  const Status refused = codec::Apply(*patch, other.layout, {});
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition);
  auto reader = staged::PatchReader::Open(*patch);
  ASSERT_TRUE(reader.ok());
  EXPECT_FALSE(reader->flat());
  const staged::PatchReader* parts[] = {&*reader};
  const Status planned = staged::PlanApply(parts, other.layout, {}, false).status();
  EXPECT_EQ(planned.code(), refused.code());
  EXPECT_EQ(planned.message(), refused.message());
}

TEST(Tiles, BadPiecesAndGridsAreRefusedAtRegistration) {
  std::mt19937_64 rng(14);
  const auto v0 = CanonicalModel(rng);
  std::vector<Rank> tp2 = MakeRanks(2);
  auto expect_invalid = [&](const Rank& r, const std::string& says) {
    Status s = ValidatePieces(r.layout, Views(v0), GridsFor(Layouts(tp2), Views(v0)));
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
    EXPECT_NE(s.message().find(says), std::string::npos) << s.message();
  };
  Rank r = MakeRank(2, 0);
  r.layout[0].pieces[1].extent[0] = 1000;
  expect_invalid(r, "outside the canonical tensor");
  r = MakeRank(2, 0);
  r.layout[0].pieces[2].runtime_start[0] = 0;  // v over q
  expect_invalid(r, "overlaps piece 0");
  r = MakeRank(2, 0);
  r.layout[0].pieces[0].start = {0};
  expect_invalid(r, "rank");
  r = MakeRank(2, 0);
  r.layout[0].view.dtype = DType::kF16;
  Status s = ValidatePieces(r.layout, Views(v0), GridsFor(Layouts(tp2), Views(v0)));
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("BF16"), std::string::npos) << s.message();

  // Grids naming no tensor, or cutting outside one.
  const auto v1 = PerturbAll(v0, 0.05, rng);
  EncodeOptions o;
  o.grids = {{"missing", {1}, {}}};
  EXPECT_EQ(EncodePatch(Views(v0), Views(v1), o).status().code(), StatusCode::kInvalidArgument);
  o.grids = {{"q_proj", {kQ}, {}}};
  auto bad = EncodePatch(Views(v0), Views(v1), o);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'q_proj'"), std::string::npos) << bad.status().message();
  o.grids = {{"q_proj", {8, 8}, {}}};
  EXPECT_EQ(EncodePatch(Views(v0), Views(v1), o).status().code(), StatusCode::kInvalidArgument);
}

// ---- Versions published by several sources, each a part of the tensors.

std::vector<OwnedTensor> Subset(const std::vector<OwnedTensor>& all, const std::set<std::string>& names) {
  std::vector<OwnedTensor> out;
  for (const auto& t : all) {
    if (names.count(t.name)) out.push_back(t);
  }
  return out;
}

const std::set<std::string> kPartA = {"q_proj", "k_proj", "v_proj", "q_bias"};
const std::set<std::string> kPartB = {"o_proj", "norm", "embed", "down"};

TEST(Parts, TwoPartsApplyAsOneAllOrNothing) {
  std::mt19937_64 rng(21);
  const auto v0 = CanonicalModel(rng);
  const auto v1 = PerturbAll(v0, 0.02, rng);
  const auto a0 = Subset(v0, kPartA), a1 = Subset(v1, kPartA), b0 = Subset(v0, kPartB), b1 = Subset(v1, kPartB);
  auto pa = EncodePatch(Views(a0), Views(a1), {});
  auto pb = EncodePatch(Views(b0), Views(b1), {});
  auto kb = EncodeKeyframe(Views(b1), {});
  ASSERT_TRUE(pa.ok() && pb.ok() && kb.ok());
  // Two patches; a patch and a keyframe (a part whose source restarted).
  for (const std::string* second : {&*pb, &*kb}) {
    auto work = v0;
    std::vector<std::string_view> parts = {*pa, *second};
    Status s = codec::Apply(parts, MutableViews(work), {});
    ASSERT_TRUE(s.ok()) << s.message();
    EXPECT_TRUE(testing::SameBits(work, v1));
  }
  // A corrupt second part: the first, applied already, is undone.
  std::string bad = *pb;
  bad[bad.size() - 20] ^= 0x10;
  auto work = v0;
  ApplyOptions skip;
  skip.verify_patch_checksum = false;
  std::vector<std::string_view> parts = {*pa, bad};
  EXPECT_FALSE(codec::Apply(parts, MutableViews(work), skip).ok());
  EXPECT_TRUE(testing::SameBits(work, v0)) << "nothing of the version applied";
  // A corrupt keyframe part: verified before the patch part is applied.
  std::string bad_kf = *kb;
  bad_kf[bad_kf.size() - 20] ^= 0x10;
  parts = {*pa, bad_kf};
  EXPECT_FALSE(codec::Apply(parts, MutableViews(work), skip).ok());
  EXPECT_TRUE(testing::SameBits(work, v0));
  // A tensor in two parts; a tensor in none.
  parts = {*pa, *pa};
  EXPECT_EQ(codec::Apply(parts, MutableViews(work), {}).code(), StatusCode::kFailedPrecondition);
  parts = {*pa};
  Status none = codec::Apply(parts, MutableViews(work), {});
  EXPECT_EQ(none.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(none.message().find("in no part"), std::string::npos) << none.message();
  EXPECT_TRUE(testing::SameBits(work, v0));
}

TEST(Parts, RanksApplyTheirPiecesOfEveryPartFromTheirSelections) {
  std::mt19937_64 rng(22);
  const auto v0 = CanonicalModel(rng);
  const auto v1 = PerturbAll(v0, 0.02, rng);
  std::vector<Rank> ranks = MakeRanks(4), ahead_ranks = MakeRanks(4);
  for (auto& r : ranks) Fill(&r, v0);
  for (auto& r : ahead_ranks) Fill(&r, v0);
  // Each source grids its own tensors for the served layouts.
  EncodeOptions oa, ob;
  oa.grids = GridsFor(Layouts(ranks), Views(Subset(v0, kPartA)));
  ob.grids = GridsFor(Layouts(ranks), Views(Subset(v0, kPartB)));
  auto pa = EncodePatch(Views(Subset(v0, kPartA)), Views(Subset(v1, kPartA)), oa);
  auto pb = EncodePatch(Views(Subset(v0, kPartB)), Views(Subset(v1, kPartB)), ob);
  ASSERT_TRUE(pa.ok() && pb.ok());
  for (uint64_t r = 0; r < 4; ++r) {
    auto sa = SelectForPieces(*pa, ranks[r].layout);
    auto sb = SelectForPieces(*pb, ranks[r].layout);
    ASSERT_TRUE(sa.ok() && sb.ok()) << sa.status().message() << sb.status().message();
    std::vector<std::string_view> parts = {*sa, *sb};
    Status s = codec::Apply(parts, ranks[r].layout, {});
    ASSERT_TRUE(s.ok()) << s.message();
    EXPECT_TRUE(testing::SameBits(ranks[r].tensors, Expected(4, r, v1))) << "rank " << r;
    // The same selections as one stream of two segments (as a source that
    // encodes in segments sends it), decoded ahead a few bytes at a time.
    const std::string stream = *sa + *sb;
    ApplyAhead ahead(ahead_ranks[r].layout, {});
    for (size_t at = 0; at <= stream.size(); at += 977) ahead.Advance(std::string_view(stream).substr(0, at));
    ahead.Advance(stream);
    EXPECT_GT(ahead.staged_ahead(), 0u);
    s = ahead.Apply(stream);
    ASSERT_TRUE(s.ok()) << s.message();
    EXPECT_TRUE(testing::SameBits(ahead_ranks[r].tensors, Expected(4, r, v1))) << "rank " << r << ", decoded ahead";
  }
  std::vector<std::string_view> only_a = {*pa};
  EXPECT_EQ(codec::Apply(only_a, ranks[0].layout, {}).code(), StatusCode::kFailedPrecondition)
      << "pieces of tensors no part has";
}

}  // namespace
}  // namespace wsync::codec
