// The source's version history on the real RL snapshots: every (from, head)
// pull is a patch that takes version `from` to the head bit for bit; unknown
// or forgotten versions get a keyframe; Retain frees the past.
#include "version_history.h"

#include <gtest/gtest.h>

#include <cstring>
#include <future>
#include <random>

#include "../codec/test_tensors.h"
#include "wsync/util/thread_pool.h"

namespace wsync::daemon {
namespace {

using buffers::OwnedTensor;

std::vector<std::vector<OwnedTensor>> Chain(int n) {
  std::mt19937_64 rng(5);
  std::vector<std::vector<OwnedTensor>> v(n);
  v[0] = {testing::RandomTensor("a", codec::DType::kBF16, {300000}, rng),
          testing::RandomTensor("b", codec::DType::kF32, {1000}, rng)};
  for (int k = 1; k < n; ++k) {
    v[k] = {testing::PerturbByExponent(v[k - 1][0], 0.01, 120, rng), testing::Perturb(v[k - 1][1], 0.01, rng)};
  }
  return v;
}

std::vector<OwnedTensor> ApplyStream(const PatchStream& s, std::vector<OwnedTensor> dst) {
  auto views = buffers::MutableViews(dst);
  Status st = codec::Apply(s.Assemble(), views, {});
  EXPECT_TRUE(st.ok()) << st.ToString();
  return dst;
}

TEST(VersionHistory, ServesMergedPatchesAndKeyframes) {
  auto v = Chain(6);  // versions 1..6 are v[0..5]
  ThreadPool pool(2);
  VersionHistory::Options o;
  o.encode.pool = &pool;
  o.stream_chunk_bytes = 4096;
  VersionHistory h(o);
  for (int k = 0; k < 6; ++k) {
    auto pub = h.Publish(k + 1, buffers::Views(v[k]));
    ASSERT_TRUE(pub.ok()) << pub.status().ToString();
    EXPECT_EQ(pub->base_version, k == 0 ? 0u : static_cast<uint64_t>(k));
    EXPECT_EQ(pub->set_checksum, codec::SetChecksum(buffers::Views(v[k])));
  }
  EXPECT_EQ(h.Publish(6, buffers::Views(v[5])).status().code(), StatusCode::kFailedPrecondition);
  for (uint64_t from = 1; from < 6; ++from) {
    auto s = h.Open(from, 6);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_EQ((*s)->kind(), codec::PatchKind::kPatch);
    EXPECT_TRUE(testing::SameBits(ApplyStream(**s, v[from - 1]), v[5])) << "from " << from;
    // Each published patch names its base by the base's real set checksum
    // (the source passes the head's, known from its own publish).
    auto info = codec::InspectPatch((*h.Open(from, from + 1))->Assemble());
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->base_set_checksum, codec::SetChecksum(buffers::Views(v[from - 1]))) << "from " << from;
  }
  // A keyframe for a sink that holds nothing.
  auto kf = h.Open(0, 6);
  ASSERT_TRUE(kf.ok());
  EXPECT_EQ((*kf)->kind(), codec::PatchKind::kKeyframe);
  std::vector<OwnedTensor> empty = v[0];
  for (auto& t : empty) std::fill(t.bytes.begin(), t.bytes.end(), 0);
  EXPECT_TRUE(testing::SameBits(ApplyStream(**kf, empty), v[5]));
  // Forget versions before 4: from 2 now gets a keyframe, from 4 a patch.
  ASSERT_TRUE(h.Retain(4).ok());
  EXPECT_EQ(h.oldest(), 4u);
  EXPECT_EQ((*h.Open(2, 6))->kind(), codec::PatchKind::kKeyframe);
  auto p46 = h.Open(4, 6);
  ASSERT_TRUE(p46.ok());
  EXPECT_EQ((*p46)->kind(), codec::PatchKind::kPatch);
  EXPECT_TRUE(testing::SameBits(ApplyStream(**p46, v[3]), v[5]));
  // Intermediate targets too, and nothing outside what is held.
  EXPECT_TRUE(testing::SameBits(ApplyStream(**h.Open(4, 5), v[3]), v[4]));
  EXPECT_EQ(h.Open(1, 3).status().code(), StatusCode::kNotFound);
  // A layout change is refused.
  std::vector<OwnedTensor> other = {v[5][0]};
  EXPECT_EQ(h.Publish(7, buffers::Views(other)).status().code(), StatusCode::kInvalidArgument);
}

// Publishing copies the caller owns (the source's return-after-copy path):
// the same patches as publishing views, the previous head's buffers come
// back for the next copy, and a refused publish leaves the copy alone.
TEST(VersionHistory, OwnedCopiesBecomeTheHeadWithoutAnotherCopy) {
  auto v = Chain(4);
  VersionHistory::Options o;
  VersionHistory by_view(o), by_copy(o);
  std::vector<OwnedTensor> spare;
  for (int k = 0; k < 4; ++k) {
    ASSERT_TRUE(by_view.Publish(k + 1, buffers::Views(v[k])).ok());
    std::vector<OwnedTensor> copy = spare.empty() ? buffers::CopyTensors(buffers::Views(v[k])) : std::move(spare);
    ASSERT_TRUE(buffers::CopyInto(buffers::Views(v[k]), copy, nullptr).ok());
    const uint8_t* taken = copy[0].bytes.data();
    auto pub = by_copy.Publish(k + 1, &copy);
    ASSERT_TRUE(pub.ok()) << pub.status().ToString();
    EXPECT_EQ(pub->set_checksum, codec::SetChecksum(buffers::Views(v[k])));
    ASSERT_TRUE(buffers::SameLayout(copy, buffers::Views(v[k])));
    EXPECT_NE(copy[0].bytes.data(), taken);  // the old head's buffers, not ours
    spare = std::move(copy);
  }
  for (uint64_t from = 1; from < 4; ++from) {
    EXPECT_EQ((*by_copy.Open(from, 4))->Assemble(), (*by_view.Open(from, 4))->Assemble()) << "from " << from;
  }
  // Refused (not above the head): the copy is untouched.
  std::vector<OwnedTensor> again = v[3];
  const uint8_t* mine = again[0].bytes.data();
  EXPECT_EQ(by_copy.Publish(4, &again).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(again[0].bytes.data(), mine);
  EXPECT_TRUE(testing::SameBits(again, v[3]));
  // CopyInto refuses another layout and copies nothing.
  std::vector<OwnedTensor> other = {v[3][0]};
  EXPECT_EQ(buffers::CopyInto(buffers::Views(v[0]), other, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(testing::SameBits(other, {v[3][0]}));
}

// Versions whose weights live elsewhere (the device path): the head's host
// copy is loaded only when a keyframe of the head is needed.
TEST(VersionHistory, LoadsALazyHeadOnlyForKeyframes) {
  auto v = Chain(4);
  VersionHistory h({});
  int loads = 0;
  for (int k = 0; k < 4; ++k) {
    const auto views = buffers::Views(v[k]);
    VersionHistory::NewVersion next;
    next.layout = views;
    next.encode = [&](std::span<const codec::TensorView> head, const codec::EncodeOptions& eo) {
      return codec::EncodePatch(buffers::Views(v[k - 1]), views, eo);  // what the device computes
    };
    next.fill = [&](std::vector<OwnedTensor>& head) {
      head = v[k];
      return Status::Ok();
    };
    next.load_head = [&, k](std::vector<OwnedTensor>& head) {
      ++loads;
      head = v[k];
      return Status::Ok();
    };
    ASSERT_TRUE(h.Publish(k + 1, next).ok());
  }
  EXPECT_EQ(loads, 0);
  auto merged = h.Open(2, 4);  // from the chain: no head copy needed
  ASSERT_TRUE(merged.ok());
  EXPECT_TRUE(testing::SameBits(ApplyStream(**merged, v[1]), v[3]));
  EXPECT_EQ(loads, 0);
  auto kf = h.Open(0, 4);
  ASSERT_TRUE(kf.ok());
  EXPECT_EQ(loads, 1);
  std::vector<OwnedTensor> zero = v[0];
  for (auto& t : zero) std::fill(t.bytes.begin(), t.bytes.end(), 0);
  EXPECT_TRUE(testing::SameBits(ApplyStream(**kf, zero), v[3]));
  EXPECT_TRUE(h.MaterializeHead().ok());
  EXPECT_EQ(loads, 1);
}

// A gate for Options::before_build: the build of `key` stops there until
// Open() is called on the gate (other builds pass).
struct BuildGate {
  std::pair<uint64_t, uint64_t> key;
  std::promise<void> entered, open;
  std::shared_future<void> opened = open.get_future().share();
  std::atomic<int> builds{0};
  std::function<void(uint64_t, uint64_t)> Hook() {
    return [this](uint64_t from, uint64_t to) {
      if (std::make_pair(from, to) != key) return;
      if (builds++ == 0) entered.set_value();
      opened.wait();
    };
  }
};

std::vector<OwnedTensor> Zeros(const std::vector<OwnedTensor>& like) {
  std::vector<OwnedTensor> z = like;
  for (auto& t : z) std::fill(t.bytes.begin(), t.bytes.end(), 0);
  return z;
}

// Issue 19: a late sink's keyframe was built under the lock Publish takes,
// so it stalled the trainer for as long as the build. Now the build runs
// outside it: with a keyframe build held mid-way, publishes and Retain
// finish, a second pull of the same keyframe waits for the one build, and
// the keyframe is still exactly its version.
TEST(VersionHistory, PublishNeverWaitsForAKeyframeBuild) {
  auto v = Chain(7);
  BuildGate gate;
  gate.key = {0, 2};
  VersionHistory::Options o;
  o.before_build = gate.Hook();
  VersionHistory h(o);
  for (int k = 0; k < 3; ++k) ASSERT_TRUE(h.Publish(k + 1, buffers::Views(v[k])).ok());
  auto late = std::async(std::launch::async, [&] { return h.Open(0, 2); });
  auto again = std::async(std::launch::async, [&] { return h.Open(0, 2); });
  gate.entered.get_future().wait();
  auto publishing = std::async(std::launch::async, [&] {
    for (int k = 3; k < 6; ++k) {
      if (Status s = h.Publish(k + 1, buffers::Views(v[k])).status(); !s.ok()) return s;
    }
    return h.Retain(2);  // the oldest copy moves while the build may read it
  });
  const bool finished = publishing.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  if (!finished) gate.open.set_value();  // let the build go, so the test ends
  ASSERT_TRUE(finished) << "a publish waited for a pull's keyframe";
  ASSERT_TRUE(publishing.get().ok());
  EXPECT_EQ(h.head(), 6u);
  EXPECT_EQ(h.oldest(), 2u);
  EXPECT_EQ(late.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout);
  gate.open.set_value();
  auto kf = late.get();
  auto kf2 = again.get();
  ASSERT_TRUE(kf.ok()) << kf.status().ToString();
  ASSERT_TRUE(kf2.ok());
  EXPECT_EQ(kf->get(), kf2->get()) << "one build for two pulls";
  EXPECT_EQ(gate.builds.load(), 1);
  EXPECT_TRUE(testing::SameBits(ApplyStream(**kf, Zeros(v[0])), v[1]));
  // The history after all that still serves every version exactly.
  auto merged = h.Open(2, 6);
  ASSERT_TRUE(merged.ok()) << merged.status().ToString();
  EXPECT_TRUE(testing::SameBits(ApplyStream(**merged, v[1]), v[5]));
  auto head_kf = h.Open(0, 6);
  ASSERT_TRUE(head_kf.ok());
  EXPECT_TRUE(testing::SameBits(ApplyStream(**head_kf, Zeros(v[0])), v[5]));
}

// A version larger than a segment is encoded in segments and its patch from
// the head is served while it is encoded: a puller has the first segment
// before the last is encoded, and the stream (segments back to back) takes
// the head to the version bit for bit. What else a puller asks of that
// version waits for its encode; the stored patch is the whole-set encode.
TEST(VersionHistory, AVersionIsServedWhileItIsEncodedInSegments) {
  std::mt19937_64 rng(9);
  std::vector<std::vector<OwnedTensor>> v(3);
  for (const char* name : {"a", "b", "c", "d"}) {
    v[0].push_back(testing::RandomTensor(name, codec::DType::kBF16, {600000}, rng));
  }
  for (int k = 1; k < 3; ++k) {
    for (const auto& t : v[k - 1]) v[k].push_back(testing::PerturbByExponent(t, 0.01, 120, rng));
  }
  std::promise<void> first_segment, go_on;
  auto go = go_on.get_future().share();
  std::vector<PublishedVersion> early;
  VersionHistory::Options o;
  o.stream_chunk_bytes = 4096;
  o.segment_bytes = 1 << 20;  // one tensor (1.2 MB) per segment
  o.on_stream = [&](const PublishedVersion& p) { early.push_back(p); };
  o.after_segment = [&, paused = false](size_t k) mutable {
    if (k == 0 && !paused && !early.empty() && early.back().version == 2) {
      paused = true;
      first_segment.set_value();
      go.wait();
    }
  };
  VersionHistory h(o);
  ASSERT_TRUE(h.Publish(1, buffers::Views(v[0])).ok());
  EXPECT_TRUE(early.empty()) << "the first version is a keyframe, encoded whole";
  auto publishing = std::async(std::launch::async, [&] { return h.Publish(2, buffers::Views(v[1])); });
  if (first_segment.get_future().wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    go_on.set_value();
    (void)publishing.get();
    FAIL() << "version 2 was not encoded in segments";
  }
  ASSERT_EQ(early.size(), 1u);
  EXPECT_EQ(early[0].version, 2u);
  EXPECT_EQ(early[0].base_version, 1u);
  EXPECT_EQ(early[0].set_checksum, 0u) << "not known yet";
  auto live = h.Open(1, 2);
  ASSERT_TRUE(live.ok()) << live.status().ToString();
  EXPECT_FALSE((*live)->sized()) << "a growing stream";
  ASSERT_TRUE((*live)->Wait(0, std::chrono::steady_clock::now() + std::chrono::seconds(5)).ok())
      << "the first segment is there before the rest is encoded";
  auto keyframe = std::async(std::launch::async, [&] { return h.Open(0, 2); });
  // A sink holding tensor b whole as its one piece: its selection of the
  // version being encoded, once it is encoded.
  std::vector<OwnedTensor> held = {v[0][1]};
  held[0].name = "held-b";
  std::vector<codec::RuntimeTensor> layout = {
      {{held[0].name, held[0].dtype, held[0].shape, held[0].bytes.data()}, {{"b", {0}, {600000}, {0}}}}};
  h.SetServedLayouts({layout});
  auto selection = std::async(std::launch::async, [&] { return h.OpenFor(1, 2, codec::LayoutFingerprint(layout), 0); });
  EXPECT_EQ(keyframe.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout)
      << "a keyframe of the version waits for its encode";
  go_on.set_value();
  auto pub = publishing.get();
  ASSERT_TRUE(pub.ok()) << pub.status().ToString();
  EXPECT_EQ(pub->set_checksum, codec::SetChecksum(buffers::Views(v[1])));
  ASSERT_TRUE((*live)->WaitComplete(std::chrono::steady_clock::now() + std::chrono::seconds(5)).ok());
  const std::string streamed = (*live)->Assemble();
  auto segments = codec::SplitSegments(streamed);
  ASSERT_TRUE(segments.ok());
  EXPECT_EQ(segments->size(), 4u);
  auto work = v[0];
  ASSERT_TRUE(codec::Apply(*segments, buffers::MutableViews(work), {}).ok());
  EXPECT_TRUE(testing::SameBits(work, v[1])) << "the streamed segments";
  auto kf = keyframe.get();
  ASSERT_TRUE(kf.ok()) << kf.status().ToString();
  auto selected = selection.get();
  ASSERT_TRUE(selected.ok()) << selected.status().ToString();
  const std::string selected_bytes = (*selected)->Assemble();
  auto selected_segments = codec::SplitSegments(selected_bytes);
  ASSERT_TRUE(selected_segments.ok());
  EXPECT_LT(selected_bytes.size(), streamed.size() / 2) << "b's chunks only";
  ASSERT_TRUE(codec::Apply(*selected_segments, layout, {}).ok());
  EXPECT_EQ(held[0].bytes, v[1][1].bytes) << "the piece holds version 2 of b";
  EXPECT_TRUE(testing::SameBits(ApplyStream(**kf, Zeros(v[0])), v[1]));
  auto stored = h.Open(1, 2);
  ASSERT_TRUE(stored.ok());
  codec::EncodeOptions versions;
  versions.base_version = 1;
  versions.target_version = 2;
  EXPECT_TRUE((*stored)->Assemble() == *codec::EncodePatch(buffers::Views(v[0]), buffers::Views(v[1]), versions))
      << "the history keeps the segments as one container";
  // The next version streams from this one; merges across both are exact.
  ASSERT_TRUE(h.Publish(3, buffers::Views(v[2])).ok());
  EXPECT_EQ(early.size(), 2u);
  auto merged = h.Open(1, 3);
  ASSERT_TRUE(merged.ok());
  EXPECT_TRUE(testing::SameBits(ApplyStream(**merged, v[0]), v[2]));
}

// A merge reading the oldest copy while Retain moves it forward: Retain
// moves a copy, the merge sees the old weights, both are exact.
TEST(VersionHistory, RetainDoesNotWriteWhatAMergeReads) {
  auto v = Chain(6);
  BuildGate gate;
  gate.key = {1, 4};
  VersionHistory::Options o;
  o.before_build = gate.Hook();
  VersionHistory h(o);
  for (int k = 0; k < 5; ++k) ASSERT_TRUE(h.Publish(k + 1, buffers::Views(v[k])).ok());
  auto merge = std::async(std::launch::async, [&] { return h.Open(1, 4); });
  gate.entered.get_future().wait();
  ASSERT_TRUE(h.Retain(3).ok());
  EXPECT_EQ(h.oldest(), 3u);
  gate.open.set_value();
  auto m = merge.get();
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_TRUE(testing::SameBits(ApplyStream(**m, v[0]), v[3]));
  EXPECT_EQ(h.Open(1, 4).status().code(), StatusCode::kOk) << "1 is gone: a keyframe instead";
  auto from3 = h.Open(3, 5);
  ASSERT_TRUE(from3.ok());
  EXPECT_TRUE(testing::SameBits(ApplyStream(**from3, v[2]), v[4]));
}

// Issue 19: the cache evicted the lowest (from, to) first, which are the
// keyframes, the costliest entries to rebuild. Now stored patches (free to
// serve again) go before a keyframe that is in use.
TEST(VersionHistory, EvictionKeepsWhatIsCostlyToRebuild) {
  auto v = Chain(8);
  VersionHistory::Options o;
  o.cache_entries = 3;
  VersionHistory h(o);
  for (int k = 0; k < 8; ++k) ASSERT_TRUE(h.Publish(k + 1, buffers::Views(v[k])).ok());
  ASSERT_TRUE(h.Open(0, 7).ok());  // a late sink's keyframe: built
  const auto built = h.cache_stats().builds;
  for (uint64_t from = 1; from < 7; ++from) {
    ASSERT_TRUE(h.Open(from, from + 1).ok());  // sinks one step behind: stored patches
    ASSERT_TRUE(h.Open(0, 7).ok());            // more late sinks
  }
  const auto stats = h.cache_stats();
  EXPECT_EQ(stats.builds, built) << "the keyframe was evicted and built again";
  EXPECT_GE(stats.evictions, 3u);
  EXPECT_LE(stats.entries, 3u);
  // A byte bound: one keyframe's worth keeps the newest entry only.
  VersionHistory::Options small;
  small.cache_bytes = 1;
  VersionHistory tiny(small);
  for (int k = 0; k < 3; ++k) ASSERT_TRUE(tiny.Publish(k + 1, buffers::Views(v[k])).ok());
  ASSERT_TRUE(tiny.Open(0, 3).ok());
  ASSERT_TRUE(tiny.Open(1, 3).ok());
  EXPECT_EQ(tiny.cache_stats().entries, 1u);
}

// A source serving two halves of tensor "a" (rows of its [600, 500] view):
// every version is coded on their grid; each half pulls its selection, which
// applies into that half alone, bit for bit; a layout not served gets the
// whole stream; the grid cannot change while versions are kept.
TEST(VersionHistory, ServesEachServedLayoutItsSelection) {
  auto v = Chain(3);
  for (auto& version : v) version[0].shape = {600, 500};
  VersionHistory h(VersionHistory::Options{});
  std::vector<std::vector<codec::RuntimeTensor>> halves;
  std::vector<std::vector<OwnedTensor>> held(2);
  for (uint64_t r = 0; r < 2; ++r) {
    OwnedTensor t{"a.half", codec::DType::kBF16, {300, 500}, std::vector<uint8_t>(300 * 500 * 2)};
    held[r].push_back(std::move(t));
    halves.push_back({{{"a.half", codec::DType::kBF16, {300, 500}, held[r][0].bytes.data()},
                       {{"a", {r * 300, 0}, {300, 500}, {0, 0}}}}});
  }
  auto canonical = buffers::Views(v[0]);
  ASSERT_TRUE(h.SetGrids(codec::GridsFor(halves, canonical)).ok());
  h.SetServedLayouts(halves);
  for (int k = 0; k < 3; ++k) ASSERT_TRUE(h.Publish(k + 1, buffers::Views(v[k])).ok());
  auto whole = h.Open(0, 3);
  ASSERT_TRUE(whole.ok());
  for (uint64_t r = 0; r < 2; ++r) {
    const uint64_t fp = codec::LayoutFingerprint(halves[r]);
    auto keyframe = h.OpenFor(0, 2, fp, 0);
    auto patch = h.OpenFor(2, 3, fp, 0);
    ASSERT_TRUE(keyframe.ok() && patch.ok());
    EXPECT_LT((*keyframe)->total_bytes(), (*h.Open(0, 2))->total_bytes() * 6 / 10) << "half " << r;
    ASSERT_TRUE(codec::Apply((*keyframe)->Assemble(), halves[r], {}).ok());
    Status s = codec::Apply((*patch)->Assemble(), halves[r], {});
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(0, std::memcmp(held[r][0].bytes.data(), v[2][0].bytes.data() + r * 300 * 500 * 2, 300 * 500 * 2))
        << "half " << r << " holds its rows of version 3";
    EXPECT_EQ(*h.OpenFor(2, 3, fp, 0), *patch) << "kept";
  }
  EXPECT_EQ((*h.OpenFor(0, 3, 12345, 0))->total_bytes(), (*whole)->total_bytes()) << "a layout not served: the whole";
}

// New grids (the layouts served changed) keep the head and drop the versions
// below it: pulls from them get keyframes; later patches, merged ones too,
// are coded on the new grids against the head's checksum on them.
TEST(VersionHistory, NewGridsKeepTheHeadAndDropWhatIsBelowIt) {
  auto v = Chain(5);
  for (auto& version : v) version[0].shape = {600, 500};
  ThreadPool pool(2);
  VersionHistory::Options o;
  o.encode.pool = &pool;
  BuildGate gate;
  gate.key = {0, 3};
  o.before_build = gate.Hook();
  VersionHistory h(o);
  const std::vector<codec::TileGrid> rows = {{"a", {300}, {}}}, cols = {{"a", {}, {100, 250}}};
  ASSERT_TRUE(h.SetGrids(rows).ok());
  for (int k = 0; k < 3; ++k) ASSERT_TRUE(h.Publish(k + 1, buffers::Views(v[k])).ok());
  ASSERT_TRUE(h.SetGrids(rows).ok()) << "the same grids change nothing";
  EXPECT_EQ(h.oldest(), 1u);
  // A keyframe of the head under way when the grids change: its puller gets
  // it, nobody after (it is not cached: it may be coded on the old grids).
  auto late = std::async(std::launch::async, [&] { return h.Open(0, 3); });
  gate.entered.get_future().wait();
  ASSERT_TRUE(h.SetGrids(cols).ok());
  EXPECT_EQ(h.oldest(), 3u);
  gate.open.set_value();
  auto old_kf = late.get();
  ASSERT_TRUE(old_kf.ok());
  EXPECT_TRUE(testing::SameBits(ApplyStream(**old_kf, Zeros(v[0])), v[2]));
  auto new_kf = h.Open(0, 3);
  ASSERT_TRUE(new_kf.ok());
  EXPECT_EQ(gate.builds.load(), 2) << "built again on the new grids";
  EXPECT_EQ(codec::InspectPatch((*new_kf)->Assemble())->tensors[0].col_cuts, cols[0].col_cuts);
  EXPECT_TRUE(testing::SameBits(ApplyStream(**new_kf, Zeros(v[0])), v[2]));
  EXPECT_EQ((*h.Open(1, 3))->kind(), codec::PatchKind::kKeyframe) << "version 1 is no longer kept";
  for (int k = 3; k < 5; ++k) {
    auto pub = h.Publish(k + 1, buffers::Views(v[k]));
    ASSERT_TRUE(pub.ok()) << pub.status().ToString();
    EXPECT_EQ(pub->set_checksum, *codec::SetChecksum(buffers::Views(v[k]), cols));
  }
  auto merged = h.Open(3, 5);
  ASSERT_TRUE(merged.ok()) << merged.status().ToString();
  EXPECT_EQ((*merged)->kind(), codec::PatchKind::kPatch);
  auto info = codec::InspectPatch((*merged)->Assemble());
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tensors[0].col_cuts, cols[0].col_cuts);
  EXPECT_EQ(info->base_set_checksum, *codec::SetChecksum(buffers::Views(v[2]), cols));
  EXPECT_TRUE(testing::SameBits(ApplyStream(**merged, v[2]), v[4]));
  auto kf = h.Open(0, 5);
  ASSERT_TRUE(kf.ok());
  EXPECT_TRUE(testing::SameBits(ApplyStream(**kf, v[0]), v[4]));
  EXPECT_EQ(h.SetGrids({{"nope", {1}, {}}}).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace wsync::daemon
