// Hostile input: every truncation and every single-byte corruption of small
// patches gives an error (destination untouched) or the exact target, never a
// crash or silently wrong bits. Run with the whole-patch checksum off, so the
// structural checks behind it are what is tested, and on.
#include <gtest/gtest.h>

#include <random>

#include "test_tensors.h"
#include "wsync/codec/codec.h"
#include "wsync/util/thread_pool.h"

namespace wsync::codec {
namespace {

using buffers::OwnedTensor;

struct Fixture {
  std::vector<OwnedTensor> base, target;
  std::string patch, keyframe;
};

Fixture MakeFixture() {
  std::mt19937_64 rng(99);
  Fixture f;
  f.base = {testing::RandomTensor("a", DType::kBF16, {3000}, rng),
            testing::RandomTensor("b", DType::kF32, {500}, rng),
            testing::RandomTensor("c", DType::kF8E4M3, {700}, rng),
            testing::RandomTensor("d", DType::kBF16, {400}, rng)};
  f.target = {testing::Perturb(f.base[0], 0.02, rng), testing::Perturb(f.base[1], 0.3, rng),
              testing::Perturb(f.base[2], 1.0, rng), f.base[3]};
  auto* run = reinterpret_cast<uint16_t*>(f.target[3].bytes.data());
  for (int i = 100; i < 300; ++i) run[i] += 1;
  f.patch = *EncodePatch(buffers::Views(f.base), buffers::Views(f.target), {});
  f.keyframe = *EncodeKeyframe(buffers::Views(f.target), {});
  return f;
}

// Applies `bytes` to a copy of the base; checks the all-or-nothing contract.
void CheckContract(const Fixture& f, std::string_view bytes, bool keyframe, bool verify, const std::string& what) {
  std::vector<OwnedTensor> dst = f.base;
  auto views = buffers::MutableViews(dst);
  ApplyOptions options;
  options.verify_patch_checksum = verify;
  Status s = codec::Apply(bytes, views, options);
  if (s.ok()) {
    ASSERT_TRUE(testing::SameBits(dst, f.target)) << what << ": accepted with wrong bits";
  } else {
    ASSERT_FALSE(s.message().empty()) << what;
    ASSERT_TRUE(testing::SameBits(dst, f.base)) << what << ": rejected (" << s.ToString()
                                                << ") but destination modified";
  }
  (void)InspectPatch(bytes, verify);
  (void)keyframe;
}

TEST(Corruption, EveryTruncationIsRejected) {
  Fixture f = MakeFixture();
  for (const std::string* bytes : {&f.patch, &f.keyframe}) {
    for (size_t len = 0; len < bytes->size(); ++len) {
      std::vector<OwnedTensor> dst = f.base;
      auto views = buffers::MutableViews(dst);
      ApplyOptions options;
      options.verify_patch_checksum = false;
      Status s = codec::Apply(std::string_view(*bytes).substr(0, len), views, options);
      ASSERT_FALSE(s.ok()) << "truncated to " << len;
      ASSERT_TRUE(testing::SameBits(dst, f.base)) << "truncated to " << len;
    }
  }
}

TEST(Corruption, EveryByteFlipWithoutPatchChecksum) {
  Fixture f = MakeFixture();
  std::mt19937_64 rng(1);
  for (const std::string* bytes : {&f.patch, &f.keyframe}) {
    for (size_t i = 0; i < bytes->size(); ++i) {
      for (uint8_t x : {uint8_t{0x01}, uint8_t{0x80}, static_cast<uint8_t>(1 + rng() % 255)}) {
        std::string bad = *bytes;
        bad[i] = static_cast<char>(bad[i] ^ x);
        CheckContract(f, bad, bytes == &f.keyframe, false, "byte " + std::to_string(i));
      }
    }
  }
}

TEST(Corruption, PatchChecksumCatchesEveryFlip) {
  Fixture f = MakeFixture();
  for (size_t i = 0; i < f.patch.size(); ++i) {
    std::string bad = f.patch;
    bad[i] = static_cast<char>(bad[i] ^ 0x10);
    std::vector<OwnedTensor> dst = f.base;
    auto views = buffers::MutableViews(dst);
    Status s = codec::Apply(bad, views, {});
    // Bytes 8-9 are the format version: another version is Unimplemented.
    ASSERT_EQ(s.code(), i == 8 || i == 9 ? StatusCode::kUnimplemented : StatusCode::kDataLoss) << "byte " << i;
    ASSERT_TRUE(testing::SameBits(dst, f.base));
  }
}

TEST(Corruption, ErrorsNameWhatIsWrong) {
  Fixture f = MakeFixture();
  std::vector<OwnedTensor> dst = f.base;
  auto views = buffers::MutableViews(dst);
  Status s = codec::Apply("hello", views, {});
  EXPECT_NE(s.message().find("shorter than"), std::string::npos) << s.message();
  std::string bad_magic = f.patch;
  bad_magic[0] = 'X';
  s = codec::Apply(bad_magic, views, {});
  EXPECT_NE(s.message().find("magic"), std::string::npos) << s.message();
  std::string future = f.patch;
  future[8] = 9;
  s = codec::Apply(future, views, {});
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s.ToString();
  std::string padded = f.patch + "x";
  s = codec::Apply(padded, views, {});
  EXPECT_NE(s.message().find("truncated or padded"), std::string::npos) << s.message();
}

// Apply goes chunk by chunk in parallel and undoes what it applied when any
// chunk fails: with many chunks and threads, a corrupt patch still leaves
// the destination exactly as it was.
TEST(Corruption, ManyChunksOnThreadsAreAllOrNothing) {
  std::mt19937_64 rng(17);
  std::vector<OwnedTensor> base = {testing::RandomTensor("big", DType::kBF16, {size_t{3} << 19}, rng),
                                   testing::RandomTensor("small", DType::kBF16, {5000}, rng)};
  std::vector<OwnedTensor> target = {testing::Perturb(base[0], 0.02, rng), testing::Perturb(base[1], 0.05, rng)};
  ThreadPool pool(4);
  EncodeOptions eo;
  eo.pool = &pool;
  const std::string patch = *EncodePatch(buffers::Views(base), buffers::Views(target), eo);
  ApplyOptions options;
  options.pool = &pool;
  options.verify_patch_checksum = false;
  for (int trial = 0; trial < 300; ++trial) {
    std::string bad = patch;
    const size_t at = rng() % bad.size();
    bad[at] = static_cast<char>(bad[at] ^ (1 + rng() % 255));
    std::vector<OwnedTensor> dst = base;
    auto views = buffers::MutableViews(dst);
    Status s = codec::Apply(bad, views, options);
    if (s.ok()) {
      ASSERT_TRUE(testing::SameBits(dst, target)) << "byte " << at << ": accepted with wrong bits";
    } else {
      ASSERT_TRUE(testing::SameBits(dst, base)) << "byte " << at << ": rejected (" << s.ToString()
                                                << ") but destination modified";
    }
  }
}

TEST(Corruption, MergeOfCorruptInputNeverCrashes) {
  Fixture f = MakeFixture();
  auto base = buffers::Views(f.base);
  for (size_t i = 0; i < f.patch.size(); i += 3) {
    std::string bad = f.patch;
    bad[i] = static_cast<char>(bad[i] ^ 0x5A);
    (void)MergePatches(bad, f.patch, base, {});
    (void)MergePatches(f.patch, bad, base, {});
  }
}

}  // namespace
}  // namespace wsync::codec
