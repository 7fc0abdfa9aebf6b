// The source's version history on the real RL snapshots: every (from, head)
// pull is a patch that takes version `from` to the head bit for bit; unknown
// or forgotten versions get a keyframe; Retain frees the past.
#include "version_history.h"

#include <gtest/gtest.h>

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
  Status st = codec::ApplyPatch(s.Assemble(), views, {});
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

}  // namespace
}  // namespace wsync::daemon
