// Versions through a real S3-compatible server (SeaweedFS on loopback): a
// writer publishes keyframes and patches, a reader with read-only
// credentials plans its catch-up and applies it to the target's bits; a
// corrupt, truncated or missing object, a conflicting second uploader and a
// malformed manifest are refused, naming what is wrong; collection keeps
// every version reachable.
#include "wsync/store/versions.h"

#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <openssl/pem.h>

#include <cstdio>
#include <filesystem>
#include <random>

#include "../codec/test_tensors.h"
#include "seaweedfs.h"
#include "wsync/codec/codec.h"

namespace wsync::store {
namespace {

using testing::SeaweedServer;
using wsync::testing::OwnedTensor;

constexpr const char* kRun = "runs/test";

class VersionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.Ready("weights"));
    auto w = OpenS3(server_.Options("weights"));
    auto r = OpenS3(server_.Options("weights", /*writer=*/false));
    ASSERT_TRUE(w.ok() && r.ok());
    writer_store_ = std::move(*w);
    reader_store_ = std::move(*r);
    std::mt19937_64 rng(7);
    versions_.push_back({});  // no version 0
    versions_.push_back({wsync::testing::RandomTensor("a", codec::DType::kBF16, {512, 1024}, rng),
                         wsync::testing::RandomTensor("b", codec::DType::kBF16, {3000}, rng)});
    for (int v = 2; v <= 6; ++v) {
      std::vector<OwnedTensor> next;
      for (const auto& t : versions_.back()) next.push_back(wsync::testing::PerturbByExponent(t, 0.01, 118, rng));
      versions_.push_back(std::move(next));
    }
  }

  std::string Patch(uint64_t from, uint64_t to) {
    codec::EncodeOptions o;
    o.base_version = from;
    o.target_version = to;
    auto p = codec::EncodePatch(buffers::Views(versions_[from]), buffers::Views(versions_[to]), o);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return *p;
  }
  std::string Keyframe(uint64_t v) {
    codec::EncodeOptions o;
    o.target_version = v;
    auto k = codec::EncodeKeyframe(buffers::Views(versions_[v]), o);
    EXPECT_TRUE(k.ok()) << k.status().ToString();
    return *k;
  }
  uint64_t SetChecksum(uint64_t v) { return codec::SetChecksum(buffers::Views(versions_[v]), {}); }

  // Versions 1 (keyframe) to 6, a keyframe at 4 too, and at 6 a merged
  // patch from 3 besides the one from 5.
  void PublishAll() {
    VersionWriter w(*writer_store_, kRun);
    for (uint64_t v = 1; v <= 6; ++v) {
      std::vector<std::string> bytes;
      std::vector<VersionWriter::Upload> uploads;
      if (v > 1) bytes.push_back(Patch(v - 1, v));
      if (v == 1 || v == 4) bytes.push_back(Keyframe(v));
      for (size_t i = 0; i < bytes.size(); ++i) {
        const bool key = (v == 1) || (v == 4 && i == 1);
        uploads.push_back({key ? StoredObject::Kind::kKeyframe : StoredObject::Kind::kPatch, v - 1, bytes[i]});
      }
      if (v == 6) {
        bytes.push_back(Patch(3, 6));
        uploads.push_back({StoredObject::Kind::kPatch, 3, bytes.back()});
      }
      const Status s = w.Publish(v, SetChecksum(v), uploads);
      ASSERT_TRUE(s.ok()) << s.ToString();
    }
  }

  // Catches up from `from` (its tensors) to `to` as a puller does.
  Status CatchUp(VersionReader& r, uint64_t from, uint64_t to, std::vector<OwnedTensor>* tensors,
                 std::vector<VersionReader::Step>* plan = nullptr) {
    WSYNC_ASSIGN_OR_RETURN(auto steps, r.Plan(from, to));
    if (plan != nullptr) *plan = steps;
    for (const auto& s : steps) {
      WSYNC_ASSIGN_OR_RETURN(std::string bytes, r.Fetch(s.object));
      if (s.object.kind == StoredObject::Kind::kKeyframe) {
        WSYNC_ASSIGN_OR_RETURN(auto info, codec::InspectPatch(bytes));
        tensors->clear();
        for (const auto& t : info.tensors) {
          tensors->push_back({t.name, t.dtype, t.shape, std::vector<uint8_t>(t.DenseBytes())});
        }
      }
      auto views = buffers::MutableViews(*tensors);
      WSYNC_RETURN_IF_ERROR(codec::Apply(bytes, views, {}));
    }
    return Status::Ok();
  }

  SeaweedServer server_;
  std::unique_ptr<ObjectStore> writer_store_, reader_store_;
  std::vector<std::vector<OwnedTensor>> versions_;
};

TEST_F(VersionsTest, AReaderCatchesUpByTheFewestBytesToTheTargetBits) {
  PublishAll();
  VersionReader r(*reader_store_, kRun, 4, 64 << 10);  // small ranges: several per object
  auto newest = r.Newest();
  ASSERT_TRUE(newest.ok()) << newest.status().ToString();
  EXPECT_EQ(*newest, 6u);
  // From nothing: the keyframe of 4, then the patches to 5 and 6.
  std::vector<OwnedTensor> tensors;
  std::vector<VersionReader::Step> plan;
  Status s = CatchUp(r, 0, 6, &tensors, &plan);
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(plan[0].object.kind, StoredObject::Kind::kKeyframe);
  EXPECT_EQ(plan[0].version, 4u);
  EXPECT_TRUE(wsync::testing::SameBits(tensors, versions_[6]));
  // From 2: patches only (each far smaller than a keyframe), the merged
  // one from 3 in place of three.
  tensors = versions_[2];
  s = CatchUp(r, 2, 6, &tensors, &plan);
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_EQ(plan.size(), 2u);
  for (const auto& step : plan) EXPECT_EQ(step.object.kind, StoredObject::Kind::kPatch);
  EXPECT_EQ(plan[1].object.base, 3u);
  EXPECT_TRUE(wsync::testing::SameBits(tensors, versions_[6]));
  EXPECT_EQ(r.Plan(6, 7).status().code(), StatusCode::kNotFound);
  // A reader may not write.
  VersionWriter forger(*reader_store_, kRun);
  const std::string p = Patch(6, 5);
  EXPECT_EQ(forger.Publish(7, 0, {{StoredObject::Kind::kPatch, 6, p}}).code(), StatusCode::kPermissionDenied);
}

TEST_F(VersionsTest, CorruptTruncatedAndMissingObjectsAreRefusedByName) {
  PublishAll();
  VersionReader r(*reader_store_, kRun);
  auto m = r.ManifestOf(5);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const StoredObject patch5 = m->objects[0];
  auto original = writer_store_->Get(patch5.key);
  ASSERT_TRUE(original.ok());
  std::string flipped = *original;
  flipped[flipped.size() / 2] ^= 1;
  ASSERT_TRUE(writer_store_->Put(patch5.key, flipped).ok());
  Status s = r.Fetch(patch5).status();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_NE(s.message().find(patch5.key), std::string::npos) << s.ToString();
  ASSERT_TRUE(writer_store_->Put(patch5.key, original->substr(0, original->size() - 10)).ok());
  s = r.Fetch(patch5).status();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  ASSERT_TRUE(writer_store_->Delete(patch5.key).ok());
  s = r.Fetch(patch5).status();
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.ToString();
  EXPECT_NE(s.message().find(patch5.key), std::string::npos) << s.ToString();
  // A tensor set a refused object never reached is as it was.
  std::vector<OwnedTensor> tensors = versions_[4];
  EXPECT_FALSE(CatchUp(r, 4, 6, &tensors).ok());
  EXPECT_TRUE(wsync::testing::SameBits(tensors, versions_[4]));
  // A malformed manifest.
  ASSERT_TRUE(writer_store_->Put(ManifestKey(kRun, 9), "{\"format\": \"wsync-store-v1\", \"version\": -1}").ok());
  s = r.ManifestOf(9).status();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
}

TEST_F(VersionsTest, ASecondUploaderOfAVersionSucceedsOnlyWithTheSameObjects) {
  PublishAll();
  VersionWriter w(*writer_store_, kRun);
  const std::string p6 = Patch(5, 6), merged = Patch(3, 6);
  EXPECT_TRUE(
      w.Publish(6, SetChecksum(6), {{StoredObject::Kind::kPatch, 5, p6}, {StoredObject::Kind::kPatch, 3, merged}}).ok())
      << "the same patches again are the same version";
  const std::string other = Patch(4, 6);
  const Status s = w.Publish(6, SetChecksum(6), {{StoredObject::Kind::kPatch, 4, other}});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
}

TEST_F(VersionsTest, CollectionKeepsEveryLaterVersionReachable) {
  PublishAll();
  VersionWriter w(*writer_store_, kRun);
  auto removed = w.Collect(5);
  ASSERT_TRUE(removed.ok()) << removed.status().ToString();
  EXPECT_EQ(*removed, 3u);  // 1, 2 and 3: the keyframe of 4 reaches 5 and 6
  VersionReader r(*reader_store_, kRun);
  EXPECT_EQ(r.ManifestOf(3).status().code(), StatusCode::kNotFound);
  for (uint64_t from : {0, 2}) {
    std::vector<OwnedTensor> tensors = from == 0 ? std::vector<OwnedTensor>{} : versions_[from];
    const Status s = CatchUp(r, from, 6, &tensors);
    ASSERT_TRUE(s.ok()) << "from " << from << ": " << s.ToString();
    EXPECT_TRUE(wsync::testing::SameBits(tensors, versions_[6]));
  }
  auto left = writer_store_->List(std::string(kRun) + "/versions/");
  ASSERT_TRUE(left.ok());
  for (const auto& k : *left) EXPECT_GE(k, VersionPrefix(kRun, 4)) << k;
}

// A fresh Ed25519 key pair in PEM files under the test's directory.
std::pair<std::string, std::string> KeyPair(const std::string& name) {
  const std::string dir = ::testing::TempDir();
  const std::string priv = dir + "/" + name + ".pem", pub = dir + "/" + name + ".pub.pem";
  EVP_PKEY* k = EVP_PKEY_Q_keygen(nullptr, nullptr, "ED25519");
  FILE* f = std::fopen(priv.c_str(), "w");
  PEM_write_PrivateKey(f, k, nullptr, nullptr, 0, nullptr, nullptr);
  std::fclose(f);
  f = std::fopen(pub.c_str(), "w");
  PEM_write_PUBKEY(f, k);
  std::fclose(f);
  EVP_PKEY_free(k);
  return {priv, pub};
}

// Signed manifests: a reader with the run's public key accepts what the
// source signed, and refuses an unsigned manifest, one signed by another
// key, and one whose objects were replaced by someone who can write the
// bucket (even with SHA-256s that match the new objects).
TEST_F(VersionsTest, AReaderWithTheRunsKeyAcceptsOnlyWhatTheSourceSigned) {
  const auto [priv, pub] = KeyPair("run");
  const auto [other_priv, other_pub] = KeyPair("other");
  auto signer = Signer::FromPemFile(priv);
  auto other = Signer::FromPemFile(other_priv);
  auto verifier = Verifier::FromPemFile(pub);
  ASSERT_TRUE(signer.ok() && other.ok() && verifier.ok()) << signer.status().ToString();
  EXPECT_EQ(Signer::FromPemFile(pub).status().code(), StatusCode::kInvalidArgument) << "a public key cannot sign";
  EXPECT_EQ(Verifier::FromPemFile("/nonexistent").status().code(), StatusCode::kInvalidArgument);
  VersionWriter w(*writer_store_, kRun, signer->get());
  const std::string k1 = Keyframe(1), p2 = Patch(1, 2);
  ASSERT_TRUE(w.Publish(1, SetChecksum(1), {{StoredObject::Kind::kKeyframe, 0, k1}}).ok());
  ASSERT_TRUE(w.Publish(2, SetChecksum(2), {{StoredObject::Kind::kPatch, 1, p2}}).ok());
  VersionReader r(*reader_store_, kRun, 8, 8 << 20, verifier->get());
  std::vector<OwnedTensor> tensors;
  Status s = CatchUp(r, 0, 2, &tensors);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(wsync::testing::SameBits(tensors, versions_[2]));
  // Someone who can write the bucket replaces version 2's patch and its
  // manifest: unsigned, with the old signature, with their own key.
  const std::string forged = Patch(1, 3);  // version 3's weights presented as version 2
  VersionWriter unsigned_writer(*writer_store_, kRun), other_writer(*writer_store_, kRun, other->get());
  auto m = r.ManifestOf(2);
  ASSERT_TRUE(m.ok());
  const std::string signature = m->signature;
  for (int how = 0; how < 3; ++how) {
    ASSERT_TRUE(writer_store_->Delete(ManifestKey(kRun, 2)).ok());
    VersionWriter& forger = how == 2 ? other_writer : unsigned_writer;
    ASSERT_TRUE(forger.Publish(2, SetChecksum(3), {{StoredObject::Kind::kPatch, 1, forged}}).ok());
    if (how == 1) {  // the source's signature copied onto the forged manifest
      auto fm = r.ManifestOf(2);
      ASSERT_FALSE(fm.ok());
      auto raw = writer_store_->Get(ManifestKey(kRun, 2));
      ASSERT_TRUE(raw.ok());
      auto parsed = Manifest::Parse(*raw, "forged");
      ASSERT_TRUE(parsed.ok());
      parsed->signature = signature;
      ASSERT_TRUE(writer_store_->Put(ManifestKey(kRun, 2), parsed->ToJson()).ok());
    }
    s = r.ManifestOf(2).status();
    EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << how << ": " << s.ToString();
    tensors = versions_[1];
    EXPECT_EQ(CatchUp(r, 1, 2, &tensors).code(), StatusCode::kPermissionDenied) << how;
    EXPECT_TRUE(wsync::testing::SameBits(tensors, versions_[1]));
  }
}

}  // namespace
}  // namespace wsync::store
