// DeviceCodec on a GPU against the host codec: identical patch bytes,
// identical results and errors. Skips with a message where no GPU is usable.
#include "wsync/cuda/device_codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <string_view>

#include "../codec/test_tensors.h"
#include "../codec/tp_model.h"
#include "wsync/buffers/safetensors.h"
#include "wsync/codec/bf16.h"
#include "wsync/codec/checksum.h"

namespace wsync {
namespace {

using testing::OwnedTensor;

// Device copies of a tensor set.
struct DeviceSet {
  std::vector<cuda::DeviceBuffer> buffers;
  std::vector<codec::MutableTensorView> views;

  static DeviceSet Of(const std::vector<OwnedTensor>& host) {
    DeviceSet s;
    for (const auto& t : host) {
      auto b = cuda::DeviceBuffer::Allocate(t.bytes.size());
      EXPECT_TRUE(b.ok()) << b.status().ToString();
      EXPECT_TRUE(b->CopyFromHost(t.bytes.data(), t.bytes.size()).ok());
      s.views.push_back({t.name, t.dtype, t.shape, static_cast<uint8_t*>(b->data())});
      s.buffers.push_back(std::move(*b));
    }
    return s;
  }
  std::vector<codec::TensorView> Const() const {
    std::vector<codec::TensorView> v;
    for (const auto& m : views) v.push_back(m.AsConst());
    return v;
  }
  std::vector<OwnedTensor> ToHost(const std::vector<OwnedTensor>& like) const {
    std::vector<OwnedTensor> out = like;
    for (size_t i = 0; i < out.size(); ++i) EXPECT_TRUE(buffers[i].CopyToHost(out[i].bytes.data(), out[i].bytes.size()).ok());
    return out;
  }
};

// Page-locked host copies of a tensor set (a source's base in host memory).
struct PinnedSet {
  std::vector<cuda::PinnedBuffer> buffers;
  std::vector<codec::MutableTensorView> views;

  static PinnedSet Of(const std::vector<OwnedTensor>& host) {
    PinnedSet s;
    for (const auto& t : host) {
      auto b = cuda::PinnedBuffer::Allocate(t.bytes.size());
      EXPECT_TRUE(b.ok()) << b.status().ToString();
      std::memcpy(b->data(), t.bytes.data(), t.bytes.size());
      s.views.push_back({t.name, t.dtype, t.shape, static_cast<uint8_t*>(b->data())});
      s.buffers.push_back(std::move(*b));
    }
    return s;
  }
};

class DeviceCodecTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const Status s = cuda::DeviceAvailable();
    if (!s.ok()) GTEST_SKIP() << "no GPU: " << s.ToString();
    // codec_ runs the entropy stage of sparse-coded chunks on the device;
    // host_codec_ on the host (the default), which RoundTrip checks too.
    auto c = cuda::DeviceCodec::Create(0, cuda::EntropyStage::kDevice);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    codec_ = std::move(*c);
    auto h = cuda::DeviceCodec::Create(0, cuda::EntropyStage::kHost);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    host_codec_ = std::move(*h);
  }

  // Encodes on both, compares bytes; applies on the device, compares bits.
  // device_codes: the device's coder must have coded some chunk.
  void RoundTrip(const std::vector<OwnedTensor>& base, const std::vector<OwnedTensor>& target,
                 const codec::EncodeOptions& o, bool device_codes = false) {
    auto host = codec::EncodePatch(buffers::Views(base), buffers::Views(target), o);
    ASSERT_TRUE(host.ok()) << host.status().ToString();
    DeviceSet b = DeviceSet::Of(base), t = DeviceSet::Of(target);
    auto dev = codec_->EncodePatch(ws_, b.Const(), t.Const(), o);
    ASSERT_TRUE(dev.ok()) << dev.status().ToString();
    if (device_codes) {
      const auto& phases = codec_->last_phases();
      EXPECT_TRUE(std::any_of(phases.begin(), phases.end(), [](const cuda::DeviceCodec::Phase& p) {
        return std::string_view(p.name) == "device entropy";
      })) << "the device's coder coded no chunk";
    }
    EXPECT_EQ(dev->size(), host->size());
    EXPECT_TRUE(*dev == *host) << "device patch differs from the host codec's";
    ASSERT_TRUE(codec_->Apply(ws_, *host, b.views, {}).ok());
    EXPECT_TRUE(testing::SameBits(b.ToHost(base), target));
    // The entropy stage on the host: the same bytes, the same bits.
    DeviceSet again = DeviceSet::Of(base);
    auto hosted = host_codec_->EncodePatch(ws_, again.Const(), t.Const(), o);
    ASSERT_TRUE(hosted.ok()) << hosted.status().ToString();
    EXPECT_TRUE(*hosted == *host) << "the host entropy stage's patch differs from the host codec's";
    ASSERT_TRUE(host_codec_->Apply(ws_, *host, again.views, {}).ok());
    EXPECT_TRUE(testing::SameBits(again.ToHost(base), target));
  }

  std::unique_ptr<cuda::DeviceCodec> codec_;
  std::unique_ptr<cuda::DeviceCodec> host_codec_;
  cuda::Workspace ws_;
};

TEST_F(DeviceCodecTest, RandomSetsOfEveryWidthAndDensity) {
  std::mt19937_64 rng(11);
  for (codec::DType dtype : {codec::DType::kBF16, codec::DType::kF32, codec::DType::kF8E4M3, codec::DType::kF64,
                             codec::DType::kI16}) {
    for (double density : {0.0, 1e-4, 1e-2, 0.5, 1.0}) {
      std::vector<OwnedTensor> base, target;
      const std::vector<std::vector<uint64_t>> shapes = {{3, 700001}, {1}, {0}, {33}, {1 << 20}};
      for (size_t i = 0; i < shapes.size(); ++i) {
        base.push_back(testing::RandomTensor("t" + std::to_string(i), dtype, shapes[i], rng));
        target.push_back(dtype == codec::DType::kBF16 ? testing::PerturbByExponent(base.back(), density, 118, rng)
                                                      : testing::Perturb(base.back(), density, rng));
      }
      for (bool condition : {true, false}) {
        SCOPED_TRACE(std::string(codec::DTypeName(dtype)) + " density " + std::to_string(density) +
                     (condition ? " conditioned" : ""));
        codec::EncodeOptions o;
        o.condition_on_base = condition;
        RoundTrip(base, target, o);
      }
    }
  }
}

// The caller's workspace holds the calls' memory: grown by a call, kept
// for the next, freed by Release (the next call allocates again), shared by
// two codecs that run one after the other; one of another device refused.
TEST_F(DeviceCodecTest, CallsWorkInTheCallersWorkspace) {
  std::mt19937_64 rng(5);
  std::vector<OwnedTensor> base = {testing::RandomTensor("w", codec::DType::kBF16, {1 << 20}, rng)};
  std::vector<OwnedTensor> target = {testing::PerturbByExponent(base[0], 1e-2, 118, rng)};
  auto host = codec::EncodePatch(buffers::Views(base), buffers::Views(target), {});
  ASSERT_TRUE(host.ok());
  DeviceSet b = DeviceSet::Of(base), t = DeviceSet::Of(target);
  cuda::Workspace ws;
  EXPECT_EQ(ws.device_bytes(), 0u);
  auto first = codec_->EncodePatch(ws, b.Const(), t.Const(), {});
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(*first, *host);
  const size_t held = ws.device_bytes();
  EXPECT_GT(held, 0u);
  ASSERT_TRUE(codec_->EncodePatch(ws, b.Const(), t.Const(), {}).ok());
  EXPECT_EQ(ws.device_bytes(), held) << "a call alike grows nothing";
  ws.Release();
  EXPECT_EQ(ws.device_bytes(), 0u);
  EXPECT_EQ(ws.pinned_bytes(), 0u);
  auto other = cuda::DeviceCodec::Create();
  ASSERT_TRUE(other.ok());
  auto again = (*other)->EncodePatch(ws, b.Const(), t.Const(), {});
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(*again, *host);
  ASSERT_TRUE((*other)->Apply(ws, *host, b.views, {}).ok());
  EXPECT_TRUE(testing::SameBits(b.ToHost(base), target));

  cuda::Workspace elsewhere(7);
  const Status refused = codec_->Apply(elsewhere, *host, b.views, {});
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
  EXPECT_EQ(elsewhere.device_bytes(), 0u);
}

TEST_F(DeviceCodecTest, RealSnapshotsGiveTheHostBytes) {
  const char* env = std::getenv("WSYNC_DATA_DIR");
  const std::filesystem::path dir = env != nullptr ? env : WSYNC_SHARED_DATA_DIR "/rl-small-lr1e-6";
  std::string error;
  const bool found = testing::ForEachSnapshotPair(
      dir,
      [&](const std::vector<OwnedTensor>& base, const std::vector<OwnedTensor>& target, const std::string& name) {
        SCOPED_TRACE(name);
        // At RL change rates the device entropy-codes (nearly) every chunk.
        RoundTrip(base, target, codec::EncodeOptions{}, /*device_codes=*/true);
      },
      &error);
  EXPECT_EQ(error, "");
  if (!found) GTEST_SKIP() << "no snapshots in " << dir;
}

TEST_F(DeviceCodecTest, SnapshotAndEncodeCopiesAndEncodesLikeTheHost) {
  std::mt19937_64 rng(12);
  std::vector<OwnedTensor> base, live;
  for (int i = 0; i < 6; ++i) {
    base.push_back(testing::RandomTensor("w" + std::to_string(i), codec::DType::kBF16, {1 << 21}, rng));
    live.push_back(testing::PerturbByExponent(base.back(), 1e-2, 118, rng));
  }
  auto host = codec::EncodePatch(buffers::Views(base), buffers::Views(live), {});
  ASSERT_TRUE(host.ok());
  DeviceSet prev = DeviceSet::Of(base), trainer = DeviceSet::Of(live), snap = DeviceSet::Of(base);
  int reported = 0;
  auto patch = codec_->SnapshotAndEncode(ws_, trainer.Const(), snap.views, prev.Const(), {}, [&] { ++reported; });
  ASSERT_TRUE(patch.ok()) << patch.status().ToString();
  EXPECT_EQ(reported, 1);
  EXPECT_TRUE(*patch == *host);
  EXPECT_TRUE(testing::SameBits(snap.ToHost(live), live));
}

// The source's base in device memory, then in page-locked host memory: the
// host codec's bytes, and the base is the target afterwards; a refused
// encode leaves the base as it was.
TEST_F(DeviceCodecTest, EncodeAndAdvanceGiveTheHostBytesAndUpdateTheBase) {
  std::mt19937_64 rng(21);
  std::vector<OwnedTensor> base, live;
  // 328 MiB: the host base is staged in two batches.
  for (int i = 0; i < 5; ++i) {
    const std::vector<uint64_t> shape = i == 2   ? std::vector<uint64_t>{3, 1 << 20}
                                        : i % 2 ? std::vector<uint64_t>{80 << 20}
                                                : std::vector<uint64_t>{1 << 19};
    base.push_back(testing::RandomTensor("w" + std::to_string(i), codec::DType::kBF16, shape, rng));
    live.push_back(testing::PerturbByExponent(base.back(), 2e-2, 118, rng));
  }
  auto host = codec::EncodePatch(buffers::Views(base), buffers::Views(live), {});
  ASSERT_TRUE(host.ok());
  const DeviceSet trainer = DeviceSet::Of(live);

  DeviceSet prev = DeviceSet::Of(base);
  auto patch = codec_->EncodeAndAdvance(ws_, trainer.Const(), prev.views, {});
  ASSERT_TRUE(patch.ok()) << patch.status().ToString();
  EXPECT_TRUE(*patch == *host);
  EXPECT_TRUE(testing::SameBits(prev.ToHost(base), live));

  PinnedSet held = PinnedSet::Of(base);
  const auto& pinned = held.buffers;
  const auto& host_prev = held.views;
  auto renamed = trainer.Const();
  renamed[1].name = "other";
  EXPECT_FALSE(codec_->EncodeAndAdvanceFromHost(ws_, renamed, host_prev, {}).ok());
  for (size_t i = 0; i < base.size(); ++i) {
    EXPECT_EQ(std::memcmp(pinned[i].data(), base[i].bytes.data(), base[i].bytes.size()), 0) << "refused, yet changed";
  }
  patch = codec_->EncodeAndAdvanceFromHost(ws_, trainer.Const(), host_prev, {});
  ASSERT_TRUE(patch.ok()) << patch.status().ToString();
  EXPECT_TRUE(*patch == *host);
  for (size_t i = 0; i < live.size(); ++i) {
    EXPECT_EQ(std::memcmp(pinned[i].data(), live[i].bytes.data(), live[i].bytes.size()), 0) << live[i].name;
  }
}

// A source serving tensor-parallel layouts codes tile grids: cells that are
// whole rows are coded in place, the others gathered; the bytes are the host
// codec's, with the base on the device and on the host.
TEST_F(DeviceCodecTest, TileGridsGiveTheHostBytes) {
  std::mt19937_64 rng(31);
  std::vector<OwnedTensor> base, live;
  const std::vector<std::pair<std::string, std::vector<uint64_t>>> shapes = {
      {"qkv", {3072, 1024}}, {"o", {1024, 1024}}, {"down", {1024, 2816}}, {"norm", {1024}}, {"embed", {5003, 256}}};
  for (const auto& [name, shape] : shapes) {
    base.push_back(testing::RandomTensor(name, codec::DType::kBF16, shape, rng));
    live.push_back(testing::PerturbByExponent(base.back(), 1e-2, 118, rng));
  }
  codec::EncodeOptions o;
  o.grids = {{"qkv", {1024, 1536, 2048, 2560}, {}},
             {"o", {}, {512}},
             {"down", {}, {704, 1408, 2112}},
             {"embed", {2502}, {}}};
  auto host = codec::EncodePatch(buffers::Views(base), buffers::Views(live), o);
  ASSERT_TRUE(host.ok()) << host.status().ToString();
  const DeviceSet trainer = DeviceSet::Of(live);
  DeviceSet b = DeviceSet::Of(base);
  auto dev = codec_->EncodePatch(ws_, b.Const(), trainer.Const(), o);
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  EXPECT_TRUE(*dev == *host) << "device patch differs from the host codec's";
  auto patch = codec_->EncodeAndAdvance(ws_, trainer.Const(), b.views, o);
  ASSERT_TRUE(patch.ok()) << patch.status().ToString();
  EXPECT_TRUE(*patch == *host);
  EXPECT_TRUE(testing::SameBits(b.ToHost(base), live));

  PinnedSet held = PinnedSet::Of(base);
  const auto& host_prev = held.views;
  patch = codec_->EncodeAndAdvanceFromHost(ws_, trainer.Const(), host_prev, o);
  ASSERT_TRUE(patch.ok()) << patch.status().ToString();
  EXPECT_TRUE(*patch == *host);

  o.chunk_bytes = 2u << 20;
  EXPECT_EQ(codec_->EncodePatch(ws_, b.Const(), trainer.Const(), o).status().code(), StatusCode::kInvalidArgument);
}

// Tensor-parallel ranks holding pieces in device memory: every rank of TP 2
// and 4 from the whole gridded patch, its selection, the parts of two
// sources, a keyframe, and a keyframe part beside a patch part, bit for bit
// as codec::Apply; pieces that do not hold the base are refused and left as
// they were.
TEST_F(DeviceCodecTest, PiecesGridsAndPartsApplyOnTheDevice) {
  std::mt19937_64 rng(41);
  const auto v0 = testing::CanonicalModel(rng);
  std::vector<OwnedTensor> v1;
  for (const auto& t : v0) v1.push_back(testing::PerturbByExponent(t, 0.05, 118, rng));
  std::vector<testing::Rank> all = testing::MakeRanks(4);
  codec::EncodeOptions o;
  o.grids = codec::GridsFor(testing::Layouts(all), buffers::Views(v0));
  auto patch = codec::EncodePatch(buffers::Views(v0), buffers::Views(v1), o);
  ASSERT_TRUE(patch.ok());
  auto keyframe = codec::EncodeKeyframe(buffers::Views(v1), o);
  ASSERT_TRUE(keyframe.ok());
  const auto [parts, key_parts] = testing::TwoSourceParts(v0, v1, o.grids);
  const std::vector<std::string_view> key_and_patch = {key_parts[0], parts[1]};
  const std::vector<std::string_view> part_views(parts.begin(), parts.end());
  auto mixed = v0;
  mixed.back() = v1.back();  // "down" (gridded) at another version than the base
  // Both entropy stages; at 0.2% changed as well, where every chunk is
  // sparse-coded and decoded by the device's jobs with the device stage.
  auto sparse_v1 = v0;
  for (auto& t : sparse_v1) t = testing::PerturbByExponent(t, 0.002, 118, rng);
  auto sparse_patch = codec::EncodePatch(buffers::Views(v0), buffers::Views(sparse_v1), o);
  ASSERT_TRUE(sparse_patch.ok());
  for (const auto& [dc, dense] : {std::pair{codec_.get(), true}, std::pair{codec_.get(), false},
                                  std::pair{host_codec_.get(), true}, std::pair{host_codec_.get(), false}}) {
  const std::string& vpatch = dense ? *patch : *sparse_patch;
  const std::vector<OwnedTensor>& target = dense ? v1 : sparse_v1;
  for (uint64_t tp : {2, 4}) {
    for (uint64_t r = 0; r < tp; ++r) {
      SCOPED_TRACE("TP " + std::to_string(tp) + " rank " + std::to_string(r) + (dense ? ", 5%" : ", 0.2%") +
                   (dc == codec_.get() ? " changed, device entropy stage" : " changed, host entropy stage"));
      auto selection = codec::SelectForPieces(vpatch, testing::MakeRank(tp, r).layout);
      ASSERT_TRUE(selection.ok());
      for (int form = 0; form < 6; ++form) {
        if (!dense && form != 0 && form != 1 && form != 3) continue;  // the parts and keyframes are 5%'s
        testing::Rank rank = testing::MakeRank(tp, r);
        testing::Fill(&rank, form == 3 ? mixed : v0);
        DeviceSet dev = DeviceSet::Of(rank.tensors);
        std::vector<codec::RuntimeTensor> layout = rank.layout;
        for (size_t i = 0; i < layout.size(); ++i) layout[i].view.data = dev.views[i].data;
        Status s;
        if (form == 2) {
          s = dc->Apply(ws_, part_views, layout, {});
        } else if (form == 4) {
          s = dc->Apply(ws_, *keyframe, layout, {});
        } else if (form == 5) {
          s = dc->Apply(ws_, key_and_patch, layout, {});
        } else {
          s = dc->Apply(ws_, form == 1 ? *selection : vpatch, layout, {});
        }
        if (form == 3) {
          EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
          EXPECT_TRUE(testing::SameBits(dev.ToHost(rank.tensors), testing::Expected(tp, r, mixed)));
          continue;
        }
        ASSERT_TRUE(s.ok()) << "form " << form << ": " << s.ToString();
        EXPECT_TRUE(testing::SameBits(dev.ToHost(rank.tensors), testing::Expected(tp, r, target))) << "form " << form;
      }
    }
  }
  }
  // Whole tensors from the gridded patch; whole tensors at another version
  // than its base: FailedPrecondition, as codec::Apply says, unchanged.
  DeviceSet whole = DeviceSet::Of(v0);
  ASSERT_TRUE(codec_->Apply(ws_, *patch, whole.views, {}).ok());
  EXPECT_TRUE(testing::SameBits(whole.ToHost(v0), v1));
  DeviceSet other = DeviceSet::Of(mixed);
  auto host_other = mixed;
  const Status host_says = codec::Apply(*patch, buffers::MutableViews(host_other), {});
  const Status s = codec_->Apply(ws_, *patch, other.views, {});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_EQ(s.code(), host_says.code());
  EXPECT_TRUE(testing::SameBits(other.ToHost(v0), mixed));
}

TEST_F(DeviceCodecTest, CorruptPatchIsDataLossAndTheDestinationIsUnchanged) {
  std::mt19937_64 rng(13);
  std::vector<OwnedTensor> base{testing::RandomTensor("w", codec::DType::kBF16, {1 << 20}, rng)};
  std::vector<OwnedTensor> target{testing::PerturbByExponent(base[0], 1e-2, 118, rng)};
  auto patch = codec::EncodePatch(buffers::Views(base), buffers::Views(target), {});
  ASSERT_TRUE(patch.ok());
  int data_loss = 0;
  for (size_t at = 100; at < patch->size(); at += patch->size() / 40) {
    std::string bad = *patch;
    bad[at] ^= 0x5A;
    DeviceSet d = DeviceSet::Of(base);
    codec::ApplyOptions o;
    o.verify_patch_checksum = false;  // reach the stream decoders and the tensor checksums
    const Status s = codec_->Apply(ws_, bad, d.views, o);
    const auto after = d.ToHost(base);
    if (s.ok()) {
      EXPECT_TRUE(testing::SameBits(after, target)) << "accepted a flip at " << at << " with wrong bits";
    } else {
      ++data_loss;
      EXPECT_TRUE(testing::SameBits(after, base)) << "destination changed after: " << s.ToString();
    }
  }
  EXPECT_GT(data_loss, 0);
}

TEST_F(DeviceCodecTest, WrongBaseIsFailedPrecondition) {
  std::mt19937_64 rng(14);
  std::vector<OwnedTensor> base{testing::RandomTensor("w", codec::DType::kBF16, {1 << 20}, rng)};
  std::vector<OwnedTensor> target{testing::PerturbByExponent(base[0], 1e-2, 118, rng)};
  auto patch = codec::EncodePatch(buffers::Views(base), buffers::Views(target), {});
  ASSERT_TRUE(patch.ok());
  DeviceSet d = DeviceSet::Of(target);  // already at the target, not the base
  const Status s = codec_->Apply(ws_, *patch, d.views, {});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_TRUE(testing::SameBits(d.ToHost(target), target));
}

// Stage reads only; Commit checks every element it changes, then writes;
// Confirm reads back. Another writer between them: on an element the
// version changes, the commit refuses and writes nothing; elsewhere, the
// confirm finds it. Past the staging budget the commit decodes again.
TEST_F(DeviceCodecTest, StagedThenCommittedWithAnotherWriterBetween) {
  std::mt19937_64 rng(17);
  std::vector<OwnedTensor> base{testing::RandomTensor("w", codec::DType::kBF16, {1 << 20}, rng)};
  std::vector<OwnedTensor> target{testing::PerturbByExponent(base[0], 1e-2, 118, rng)};
  auto patch = codec::EncodePatch(buffers::Views(base), buffers::Views(target), {});
  ASSERT_TRUE(patch.ok());
  const std::string_view one(*patch);
  const auto* b16 = reinterpret_cast<const uint16_t*>(base[0].bytes.data());
  const auto* t16 = reinterpret_cast<const uint16_t*>(target[0].bytes.data());
  size_t changed = 0, unchanged = 0;
  while (b16[changed] == t16[changed]) ++changed;
  while (b16[unchanged] != t16[unchanged]) ++unchanged;
  // Flips element e on the device and in `mirror`.
  auto flip = [](DeviceSet& d, size_t e, std::vector<OwnedTensor>* mirror) {
    uint16_t* m = reinterpret_cast<uint16_t*>((*mirror)[0].bytes.data()) + e;
    *m ^= 1;
    ASSERT_TRUE(cuda::CopyHostToDevice(d.views[0].data + 2 * e, m, 2).ok());
  };
  {
    DeviceSet d = DeviceSet::Of(base);
    auto staged = codec_->Stage(ws_, std::span(&one, 1), d.views, {});
    ASSERT_TRUE(staged.ok()) << staged.status().ToString();
    EXPECT_GT(staged->changes(), 0u);
    EXPECT_EQ(staged->kept_bytes(), staged->changes() * 12);
    EXPECT_TRUE(testing::SameBits(d.ToHost(base), base)) << "staging wrote";
    auto mirror = base;
    flip(d, changed, &mirror);
    const Status s = codec_->Commit(ws_, *staged);
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
    EXPECT_TRUE(testing::SameBits(d.ToHost(base), mirror)) << "the refused commit wrote";
  }
  {
    DeviceSet d = DeviceSet::Of(base);
    auto staged = codec_->Stage(ws_, std::span(&one, 1), d.views, {});
    ASSERT_TRUE(staged.ok()) << staged.status().ToString();
    auto mirror = target;
    flip(d, unchanged, &mirror);
    ASSERT_TRUE(codec_->Commit(ws_, *staged).ok());
    EXPECT_TRUE(testing::SameBits(d.ToHost(base), mirror));
    EXPECT_EQ(codec_->Confirm(ws_, *staged).code(), StatusCode::kDataLoss);
  }
  for (const uint64_t budget : {std::numeric_limits<uint64_t>::max(), uint64_t{0}}) {
    DeviceSet d = DeviceSet::Of(base);
    codec::ApplyOptions o;
    o.stage_keep_bytes = budget;
    auto staged = codec_->Stage(ws_, std::span(&one, 1), d.views, o);
    ASSERT_TRUE(staged.ok()) << staged.status().ToString();
    EXPECT_EQ(staged->decodes_again(), budget == 0);
    ASSERT_TRUE(codec_->Commit(ws_, *staged).ok());
    EXPECT_TRUE(testing::SameBits(d.ToHost(base), target));
    EXPECT_TRUE(codec_->Confirm(ws_, *staged).ok());
  }
}

TEST_F(DeviceCodecTest, KeyframeAppliesIntoDeviceMemory) {
  std::mt19937_64 rng(15);
  std::vector<OwnedTensor> target{testing::RandomTensor("w", codec::DType::kBF16, {3, 500000}, rng)};
  auto kf = codec::EncodeKeyframe(buffers::Views(target), {});
  ASSERT_TRUE(kf.ok());
  std::vector<OwnedTensor> zero = target;
  std::fill(zero[0].bytes.begin(), zero[0].bytes.end(), 0);
  DeviceSet d = DeviceSet::Of(zero);
  ASSERT_TRUE(codec_->Apply(ws_, *kf, d.views, {}).ok());
  EXPECT_TRUE(testing::SameBits(d.ToHost(target), target));
}

TEST_F(DeviceCodecTest, ChecksumAndCastMatchTheHost) {
  std::mt19937_64 rng(16);
  std::vector<uint32_t> f32(3'000'017);
  for (auto& v : f32) v = static_cast<uint32_t>(rng());
  f32[0] = 0x7FC00001u;  // NaN
  f32[1] = 0x3F808000u;  // a tie
  auto src = cuda::DeviceBuffer::Allocate(f32.size() * 4);
  auto dst = cuda::DeviceBuffer::Allocate(f32.size() * 2);
  ASSERT_TRUE(src.ok() && dst.ok());
  ASSERT_TRUE(src->CopyFromHost(f32.data(), f32.size() * 4).ok());
  ASSERT_TRUE(codec_->CastFp32ToBf16(static_cast<uint32_t*>(src->data()), static_cast<uint16_t*>(dst->data()),
                                     f32.size()).ok());
  std::vector<uint16_t> got(f32.size()), want(f32.size());
  ASSERT_TRUE(dst->CopyToHost(got.data(), got.size() * 2).ok());
  codec::CastFp32ToBf16(f32.data(), want.data(), f32.size());
  EXPECT_TRUE(got == want);
  for (size_t len : {size_t{0}, size_t{5}, size_t{241}, size_t{1} << 20, f32.size() * 4}) {
    auto sum = codec_->TensorChecksum(ws_, src->data(), len);
    ASSERT_TRUE(sum.ok());
    EXPECT_EQ(*sum, codec::TensorChecksum(f32.data(), len)) << len;
  }
  // Set checksums on tile grids: cells of whole rows and cells gathered.
  std::vector<OwnedTensor> set = {testing::RandomTensor("a", codec::DType::kBF16, {1500, 1100}, rng),
                                  testing::RandomTensor("b", codec::DType::kF32, {7}, rng),
                                  testing::RandomTensor("c", codec::DType::kU8, {300, 9000}, rng)};
  const std::vector<codec::TileGrid> grids = {{"a", {700}, {550, 551}}, {"c", {150}, {}}};
  const DeviceSet dev = DeviceSet::Of(set);
  for (const auto& g : {std::vector<codec::TileGrid>{}, grids}) {
    auto sum = codec_->SetChecksum(ws_, dev.Const(), g);
    ASSERT_TRUE(sum.ok()) << sum.status().ToString();
    EXPECT_EQ(*sum, *codec::SetChecksum(buffers::Views(set), g));
  }
}

}  // namespace
}  // namespace wsync
