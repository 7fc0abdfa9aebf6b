// Property tests: random tensors of every width and density round-trip bit
// for bit; merges equal sequential application; bad inputs are rejected
// without touching the destination.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "test_tensors.h"
#include "wsync/codec/codec.h"
#include "wsync/codec/staged.h"
#include "wsync/util/thread_pool.h"

namespace wsync::codec {
namespace {

using buffers::OwnedTensor;
using testing::Perturb;
using testing::RandomTensor;
using testing::SameBits;

StatusOr<std::string> Diff(const std::vector<OwnedTensor>& base, const std::vector<OwnedTensor>& target,
                           EncodeOptions options = {}) {
  return EncodePatch(buffers::Views(base), buffers::Views(target), options);
}

Status Apply(const std::string& patch, std::vector<OwnedTensor>& dst, ThreadPool* pool = nullptr) {
  ApplyOptions options;
  options.pool = pool;
  auto views = buffers::MutableViews(dst);
  return codec::Apply(patch, views, options);
}

struct Case {
  DType dtype;
  uint64_t elements;
  double density;
};

class RoundTrip : public ::testing::TestWithParam<std::tuple<DType, uint64_t, double, bool>> {};

TEST_P(RoundTrip, PatchReproducesTargetBits) {
  auto [dtype, elements, density, condition] = GetParam();
  std::mt19937_64 rng(elements * 31 + static_cast<uint64_t>(density * 1e6) + static_cast<int>(dtype));
  std::vector<OwnedTensor> base = {RandomTensor("w", dtype, {elements}, rng)};
  std::vector<OwnedTensor> target = {Perturb(base[0], density, rng)};
  EncodeOptions options;
  options.condition_on_base = condition;
  auto patch = Diff(base, target, options);
  ASSERT_TRUE(patch.ok()) << patch.status().ToString();
  auto dst = base;
  ThreadPool pool(2);
  Status s = Apply(*patch, dst, &pool);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(SameBits(dst, target));

  auto info = InspectPatch(*patch);
  ASSERT_TRUE(info.ok());
  uint64_t changed = 0;
  for (size_t i = 0; i < elements; ++i) {
    const size_t w = DTypeWidth(dtype);
    changed += std::memcmp(base[0].bytes.data() + i * w, target[0].bytes.data() + i * w, w) != 0;
  }
  EXPECT_EQ(info->tensors[0].changed, changed);
}

INSTANTIATE_TEST_SUITE_P(
    AllWidths, RoundTrip,
    ::testing::Combine(::testing::Values(DType::kBF16, DType::kF16, DType::kF32, DType::kF8E4M3, DType::kU8,
                                         DType::kI32, DType::kF64),
                       ::testing::Values(uint64_t{0}, uint64_t{1}, uint64_t{31}, uint64_t{33}, uint64_t{4099},
                                         uint64_t{(1 << 19) + 77}),
                       ::testing::Values(0.0, 1e-4, 1e-2, 0.5, 1.0), ::testing::Bool()),
    [](const auto& info) {
      std::string name = std::string(DTypeName(std::get<0>(info.param))) + "_" +
                         std::to_string(std::get<1>(info.param)) + "_d" +
                         std::to_string(static_cast<int>(std::get<2>(info.param) * 10000)) +
                         (std::get<3>(info.param) ? "_cond" : "_plain");
      return name;
    });

TEST(Patch, ManyTensorsOfMixedTypes) {
  std::mt19937_64 rng(7);
  std::vector<OwnedTensor> base, target;
  const DType types[] = {DType::kBF16, DType::kF32, DType::kF16, DType::kF8E5M2, DType::kI64, DType::kBool};
  for (int i = 0; i < 300; ++i) {
    DType t = types[i % 6];
    base.push_back(RandomTensor("t" + std::to_string(i), t, {static_cast<uint64_t>(1 + (i * 37) % 500), 3}, rng));
    target.push_back(Perturb(base.back(), (i % 5) * 0.05, rng));
  }
  auto patch = Diff(base, target);
  ASSERT_TRUE(patch.ok()) << patch.status().ToString();
  auto dst = base;
  ASSERT_TRUE(Apply(*patch, dst).ok());
  EXPECT_TRUE(SameBits(dst, target));
}

TEST(Patch, EncodingIsDeterministicAcrossThreadCounts) {
  std::mt19937_64 rng(11);
  std::vector<OwnedTensor> base = {RandomTensor("a", DType::kBF16, {3 << 20}, rng),
                                   RandomTensor("b", DType::kF32, {1 << 19}, rng)};
  std::vector<OwnedTensor> target = {Perturb(base[0], 0.01, rng), Perturb(base[1], 0.001, rng)};
  auto one = Diff(base, target);
  ThreadPool pool(3);
  EncodeOptions options;
  options.pool = &pool;
  auto many = Diff(base, target, options);
  ASSERT_TRUE(one.ok() && many.ok());
  EXPECT_EQ(*one, *many);
}

// A caller that knows the base's set checksum (a source: its head was the
// last target) gets the same patch without the base being hashed; the
// checksum it gives is the one recorded.
TEST(Patch, GivenBaseChecksumIsRecordedAndChangesNothingElse) {
  std::mt19937_64 rng(12);
  std::vector<OwnedTensor> base = {RandomTensor("a", DType::kBF16, {3 << 19}, rng),
                                   RandomTensor("b", DType::kF32, {1 << 16}, rng)};
  std::vector<OwnedTensor> target = {Perturb(base[0], 0.01, rng), Perturb(base[1], 0.001, rng)};
  ThreadPool pool(2);
  EncodeOptions options;
  options.pool = &pool;
  auto hashed = Diff(base, target, options);
  options.base_set_checksum = SetChecksum(buffers::Views(base));
  auto given = Diff(base, target, options);
  ASSERT_TRUE(hashed.ok() && given.ok());
  EXPECT_EQ(*hashed, *given);

  options.base_set_checksum = 42;
  auto told = Diff(base, target, options);
  ASSERT_TRUE(told.ok());
  auto info = InspectPatch(*told);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->base_set_checksum, 42u);
}

TEST(Patch, EveryChunkModeRoundTrips) {
  // Clustered changes favour runs, a middling density the bitmap, a full
  // change dense planes, scattered ones the sparse mode.
  std::mt19937_64 rng(5);
  const uint64_t n = 1 << 19;  // one chunk of BF16
  std::vector<OwnedTensor> base, target;
  for (int i = 0; i < 4; ++i) base.push_back(RandomTensor("m" + std::to_string(i), DType::kBF16, {n}, rng));
  target = base;
  auto* run = reinterpret_cast<uint16_t*>(target[0].bytes.data());
  for (uint64_t r = 0; r < 300; ++r) {
    for (uint64_t i = r * 1700 + rng() % 500, k = 0; k < 40; ++i, ++k) run[i] += (rng() & 1) ? 1 : -1;
  }
  target[1] = Perturb(base[1], 0.2, rng);
  auto* all = reinterpret_cast<uint16_t*>(target[2].bytes.data());
  for (uint64_t i = 0; i < n; ++i) all[i] = static_cast<uint16_t>(rng());
  target[3] = Perturb(base[3], 0.001, rng);
  auto patch = Diff(base, target);
  ASSERT_TRUE(patch.ok());
  auto info = InspectPatch(*patch);
  ASSERT_TRUE(info.ok());
  uint32_t modes[5] = {};
  for (const auto& t : info->tensors) {
    for (int m = 0; m < 5; ++m) modes[m] += t.mode_counts[m];
  }
  EXPECT_GT(modes[1], 0u) << "sparse";
  EXPECT_GT(modes[3], 0u) << "runs";
  EXPECT_GT(modes[2] + modes[4], 0u) << "bitmap or dense";
  EXPECT_GT(modes[4], 0u) << "dense";
  auto dst = base;
  ASSERT_TRUE(Apply(*patch, dst).ok());
  EXPECT_TRUE(SameBits(dst, target));
}

TEST(Patch, WrongBaseIsRejectedAndUndone) {
  std::mt19937_64 rng(3);
  std::vector<OwnedTensor> base = {RandomTensor("w", DType::kBF16, {100000}, rng)};
  std::vector<OwnedTensor> target = {Perturb(base[0], 0.01, rng)};
  auto patch = Diff(base, target);
  ASSERT_TRUE(patch.ok());
  std::vector<OwnedTensor> other = {Perturb(base[0], 0.01, rng)};
  auto dst = other;
  Status s = Apply(*patch, dst);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("base version"), std::string::npos) << s.message();
  EXPECT_TRUE(SameBits(dst, other)) << "destination must be restored";
}

TEST(Patch, MismatchedDestinationIsRejected) {
  std::mt19937_64 rng(4);
  std::vector<OwnedTensor> base = {RandomTensor("w", DType::kBF16, {64}, rng)};
  auto patch = Diff(base, base);
  ASSERT_TRUE(patch.ok());
  std::vector<OwnedTensor> wrong_shape = {RandomTensor("w", DType::kBF16, {65}, rng)};
  EXPECT_EQ(Apply(*patch, wrong_shape).code(), StatusCode::kFailedPrecondition);
  std::vector<OwnedTensor> wrong_name = {RandomTensor("v", DType::kBF16, {64}, rng)};
  EXPECT_EQ(Apply(*patch, wrong_name).code(), StatusCode::kFailedPrecondition);
  std::vector<OwnedTensor> extra = {base[0], RandomTensor("x", DType::kBF16, {4}, rng)};
  EXPECT_EQ(Apply(*patch, extra).code(), StatusCode::kFailedPrecondition);
}

TEST(Patch, EncodeRejectsMismatchedSets) {
  std::mt19937_64 rng(6);
  std::vector<OwnedTensor> a = {RandomTensor("w", DType::kBF16, {8}, rng)};
  std::vector<OwnedTensor> b = {RandomTensor("w", DType::kF32, {8}, rng)};
  EXPECT_EQ(Diff(a, b).status().code(), StatusCode::kInvalidArgument);
  std::vector<OwnedTensor> twice = {a[0], a[0]};
  EXPECT_EQ(Diff(twice, twice).status().code(), StatusCode::kInvalidArgument);
  EncodeOptions bad;
  bad.chunk_bytes = 3 << 20;
  EXPECT_EQ(Diff(a, a, bad).status().code(), StatusCode::kInvalidArgument);
}

TEST(Keyframe, RoundTripsAndNeedsNoBase) {
  std::mt19937_64 rng(8);
  std::vector<OwnedTensor> target = {RandomTensor("a", DType::kBF16, {(1 << 20) + 3}, rng),
                                     RandomTensor("b", DType::kF32, {1000}, rng),
                                     RandomTensor("c", DType::kU8, {0}, rng)};
  auto kf = EncodeKeyframe(buffers::Views(target), {});
  ASSERT_TRUE(kf.ok());
  std::vector<OwnedTensor> dst = target;
  for (auto& t : dst) std::fill(t.bytes.begin(), t.bytes.end(), 0xAB);
  ASSERT_TRUE(Apply(*kf, dst).ok());
  EXPECT_TRUE(SameBits(dst, target));
  auto info = InspectPatch(*kf);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->kind, PatchKind::kKeyframe);
}

// v0 -> v1 -> v2 -> v3: merged patches equal sequential application.
class MergeChain : public ::testing::TestWithParam<bool> {};

TEST_P(MergeChain, EqualsSequentialApply) {
  const bool condition = GetParam();
  std::mt19937_64 rng(condition ? 21 : 22);
  std::vector<std::vector<OwnedTensor>> v(4);
  v[0] = {RandomTensor("a", DType::kBF16, {(1 << 20) + 100}, rng), RandomTensor("b", DType::kF32, {5000}, rng),
          RandomTensor("c", DType::kF8E4M3, {777}, rng)};
  for (int k = 1; k < 4; ++k) {
    for (const auto& t : v[k - 1]) v[k].push_back(Perturb(t, 0.01 * k, rng));
  }
  EncodeOptions options;
  options.condition_on_base = condition;
  std::vector<std::string> p;
  for (int k = 1; k < 4; ++k) {
    auto d = Diff(v[k - 1], v[k], options);
    ASSERT_TRUE(d.ok());
    p.push_back(*d);
  }
  auto base = buffers::Views(v[0]);
  std::span<const TensorView> merge_base = condition ? std::span<const TensorView>(base) : std::span<const TensorView>();
  auto p02 = MergePatches(p[0], p[1], merge_base, options);
  ASSERT_TRUE(p02.ok()) << p02.status().ToString();
  auto p03 = MergePatches(*p02, p[2], merge_base, options);
  ASSERT_TRUE(p03.ok()) << p03.status().ToString();
  auto dst = v[0];
  ASSERT_TRUE(Apply(*p03, dst).ok());
  EXPECT_TRUE(SameBits(dst, v[3]));
  // A change and its reversal merge to nothing.
  auto back = Diff(v[1], v[0], options);
  ASSERT_TRUE(back.ok());
  auto none = MergePatches(p[0], *back, merge_base, options);
  ASSERT_TRUE(none.ok());
  auto info = InspectPatch(*none);
  ASSERT_TRUE(info.ok());
  for (const auto& t : info->tensors) EXPECT_EQ(t.changed, 0u) << t.name;
}

INSTANTIATE_TEST_SUITE_P(ConditionedOrNot, MergeChain, ::testing::Bool());

TEST(Merge, ConditionedPatchesNeedTheBase) {
  std::mt19937_64 rng(30);
  std::vector<OwnedTensor> v0 = {RandomTensor("a", DType::kBF16, {100000}, rng)};
  std::vector<OwnedTensor> v1 = {testing::PerturbByExponent(v0[0], 0.01, 120, rng)};
  std::vector<OwnedTensor> v2 = {testing::PerturbByExponent(v1[0], 0.01, 120, rng)};
  auto p01 = Diff(v0, v1), p12 = Diff(v1, v2);
  ASSERT_TRUE(p01.ok() && p12.ok());
  ASSERT_GT(InspectPatch(*p01)->tensors[0].conditioned_chunks, 0u) << "the coder should use the base here";
  auto merged = MergePatches(*p01, *p12, {}, {});
  EXPECT_EQ(merged.status().code(), StatusCode::kFailedPrecondition) << merged.status().ToString();
  // Patches that do not chain.
  auto p02 = Diff(v0, v2);
  auto bad = MergePatches(*p01, *p02, buffers::Views(v0), {});
  EXPECT_EQ(bad.status().code(), StatusCode::kFailedPrecondition);
  // A base that is not the first patch's base.
  auto wrong = MergePatches(*p01, *p12, buffers::Views(v1), {});
  EXPECT_EQ(wrong.status().code(), StatusCode::kFailedPrecondition);
}

TEST(Merge, KeyframePlusPatchIsKeyframeOfTarget) {
  std::mt19937_64 rng(31);
  std::vector<OwnedTensor> v0 = {RandomTensor("a", DType::kBF16, {300000}, rng)};
  std::vector<OwnedTensor> v1 = {Perturb(v0[0], 0.01, rng)};
  auto kf0 = EncodeKeyframe(buffers::Views(v0), {});
  auto p01 = Diff(v0, v1);
  ASSERT_TRUE(kf0.ok() && p01.ok());
  auto kf1 = MergePatches(*kf0, *p01, {}, {});
  ASSERT_TRUE(kf1.ok()) << kf1.status().ToString();
  std::vector<OwnedTensor> dst = {RandomTensor("a", DType::kBF16, {300000}, rng)};
  ASSERT_TRUE(Apply(*kf1, dst).ok());
  EXPECT_TRUE(SameBits(dst, v1));
}

// The class count per chunk stays within EncodeOptions::max_classes, and
// fewer classes cost size, never bits.
TEST(Patch, MaxClassesBoundsEveryChunksClasses) {
  std::mt19937_64 rng(41);
  std::vector<OwnedTensor> v0 = {RandomTensor("a", DType::kBF16, {3 << 19}, rng)};
  std::vector<OwnedTensor> v1 = {testing::PerturbByExponent(v0[0], 0.01, 120, rng)};
  size_t previous_size = 0;
  for (int max : {8, 3, 1}) {
    SCOPED_TRACE("max_classes " + std::to_string(max));
    EncodeOptions options;
    options.max_classes = max;
    auto p = Diff(v0, v1, options);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    auto reader = staged::PatchReader::Open(*p);
    ASSERT_TRUE(reader.ok());
    int most = 0;
    for (size_t i = 0; i < reader->chunks().size(); ++i) {
      staged::DecodedChunk d;
      ASSERT_TRUE(reader->DecodePositions(i, &d).ok());
      most = std::max(most, d.spec.k);
    }
    EXPECT_LE(most, max);
    if (max == 8) {
      EXPECT_GT(most, 3) << "this data should want many classes";
    }
    if (max == 1) {
      EXPECT_EQ(InspectPatch(*p)->tensors[0].conditioned_chunks, 0u);
    }
    EXPECT_GT(p->size(), previous_size);
    previous_size = p->size();
    auto dst = v0;
    ASSERT_TRUE(Apply(*p, dst).ok());
    EXPECT_TRUE(SameBits(dst, v1));
  }
  for (int bad : {0, 9}) {
    EncodeOptions options;
    options.max_classes = bad;
    EXPECT_EQ(Diff(v0, v1, options).status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

// The encoder chooses classes once per run of chunks (ClassSourceChunk) of
// a tensor: a run's chunks carry the same classes, runs never cross
// tensors, and the patch is exact whatever classes a chunk is given.
TEST(Patch, ChunksOfARunShareTheirClasses) {
  std::mt19937_64 rng(43);
  const uint64_t chunk = 1 << 19;  // BF16 elements of a 1 MiB chunk
  std::vector<OwnedTensor> v0 = {RandomTensor("a", DType::kBF16, {10 * chunk}, rng),
                                 RandomTensor("b", DType::kBF16, {2 * chunk + chunk / 2}, rng)};
  std::vector<OwnedTensor> v1 = {testing::PerturbByExponent(v0[0], 0.01, 120, rng),
                                 testing::PerturbByExponent(v0[1], 0.005, 126, rng)};
  auto p = Diff(v0, v1);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  auto reader = staged::PatchReader::Open(*p);
  ASSERT_TRUE(reader.ok());
  auto key = [](const ClassSpec& s) { return std::vector<int>{s.k, s.thr[0], s.thr[1], s.thr[2], s.thr[3]}; };
  std::map<std::pair<size_t, size_t>, std::vector<int>> runs;  // (tensor, run's first chunk) -> classes
  for (size_t i = 0; i < reader->chunks().size(); ++i) {
    const staged::Chunk& c = reader->chunks()[i];
    staged::DecodedChunk d;
    ASSERT_TRUE(reader->DecodePositions(i, &d).ok());
    ASSERT_GT(d.spec.k, 1) << "chunk " << i << " should be conditioned";
    auto [it, fresh] = runs.emplace(std::make_pair(c.tensor, ClassSourceChunk(c.index)), key(d.spec));
    EXPECT_EQ(it->second, key(d.spec)) << "tensor " << c.tensor << " chunk " << c.index;
  }
  EXPECT_EQ(runs.size(), 3u);  // a: chunks 0-7 and 8-9; b: 0-2
  auto dst = v0;
  ASSERT_TRUE(Apply(*p, dst).ok());
  EXPECT_TRUE(SameBits(dst, v1));
}

TEST(Analyze, BoundsAreOrdered) {
  std::mt19937_64 rng(40);
  std::vector<OwnedTensor> base = {RandomTensor("a", DType::kBF16, {200000}, rng)};
  std::vector<OwnedTensor> target = {Perturb(base[0], 0.01, rng)};
  auto stats = AnalyzeDiff(buffers::Views(base), buffers::Views(target));
  ASSERT_TRUE(stats.ok());
  EXPECT_GT(stats->changed, 1000u);
  EXPECT_LE(stats->ConditionalBits(), stats->Order0Bits() + 1e-6);
  EXPECT_GT(stats->ConditionalBits(), 0);
}

}  // namespace
}  // namespace wsync::codec
