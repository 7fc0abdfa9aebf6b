// Streams of segments (several containers back to back) and ApplyAhead,
// which decodes them while they arrive: the result must be bit for bit the
// one of applying the whole stream at once, however the bytes are sliced,
// and all or nothing.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <set>

#include "test_tensors.h"
#include "wsync/util/thread_pool.h"

namespace wsync::codec {
namespace {

using buffers::MutableViews;
using buffers::OwnedTensor;
using buffers::Views;
using testing::RandomTensor;

// Tensors of several 1 MiB chunks each, and small ones.
std::vector<OwnedTensor> Model(std::mt19937_64& rng) {
  std::vector<OwnedTensor> m;
  m.push_back(RandomTensor("embed", DType::kBF16, {1536, 1024}, rng));
  m.push_back(RandomTensor("q", DType::kBF16, {1024, 1024}, rng));
  m.push_back(RandomTensor("norm", DType::kF32, {1024}, rng));
  m.push_back(RandomTensor("mlp", DType::kBF16, {2560, 1024}, rng));
  m.push_back(RandomTensor("head", DType::kF32, {600, 1024}, rng));
  return m;
}

std::vector<OwnedTensor> Step(const std::vector<OwnedTensor>& base, std::mt19937_64& rng) {
  std::vector<OwnedTensor> out;
  for (const auto& t : base) {
    out.push_back(t.dtype == DType::kBF16 ? testing::PerturbByExponent(t, 0.01, 120, rng)
                                          : testing::Perturb(t, 0.01, rng));
  }
  return out;
}

std::vector<OwnedTensor> Only(const std::vector<OwnedTensor>& all, const std::set<std::string>& names) {
  std::vector<OwnedTensor> out;
  for (const auto& t : all) {
    if (names.count(t.name)) out.push_back(t);
  }
  return out;
}

const std::vector<std::set<std::string>> kGroups = {{"embed"}, {"q", "norm"}, {"mlp", "head"}};

// The patch base -> target as one segment per group.
std::string Segmented(const std::vector<OwnedTensor>& base, const std::vector<OwnedTensor>& target) {
  std::string out;
  for (const auto& g : kGroups) {
    auto p = EncodePatch(Views(Only(base, g)), Views(Only(target, g)), {});
    EXPECT_TRUE(p.ok()) << p.status().message();
    out += *p;
  }
  return out;
}

// Feeds `stream` to `ahead` in random slices (1 byte to 1.5 MiB).
void Feed(ApplyAhead& ahead, const std::string& stream, std::mt19937_64& rng) {
  std::uniform_int_distribution<size_t> slice(1, 3 << 19);
  std::string prefix;
  for (size_t at = 0; at < stream.size();) {
    const size_t n = std::min(stream.size() - at, rng() % 4 == 0 ? size_t{1} : slice(rng));
    prefix.append(stream, at, n);
    at += n;
    ahead.Advance(prefix);
  }
}

TEST(Streams, SplitSegmentsFindsEachContainerAndNamesTruncation) {
  std::mt19937_64 rng(1);
  const auto v0 = Model(rng);
  const auto v1 = Step(v0, rng);
  const std::string s = Segmented(v0, v1);
  auto parts = SplitSegments(s);
  ASSERT_TRUE(parts.ok()) << parts.status().message();
  ASSERT_EQ(parts->size(), kGroups.size());
  size_t total = 0;
  for (auto p : *parts) {
    EXPECT_TRUE(InspectPatch(p).ok());
    total += p.size();
  }
  EXPECT_EQ(total, s.size());
  auto cut = SplitSegments(std::string_view(s).substr(0, s.size() - 1));
  EXPECT_EQ(cut.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(cut.status().message().find("segment 2"), std::string::npos) << cut.status().message();
  auto junk = SplitSegments(s + "garbage that is no preamble at all, forty bytes or more");
  EXPECT_EQ(junk.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(junk.status().message().find("segment 3"), std::string::npos) << junk.status().message();
  EXPECT_FALSE(SplitSegments("").ok());
}

TEST(Streams, JoinedSegmentsAreTheContainerOfTheWholeSet) {
  std::mt19937_64 rng(7);
  const auto v0 = Model(rng);
  const auto v1 = Step(v0, rng);
  const std::string stream = Segmented(v0, v1);
  auto segments = SplitSegments(stream);
  ASSERT_TRUE(segments.ok());
  auto joined = JoinSegments(*segments, SetChecksum(Views(v0)));
  ASSERT_TRUE(joined.ok()) << joined.status().message();
  auto whole = EncodePatch(Views(v0), Views(v1), {});
  ASSERT_TRUE(whole.ok());
  EXPECT_TRUE(*joined == *whole) << "the same bytes as encoding every tensor at once";
  // Keyframes too (no base checksum).
  std::string kfs;
  for (const auto& g : kGroups) kfs += *EncodeKeyframe(Views(Only(v1, g)), {});
  auto kf_segments = SplitSegments(kfs);
  ASSERT_TRUE(kf_segments.ok());
  auto kf = JoinSegments(*kf_segments, 0);
  ASSERT_TRUE(kf.ok());
  EXPECT_TRUE(*kf == *EncodeKeyframe(Views(v1), {}));
  // Segments that do not belong together.
  std::vector<std::string_view> twice = {(*segments)[0], (*segments)[0]};
  EXPECT_EQ(JoinSegments(twice, 0).status().code(), StatusCode::kInvalidArgument);
  std::vector<std::string_view> mixed = {(*segments)[0], (*kf_segments)[1]};
  EXPECT_EQ(JoinSegments(mixed, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(JoinSegments({}, 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(Streams, EncodeSegmentedHandsOutEachSegmentAndJoinsThem) {
  std::mt19937_64 rng(8);
  const auto v0 = Model(rng);
  const auto v1 = Step(v0, rng);
  EncodeOptions o;
  o.base_version = 4;
  o.target_version = 5;
  // 3 MiB segments: embed (3 MiB), then q + norm + mlp (2 + 5 MiB), then head.
  const auto groups = SegmentGroups(Views(v1), 3 << 20);
  ASSERT_EQ(groups.size(), 3u);
  EXPECT_EQ(groups[0], std::make_pair(size_t{0}, size_t{1}));
  EXPECT_EQ(groups[1], std::make_pair(size_t{1}, size_t{4}));
  EXPECT_EQ(groups[2], std::make_pair(size_t{4}, size_t{5}));
  EXPECT_EQ(SegmentGroups(Views(v1), 0).size(), 1u);
  EXPECT_EQ(SegmentGroups(Views(v1), uint64_t{1} << 40).size(), 1u);
  std::string streamed;
  std::vector<size_t> order;
  auto joined = EncodeSegmented(Views(v0), Views(v1), o, 3 << 20, {}, [&](size_t k, std::string_view segment) {
    order.push_back(k);
    streamed += segment;
    return Status::Ok();
  });
  ASSERT_TRUE(joined.ok()) << joined.status().message();
  EXPECT_EQ(order, (std::vector<size_t>{0, 1, 2}));
  EXPECT_TRUE(*joined == *EncodePatch(Views(v0), Views(v1), o)) << "joined: the whole-set encode";
  auto work = v0;
  ApplyAhead ahead(MutableViews(work), {});
  Feed(ahead, streamed, rng);
  ASSERT_TRUE(ahead.Apply(streamed).ok());
  EXPECT_TRUE(testing::SameBits(work, v1)) << "the segments as streamed";
  // Base checksums given (a source's last target's): the same bytes.
  auto sums = TensorChecksums(Views(v0), {});
  ASSERT_TRUE(sums.ok());
  auto given = EncodeSegmented(Views(v0), Views(v1), o, 3 << 20, *sums, nullptr);
  ASSERT_TRUE(given.ok());
  EXPECT_TRUE(*given == *joined);
  // The callback's error ends the encode; wrong counts are refused.
  auto stopped = EncodeSegmented(Views(v0), Views(v1), o, 3 << 20, {},
                                 [](size_t k, std::string_view) { return k == 1 ? CancelledError("puller gone") : Status::Ok(); });
  EXPECT_EQ(stopped.status().code(), StatusCode::kCancelled);
  std::vector<uint64_t> short_sums(2);
  EXPECT_EQ(EncodeSegmented(Views(v0), Views(v1), o, 3 << 20, short_sums, nullptr).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(Streams, DecodingAheadInAnySlicesGivesTheSameBitsAsApplyingAtOnce) {
  std::mt19937_64 rng(2);
  ThreadPool pool(3);
  const auto v0 = Model(rng);
  const auto v1 = Step(v0, rng);
  const std::string segmented = Segmented(v0, v1);
  auto single = EncodePatch(Views(v0), Views(v1), {});
  ASSERT_TRUE(single.ok());
  for (const std::string* stream : {&segmented, static_cast<const std::string*>(&*single)}) {
    for (int trial = 0; trial < 4; ++trial) {
      auto work = v0;
      ApplyOptions o;
      o.pool = trial % 2 ? &pool : nullptr;
      ApplyAhead ahead(MutableViews(work), o);
      Feed(ahead, *stream, rng);
      EXPECT_TRUE(testing::SameBits(work, v0)) << "nothing is written before Apply";
      EXPECT_GT(ahead.staged_ahead(), 10u);
      Status s = ahead.Apply(*stream);
      ASSERT_TRUE(s.ok()) << s.message();
      EXPECT_TRUE(testing::SameBits(work, v1));
    }
  }
  // Fed part of the stream only (the rest decoded by Apply), or nothing.
  for (size_t fed : {size_t{0}, size_t{100}, segmented.size() / 2}) {
    auto work = v0;
    ApplyAhead ahead(MutableViews(work), {});
    ahead.Advance(std::string_view(segmented).substr(0, fed));
    ASSERT_TRUE(ahead.Apply(segmented).ok());
    EXPECT_TRUE(testing::SameBits(work, v1));
  }
}

TEST(Streams, PrepareChecksAndDecodesEverythingSoThatApplyOnlyWrites) {
  std::mt19937_64 rng(7);
  const auto v0 = Model(rng);
  const auto v1 = Step(v0, rng);
  const std::string stream = Segmented(v0, v1);
  // Decoded ahead up to half the stream, prepared: every chunk is decoded, nothing written.
  auto work = v0;
  ApplyAhead ahead(MutableViews(work), {});
  ahead.Advance(std::string_view(stream).substr(0, stream.size() / 2));
  const size_t half = ahead.staged_ahead();
  ASSERT_TRUE(ahead.Prepare(stream).ok());
  EXPECT_GT(ahead.staged_ahead(), half) << "the rest, the last segment's chunks too";
  EXPECT_TRUE(testing::SameBits(work, v0)) << "Prepare writes nothing";
  ASSERT_TRUE(ahead.Apply(stream).ok());
  EXPECT_TRUE(testing::SameBits(work, v1));

  // A corrupt stream fails in Prepare, before anything may be written, and in Apply.
  std::string bad = stream;
  bad[bad.size() - 7] ^= 0x20;
  auto untouched = v0;
  ApplyAhead refused(MutableViews(untouched), {});
  Feed(refused, bad, rng);
  EXPECT_EQ(refused.Prepare(bad).code(), StatusCode::kDataLoss);
  EXPECT_EQ(refused.Apply(bad).code(), StatusCode::kDataLoss);
  EXPECT_TRUE(testing::SameBits(untouched, v0));

  // Prepared for one stream, applied with another: the other is applied, not a mix.
  const std::string single = *EncodePatch(Views(v0), Views(v1), {});
  auto other = v0;
  ApplyAhead switched(MutableViews(other), {});
  ASSERT_TRUE(switched.Prepare(stream).ok());
  ASSERT_TRUE(switched.Apply(single).ok());
  EXPECT_TRUE(testing::SameBits(other, v1));
}

// A keyframe within ApplyOptions::keyframe_keep_bytes is decoded once, when
// it is checked before the writes: Apply copies what Prepare kept (bytes
// changed under it afterwards do not reach the weights). Over the budget it
// is decoded again in Apply.
TEST(Streams, AKeyframeKeptFromItsCheckIsCopiedInNotDecodedAgain) {
  std::mt19937_64 rng(9);
  const auto v0 = Model(rng);
  const auto v1 = Step(v0, rng);
  auto kf = EncodeKeyframe(Views(v1), {});
  ASSERT_TRUE(kf.ok());
  for (const uint64_t keep : {uint64_t{0}, uint64_t{1} << 30}) {
    std::string stream = *kf;
    auto work = v0;
    ApplyOptions o;
    o.keyframe_keep_bytes = keep;
    ApplyAhead ahead(MutableViews(work), o);
    ASSERT_TRUE(ahead.Prepare(stream).ok());
    EXPECT_TRUE(testing::SameBits(work, v0)) << "Prepare writes nothing";
    for (size_t i = stream.size() / 2; i < stream.size(); i += 97) stream[i] ^= 0x5a;
    const Status s = ahead.Apply(stream);
    if (keep != 0) {
      ASSERT_TRUE(s.ok()) << s.message();
      EXPECT_TRUE(testing::SameBits(work, v1)) << "the values checked, copied in";
    } else {
      EXPECT_FALSE(s.ok() && testing::SameBits(work, v1)) << "decoded again, from the bytes as they are now";
    }
  }
  // Kept or not, a keyframe applied at once gives the same bits.
  const std::string whole = *EncodeKeyframe(Views(v1), {});
  for (const uint64_t keep : {uint64_t{0}, uint64_t{1} << 30}) {
    auto work = v0;
    ApplyOptions o;
    o.keyframe_keep_bytes = keep;
    const auto views = MutableViews(work);
    ASSERT_TRUE(Apply(whole, views, o).ok());
    EXPECT_TRUE(testing::SameBits(work, v1));
  }
}

TEST(Streams, AKeyframeSegmentAndPatchSegmentsApplyAsOne) {
  std::mt19937_64 rng(3);
  const auto v0 = Model(rng);
  const auto v1 = Step(v0, rng);
  auto kf = EncodeKeyframe(Views(Only(v1, kGroups[0])), {});
  auto rest = EncodePatch(Views(Only(v0, {"q", "norm", "mlp", "head"})), Views(Only(v1, {"q", "norm", "mlp", "head"})), {});
  ASSERT_TRUE(kf.ok() && rest.ok());
  const std::string stream = *kf + *rest;
  auto work = v0;
  ApplyAhead ahead(MutableViews(work), {});
  Feed(ahead, stream, rng);
  Status s = ahead.Apply(stream);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_TRUE(testing::SameBits(work, v1));
}

TEST(Streams, ACorruptLaterSegmentUndoesEverySegment) {
  std::mt19937_64 rng(4);
  const auto v0 = Model(rng);
  const auto v1 = Step(v0, rng);
  std::string stream = Segmented(v0, v1);
  auto segments = SplitSegments(stream);
  ASSERT_TRUE(segments.ok());
  // A flipped byte in the last segment's last stream.
  stream[stream.size() - 7] ^= 0x20;
  for (bool verify : {true, false}) {
    auto work = v0;
    ApplyOptions o;
    o.verify_patch_checksum = verify;
    ApplyAhead ahead(MutableViews(work), o);
    Feed(ahead, stream, rng);
    Status s = ahead.Apply(stream);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.message();
    EXPECT_TRUE(testing::SameBits(work, v0)) << "every segment undone (verify " << verify << ")";
  }
  // A stream other than the one read ahead: applied as given, not mixed.
  auto work = v0;
  ApplyAhead ahead(MutableViews(work), {});
  const std::string good = Segmented(v0, v1);
  Feed(ahead, stream, rng);
  ASSERT_TRUE(ahead.Apply(good).ok());
  EXPECT_TRUE(testing::SameBits(work, v1));
}

TEST(Streams, WeightsChangedAfterDecodingAheadAreNeverMixedInSilently) {
  std::mt19937_64 rng(5);
  const auto v0 = Model(rng);
  const auto v1 = Step(v0, rng);
  const std::string stream = Segmented(v0, v1);
  auto work = v0;
  ApplyAhead ahead(MutableViews(work), {});
  Feed(ahead, stream, rng);
  // Someone writes the destination between the decoding and the apply:
  // refused (the destination as it was) or, where the write is at a value
  // the patch does not change, found by Confirm.
  work[3].bytes[4096] ^= 0x01;
  const auto changed = work;
  Status s = ahead.Apply(stream);
  if (s.ok()) {
    EXPECT_EQ(ahead.Confirm().code(), StatusCode::kDataLoss);
  } else {
    EXPECT_TRUE(s.code() == StatusCode::kFailedPrecondition || s.code() == StatusCode::kDataLoss) << s.message();
    EXPECT_TRUE(testing::SameBits(work, changed)) << "undone to what it held";
  }
}

// Element indices of tensor t where v0 and v1 differ (changed) or not.
std::vector<size_t> Elements(const OwnedTensor& a, const OwnedTensor& b, bool changed) {
  std::vector<size_t> out;
  const size_t w = DTypeWidth(a.dtype);
  for (size_t i = 0; i * w < a.bytes.size(); ++i) {
    if ((std::memcmp(&a.bytes[i * w], &b.bytes[i * w], w) != 0) == changed) out.push_back(i);
  }
  return out;
}

TEST(Streams, AWriteAtAChangedValueAfterStagingIsFoundAndUndoneByApply) {
  std::mt19937_64 rng(11);
  const auto v0 = Model(rng);
  const auto v1 = Step(v0, rng);
  const std::string stream = Segmented(v0, v1);
  for (size_t t : {size_t{0}, size_t{3}, size_t{4}}) {
    auto work = v0;
    ThreadPool pool(2);
    ApplyOptions options;
    options.pool = &pool;
    ApplyAhead ahead(MutableViews(work), options);
    Feed(ahead, stream, rng);
    ASSERT_TRUE(ahead.Prepare(stream).ok());
    // A foreign writer changes a value the patch changes too, late in the tensor.
    const std::vector<size_t> at = Elements(v0[t], v1[t], /*changed=*/true);
    ASSERT_FALSE(at.empty());
    const size_t e = at[at.size() * 3 / 4] * DTypeWidth(v0[t].dtype);
    work[t].bytes[e] ^= 0x40;
    const auto written = work;
    Status s = ahead.Apply(stream);
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.message();
    EXPECT_NE(s.message().find(v0[t].name), std::string::npos) << s.message();
    EXPECT_TRUE(testing::SameBits(work, written)) << "every value written is put back: " << v0[t].name;
  }
}

// Staging keeps at most ApplyOptions::stage_keep_bytes of a version's
// changes: the chunks past it are checked before the writes like the others
// (a corrupt patch is refused with nothing written), decoded again by Apply
// in groups the budget holds, and the result is the same bits.
TEST(Streams, ChangesPastTheStagingBudgetAreCheckedFirstAndDecodedAgainWhenWritten) {
  std::mt19937_64 rng(13);
  const auto v0 = Model(rng);
  const auto v1 = Step(v0, rng);
  const std::string stream = Segmented(v0, v1);
  ThreadPool pool(2);
  for (uint64_t budget : {uint64_t{0}, uint64_t{1} << 16, uint64_t{1} << 20}) {
    SCOPED_TRACE(budget);
    ApplyOptions options;
    options.pool = &pool;
    options.stage_keep_bytes = budget;
    auto work = v0;
    ApplyAhead ahead(MutableViews(work), options);
    Feed(ahead, stream, rng);
    ASSERT_TRUE(ahead.Prepare(stream).ok());
    EXPECT_TRUE(testing::SameBits(work, v0)) << "Prepare writes nothing";
    ASSERT_TRUE(ahead.Apply(stream).ok());
    EXPECT_TRUE(testing::SameBits(work, v1));
    EXPECT_GT(ahead.decoded_again(), 0u) << ahead.staged_ahead();
    EXPECT_TRUE(ahead.Confirm().ok());
    // The same through Apply without reading ahead.
    auto once = v0;
    const auto segments = SplitSegments(stream);
    ASSERT_TRUE(segments.ok());
    ASSERT_TRUE(Apply(*segments, Destination(MutableViews(once)), options).ok());
    EXPECT_TRUE(testing::SameBits(once, v1));

    std::string bad = stream;
    bad[bad.size() - 7] ^= 0x20;
    auto untouched = v0;
    ApplyAhead refused(MutableViews(untouched), options);
    EXPECT_EQ(refused.Prepare(bad).code(), StatusCode::kDataLoss);
    EXPECT_TRUE(testing::SameBits(untouched, v0)) << "a corrupt patch is refused before the writes";
  }
  auto kept = v0;
  ApplyAhead unbounded(MutableViews(kept), {});
  ASSERT_TRUE(unbounded.Apply(stream).ok());
  EXPECT_EQ(unbounded.decoded_again(), 0u) << "no bound by default";
}

// Past the staging budget a value another writer changed since the check is
// found before its group is written: in the first group everything is put
// back; in a later one the groups written before cannot be, and Apply says
// the weights hold neither version.
TEST(Streams, AWriteInAChunkPastTheStagingBudgetIsFoundBeforeItIsWritten) {
  std::mt19937_64 rng(14);
  const auto v0 = Model(rng);
  const auto v1 = Step(v0, rng);
  const std::string stream = Segmented(v0, v1);
  for (size_t t : {size_t{0}, size_t{4}}) {
    SCOPED_TRACE(v0[t].name);
    ApplyOptions options;
    options.stage_keep_bytes = 0;  // no change kept: every chunk a group of its own, in order
    auto work = v0;
    ApplyAhead ahead(MutableViews(work), options);
    ASSERT_TRUE(ahead.Prepare(stream).ok());
    const std::vector<size_t> at = Elements(v0[t], v1[t], /*changed=*/true);
    ASSERT_FALSE(at.empty());
    const size_t e = at.front() * DTypeWidth(v0[t].dtype);  // in the tensor's first chunk
    work[t].bytes[e] ^= 0x40;
    const auto written = work;
    Status s = ahead.Apply(stream);
    EXPECT_NE(s.message().find("'" + v0[t].name + "'"), std::string::npos) << s.message();
    if (t == 0) {
      EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.message();
      EXPECT_TRUE(testing::SameBits(work, written)) << "found in the first group: nothing written stays";
    } else {
      EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.message();
      EXPECT_NE(s.message().find("holds neither version"), std::string::npos) << s.message();
      work[t].bytes[e] ^= 0x40;
      EXPECT_TRUE(testing::SameBits(Only(work, {"embed", "q", "norm"}), Only(v1, {"embed", "q", "norm"})))
          << "the segments before it are written";
    }
  }
}

TEST(Streams, AWriteAtAnUnchangedValueAfterStagingIsFoundByConfirm) {
  std::mt19937_64 rng(12);
  const auto v0 = Model(rng);
  const auto v1 = Step(v0, rng);
  const std::string stream = Segmented(v0, v1);
  auto work = v0;
  ApplyAhead ahead(MutableViews(work), {});
  Feed(ahead, stream, rng);
  ASSERT_TRUE(ahead.Prepare(stream).ok());
  const std::vector<size_t> at = Elements(v0[1], v1[1], /*changed=*/false);
  ASSERT_FALSE(at.empty());
  work[1].bytes[at[at.size() / 2] * 2] ^= 0x01;
  ASSERT_TRUE(ahead.Apply(stream).ok()) << "the pause writes only the changed values";
  Status s = ahead.Confirm();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("'q'"), std::string::npos) << s.message();
  work[1].bytes[at[at.size() / 2] * 2] ^= 0x01;
  EXPECT_TRUE(testing::SameBits(work, v1)) << "everything else is the version";
  EXPECT_TRUE(ahead.Confirm().ok());
}

TEST(Streams, APatchForAnotherBaseIsRefusedBeforeTheWrites) {
  std::mt19937_64 rng(13);
  const auto v0 = Model(rng);
  const auto v1 = Step(v0, rng);
  const auto v2 = Step(v1, rng);
  const std::string stream = Segmented(v1, v2);  // the destination holds v0
  auto work = v0;
  ApplyAhead ahead(MutableViews(work), {});
  Feed(ahead, stream, rng);
  Status s = ahead.Prepare(stream);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.message();
  EXPECT_NE(s.message().find("base"), std::string::npos) << s.message();
  EXPECT_TRUE(testing::SameBits(work, v0));
  EXPECT_EQ(ahead.Apply(stream).code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(testing::SameBits(work, v0));
}

TEST(Streams, TheContractsOfApplyPartsHold) {
  std::mt19937_64 rng(6);
  const auto v0 = Model(rng);
  const auto v1 = Step(v0, rng);
  auto a = EncodePatch(Views(Only(v0, kGroups[0])), Views(Only(v1, kGroups[0])), {});
  ASSERT_TRUE(a.ok());
  auto work = v0;
  // A tensor in no segment; one in two.
  for (const std::string& stream : {*a, *a + *a}) {
    ApplyAhead ahead(MutableViews(work), {});
    Feed(ahead, stream, rng);
    Status s = ahead.Apply(stream);
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.message();
    EXPECT_TRUE(testing::SameBits(work, v0));
  }
  // Garbage fed ahead: Apply says what is wrong.
  ApplyAhead ahead(MutableViews(work), {});
  const std::string junk(4096, 'x');
  ahead.Advance(junk);
  EXPECT_EQ(ahead.Apply(junk).code(), StatusCode::kDataLoss);
}

}  // namespace
}  // namespace wsync::codec
