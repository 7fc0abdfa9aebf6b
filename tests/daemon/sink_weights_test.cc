// A sink's weights in shared memory: patches apply in order into the region;
// readers holding the weights only ever see whole versions; bad streams
// change nothing.
#include "sink_weights.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <random>
#include <set>
#include <thread>

#include "../codec/test_tensors.h"
#include "version_history.h"

namespace wsync::daemon {
namespace {

using buffers::OwnedTensor;

struct Fixture {
  std::vector<std::vector<OwnedTensor>> versions;  // versions[k] is version k + 1
  std::unique_ptr<VersionHistory> history;
  std::vector<buffers::TensorEntry> table;
  std::string shm;
};

Fixture Make(int n) {
  Fixture s;
  std::mt19937_64 rng(9);
  s.versions.resize(n);
  s.versions[0] = {testing::RandomTensor("x", codec::DType::kBF16, {200000}, rng),
                   testing::RandomTensor("y", codec::DType::kBF16, {5000}, rng)};
  for (int k = 1; k < n; ++k) {
    for (const auto& t : s.versions[k - 1]) s.versions[k].push_back(testing::Perturb(t, 0.02, rng));
  }
  s.history = std::make_unique<VersionHistory>(VersionHistory::Options{});
  for (int k = 0; k < n; ++k) EXPECT_TRUE(s.history->Publish(k + 1, buffers::Views(s.versions[k])).ok());
  uint64_t offset = 0;
  for (const auto& t : s.versions[0]) {
    s.table.push_back({t.name, t.dtype, t.shape, offset, 0, {}});
    offset += t.bytes.size();
  }
  s.shm = "/wsync-sink-test-" + std::to_string(::getpid());
  return s;
}

std::unique_ptr<WeightStore> Store(buffers::MappedTensors tensors) {
  auto s = WeightStore::Open(std::move(tensors));
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return std::move(*s);
}

buffers::MappedTensors RegionWith(const Fixture& s, const std::vector<OwnedTensor>& content) {
  auto r = buffers::CreateShm(s.shm, 200000 * 2 + 5000 * 2, /*unlink_on_close=*/true);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  uint64_t offset = 0;
  for (const auto& t : content) {
    std::memcpy((*r)->data() + offset, t.bytes.data(), t.bytes.size());
    offset += t.bytes.size();
  }
  std::vector<std::unique_ptr<buffers::Region>> regions;
  regions.push_back(std::move(*r));
  auto m = buffers::MappedTensors::Create(std::move(regions), s.table);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return std::move(*m);
}

// Each tensor in a region of its own, as a PyTorch process's many allocations.
buffers::MappedTensors RegionPerTensor(const Fixture& s, const std::vector<OwnedTensor>& content) {
  std::vector<std::unique_ptr<buffers::Region>> regions;
  std::vector<buffers::TensorEntry> table = s.table;
  for (size_t i = 0; i < content.size(); ++i) {
    auto r = buffers::CreateShm(s.shm + "-" + std::to_string(i), content[i].bytes.size(), /*unlink_on_close=*/true);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    std::memcpy((*r)->data(), content[i].bytes.data(), content[i].bytes.size());
    regions.push_back(std::move(*r));
    table[i].offset = 0;
    table[i].region = static_cast<uint32_t>(i);
  }
  auto m = buffers::MappedTensors::Create(std::move(regions), std::move(table));
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return std::move(*m);
}

TEST(SinkWeights, HoldersOnlyEverSeeWholeVersions) {
  constexpr int kVersions = 8;
  Fixture s = Make(kVersions);
  std::set<uint64_t> valid;
  for (const auto& v : s.versions) valid.insert(codec::SetChecksum(buffers::Views(v)));
  SinkWeights w(Store(RegionWith(s, s.versions[0])), {}, 1);
  std::atomic<bool> stop{false};
  std::atomic<int> checks{0}, torn{0};
  std::thread reader([&] {
    while (!stop) {
      const uint64_t v = w.Hold();
      const uint64_t sum = codec::SetChecksum(w.Views());
      if (sum != codec::SetChecksum(buffers::Views(s.versions[v - 1])) || !valid.count(sum)) ++torn;
      ++checks;
      w.Release();
    }
  });
  for (uint64_t v = 2; v <= kVersions; ++v) {
    // Let the reader see each version at least once (applies are preferred
    // over new holds, so back-to-back applies could otherwise starve it).
    const int seen = checks.load();
    for (int spin = 0; spin < 10000 && checks.load() == seen; ++spin) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    auto stream = s.history->Open(v - 1, v);
    ASSERT_TRUE(stream.ok());
    ASSERT_TRUE(w.Apply(**stream).ok());
    EXPECT_EQ(w.applied(), v);
  }
  stop = true;
  reader.join();
  EXPECT_GT(checks.load(), 0);
  EXPECT_EQ(torn.load(), 0);
  EXPECT_TRUE(w.WaitForVersion(kVersions, std::chrono::steady_clock::now()).ok());
  EXPECT_EQ(w.WaitForVersion(kVersions + 1, std::chrono::steady_clock::now() + std::chrono::milliseconds(10)).code(),
            StatusCode::kDeadlineExceeded);
}

TEST(SinkWeights, BadStreamsChangeNothing) {
  Fixture s = Make(4);
  SinkWeights w(Store(RegionWith(s, s.versions[1])), {}, 2);
  // A patch that does not start at the applied version.
  EXPECT_EQ(w.Apply(**s.history->Open(1, 4)).code(), StatusCode::kFailedPrecondition);
  // A corrupt patch: DataLoss, weights and version unchanged.
  std::string bytes = (*s.history->Open(2, 4))->Assemble();
  bytes[bytes.size() / 2] ^= 0x40;
  auto corrupt = PatchStream::FromBytes(codec::PatchKind::kPatch, 2, 4, bytes, 4096);
  EXPECT_EQ(w.Apply(*corrupt).code(), StatusCode::kDataLoss);
  EXPECT_EQ(w.applied(), 2u);
  EXPECT_EQ(codec::SetChecksum(w.Views()), codec::SetChecksum(buffers::Views(s.versions[1])));
  // A keyframe applies over anything.
  ASSERT_TRUE(w.Apply(**s.history->Open(0, 4)).ok());
  EXPECT_EQ(w.applied(), 4u);
  EXPECT_EQ(codec::SetChecksum(w.Views()), codec::SetChecksum(buffers::Views(s.versions[3])));
  // An incomplete stream is refused.
  PatchStream partial(codec::PatchKind::kPatch, 4, 5, 10000, 4096);
  EXPECT_FALSE(w.Apply(partial).ok());
}

TEST(SinkWeights, TensorsInManyRegionsApplyBitExactly) {
  Fixture s = Make(3);
  SinkWeights w(Store(RegionPerTensor(s, s.versions[0])), {}, 1);
  ASSERT_TRUE(w.Apply(**s.history->Open(1, 3)).ok());
  EXPECT_EQ(codec::SetChecksum(w.Views()), codec::SetChecksum(buffers::Views(s.versions[2])));
}

TEST(SinkWeights, RegistrationChecksEveryRegion) {
  Fixture s = Make(1);
  std::vector<std::unique_ptr<buffers::Region>> regions;
  regions.push_back(*buffers::CreateShm(s.shm + "-small", 64, /*unlink_on_close=*/true));
  auto table = s.table;
  table[1].region = 1;  // no such region
  auto m = buffers::MappedTensors::Create(std::move(regions), table);
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("'y'"), std::string::npos) << m.status().ToString();
}

TEST(SinkWeights, PermanentSyncErrorEndsWaitsAtOnce) {
  Fixture s = Make(1);
  SinkWeights w(Store(RegionWith(s, s.versions[0])), {}, 1);
  w.SetSyncError(UnavailableError("parent gone"), /*permanent=*/false);
  Status late = w.WaitForVersion(2, std::chrono::steady_clock::now() + std::chrono::milliseconds(10));
  EXPECT_EQ(late.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(late.message().find("parent gone"), std::string::npos);
  w.SetSyncError(FailedPreconditionError("tensor 'x': shape [3]"), /*permanent=*/true);
  const auto t0 = std::chrono::steady_clock::now();
  Status now = w.WaitForVersion(2, t0 + std::chrono::seconds(30));
  EXPECT_EQ(now.code(), StatusCode::kFailedPrecondition);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

TEST(SinkWeights, ClosedWeightsRefuseApplies) {
  Fixture s = Make(2);
  SinkWeights w(Store(RegionWith(s, s.versions[0])), {}, 1);
  w.Close();
  EXPECT_EQ(w.Apply(**s.history->Open(1, 2)).code(), StatusCode::kAborted);
  EXPECT_EQ(w.applied(), 1u);
}

// A wait on weights that are closed (the tensors registered again from
// another thread, after a daemon restart) ends then, not at its deadline:
// the local API waits on the weights registered in their place.
TEST(SinkWeights, ClosingEndsWaits) {
  Fixture s = Make(1);
  SinkWeights w(Store(RegionWith(s, s.versions[0])), {}, 1);
  const auto t0 = std::chrono::steady_clock::now();
  Status waited;
  std::thread waiter([&] { waited = w.WaitForVersion(2, t0 + std::chrono::seconds(60)); });
  w.Close();
  waiter.join();
  EXPECT_EQ(waited.code(), StatusCode::kAborted) << waited.ToString();
  EXPECT_TRUE(w.closed());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
}


// Element indices where tensor a and b differ (changed) or not.
std::vector<size_t> Elements(const OwnedTensor& a, const OwnedTensor& b, bool changed) {
  std::vector<size_t> out;
  for (size_t i = 0; i < a.bytes.size() / 2; ++i) {
    if ((std::memcmp(&a.bytes[2 * i], &b.bytes[2 * i], 2) != 0) == changed) out.push_back(i);
  }
  return out;
}

// A version is staged while the weights are held, then applied once the
// hold ends; a writer other than wsync that changes the weights meanwhile
// is found: at a value the version changes, the apply is undone; elsewhere,
// the read-back after the apply reports it and the weights hold no version.
// Whether `w` stages `version` (and waits for the holds) within a minute.
bool WaitStaged(const SinkWeights& w, uint64_t version) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (w.timings().staged_version != version && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return w.timings().staged_version == version;
}

TEST(SinkWeights, AVersionIsStagedUnderTheHoldsAndForeignWritesAreFound) {
  Fixture s = Make(2);
  for (bool at_a_change : {true, false}) {
    SCOPED_TRACE(at_a_change ? "a changed value" : "an unchanged value");
    SinkWeights w(Store(RegionWith(s, s.versions[0])), {}, 1);
    ASSERT_EQ(w.Hold(), 1u);
    Status applied;
    std::thread sync([&] { applied = w.Apply(**s.history->Open(1, 2)); });
    // Staged while held: it waits for the hold with nothing written.
    ASSERT_TRUE(WaitStaged(w, 2));
    EXPECT_EQ(codec::SetChecksum(w.Views()), codec::SetChecksum(buffers::Views(s.versions[0])));
    // The holder writes one element of 'x' (a foreign writer), then releases.
    const std::vector<size_t> at = Elements(s.versions[0][0], s.versions[1][0], at_a_change);
    ASSERT_FALSE(at.empty());
    auto* x = const_cast<uint8_t*>(w.Views()[0].data);
    x[2 * at[at.size() / 2]] ^= 0x01;
    std::vector<OwnedTensor> written = s.versions[0];
    written[0].bytes[2 * at[at.size() / 2]] ^= 0x01;
    w.Release();
    sync.join();
    EXPECT_EQ(w.timings().foreign_writes, 1u);
    EXPECT_GT(w.timings().staging_ms, 0);
    if (at_a_change) {
      EXPECT_EQ(applied.code(), StatusCode::kFailedPrecondition) << applied.ToString();
      EXPECT_EQ(w.applied(), 1u);
      EXPECT_EQ(codec::SetChecksum(w.Views()), codec::SetChecksum(buffers::Views(written))) << "undone";
    } else {
      EXPECT_EQ(applied.code(), StatusCode::kDataLoss) << applied.ToString();
      EXPECT_EQ(w.applied(), 0u) << "no version until a keyframe";
    }
    // The keyframe the sink then pulls repairs them.
    ASSERT_TRUE(w.Apply(**s.history->Open(0, 2)).ok());
    EXPECT_EQ(codec::SetChecksum(w.Views()), codec::SetChecksum(buffers::Views(s.versions[1])));
    EXPECT_EQ(w.applied(), 2u);
  }
}

// Staging that keeps no change (--stage-mib 0) checks each chunk before the
// holds end and decodes it again after: a foreign write found there once an
// earlier chunk is written cannot be undone, and the weights hold no version
// until the keyframe the sink pulls.
TEST(SinkWeights, AWriteFoundPastTheStagingBudgetLeavesNoVersionUntilAKeyframe) {
  Fixture s = Make(2);
  codec::ApplyOptions options;
  options.stage_keep_bytes = 0;
  SinkWeights w(Store(RegionWith(s, s.versions[0])), options, 1);
  ASSERT_EQ(w.Hold(), 1u);
  Status applied;
  std::thread sync([&] { applied = w.Apply(**s.history->Open(1, 2)); });
  ASSERT_TRUE(WaitStaged(w, 2));
  // A foreign write at a value of 'y' the patch changes: 'x' is written before it is found.
  const std::vector<size_t> at = Elements(s.versions[0][1], s.versions[1][1], /*changed=*/true);
  ASSERT_FALSE(at.empty());
  auto* y = const_cast<uint8_t*>(w.Views()[1].data);
  y[2 * at[0]] ^= 0x01;
  w.Release();
  sync.join();
  EXPECT_EQ(applied.code(), StatusCode::kDataLoss) << applied.ToString();
  EXPECT_NE(applied.message().find("'y'"), std::string::npos) << applied.ToString();
  EXPECT_EQ(w.applied(), 0u) << "no version until a keyframe";
  EXPECT_EQ(w.timings().foreign_writes, 1u);
  ASSERT_TRUE(w.Apply(**s.history->Open(0, 2)).ok());
  EXPECT_EQ(codec::SetChecksum(w.Views()), codec::SetChecksum(buffers::Views(s.versions[1])));
  EXPECT_EQ(w.applied(), 2u);
}

}  // namespace
}  // namespace wsync::daemon
