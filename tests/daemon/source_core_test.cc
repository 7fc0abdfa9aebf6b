// The source's publish sequence in-process: SourceCore over the real
// coordinator state machine (control::InProcessClient, a fake clock) and
// shared memory the test writes as a trainer would. Versions and layout
// checks, the staleness policy naming the lagging sink, an announce that
// fails and its retry (only with the same weights), a publish that returns
// after the copy, and what the history keeps.
#include "source_core.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <tuple>

#include "../codec/test_tensors.h"
#include "wsync/control/testing/fake_clock.h"
#include "wsync/control/testing/in_process_client.h"

namespace wsync::daemon {
namespace {

namespace v1 = wsync::v1;
using buffers::OwnedTensor;

std::vector<std::vector<OwnedTensor>> Versions(int n) {
  std::mt19937_64 rng(31);
  std::vector<std::vector<OwnedTensor>> v(n);
  v[0] = {testing::RandomTensor("a", codec::DType::kBF16, {200000}, rng),
          testing::RandomTensor("b", codec::DType::kBF16, {3000}, rng)};
  for (int k = 1; k < n; ++k) {
    for (const auto& t : v[k - 1]) v[k].push_back(testing::PerturbByExponent(t, 0.01, 120, rng));
  }
  return v;
}

// The trainer's memory: one shared-memory region the test writes.
struct TrainerMemory {
  explicit TrainerMemory(const std::vector<OwnedTensor>& like) {
    static int counter = 0;
    const std::string shm = "/wsync-sourcecore-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    uint64_t size = 0;
    for (const auto& t : like) {
      table.push_back({t.name, t.dtype, t.shape, size, 0, {}});
      size += t.bytes.size();
    }
    auto r = buffers::CreateShm(shm, size, /*unlink_on_close=*/true);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    owner = std::move(*r);
    auto mine = buffers::OpenShm(shm);
    EXPECT_TRUE(mine.ok());
    daemon_side = std::move(*mine);
  }
  void Write(const std::vector<OwnedTensor>& w) {
    for (size_t i = 0; i < w.size(); ++i) std::memcpy(owner->data() + table[i].offset, w[i].bytes.data(), w[i].bytes.size());
  }
  buffers::MappedTensors Mapped() {
    std::vector<std::unique_ptr<buffers::Region>> regions;
    regions.push_back(std::move(daemon_side));
    auto m = buffers::MappedTensors::Create(std::move(regions), table);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    return std::move(*m);
  }
  std::vector<buffers::TensorEntry> table;
  std::unique_ptr<buffers::Region> owner, daemon_side;
};

class SourceCoreTest : public ::testing::Test {
 protected:
  void Start(control::CoordinatorOptions o = {}) {
    auto s = control::CoordinatorState::Create(o, &clock_, control::NewNullStore(), control::Recovered());
    ASSERT_TRUE(s.ok());
    state_ = std::move(*s);
    client_ = std::make_unique<control::InProcessClient>(state_.get());
  }
  std::unique_ptr<SourceCore> NewSource() {
    DataDaemonConfig config;
    config.name = "source";
    config.retain_versions = 2;
    v1::RegisterRequest r;
    r.set_name("source");
    r.set_role(v1::ROLE_SOURCE);
    r.set_ttl_ms(10'000);
    EXPECT_TRUE(client_->Register(r).ok());
    return std::make_unique<SourceCore>(config, client_.get(), &pool_);
  }
  uint64_t CoordinatorHead() { return state_->head(); }
  // The row cuts of the first tensor's grid, as the coordinator recorded them.
  std::vector<uint64_t> RowCuts() {
    const auto cuts = state_->GetLayout().layout().tensors(0).row_cuts();
    return {cuts.begin(), cuts.end()};
  }
  // `pub`, version 3, is a patch from the head coded on the grid cutting
  // tensor "a" at `row_cuts`, which the coordinator recorded.
  void ExpectOnGrid(const StatusOr<PublishResult>& pub, const std::vector<OwnedTensor>& weights,
                    const std::vector<uint64_t>& row_cuts) {
    ASSERT_TRUE(pub.ok()) << pub.status().ToString();
    EXPECT_EQ(pub->published.base_version, 2u) << "a patch from the head";
    const std::vector<codec::TileGrid> grids = {{"a", row_cuts, {}}};
    EXPECT_EQ(pub->published.set_checksum, *codec::SetChecksum(buffers::Views(weights), grids));
    EXPECT_EQ(RowCuts(), row_cuts);
  }

  // A source with the trainer's memory registered and version 1 published.
  struct Running {
    std::vector<std::vector<OwnedTensor>> v;
    std::unique_ptr<TrainerMemory> mem;
    std::unique_ptr<SourceCore> source;
  };
  Running WithFirstVersion(int versions) {
    Running r;
    r.v = Versions(versions);
    r.mem = std::make_unique<TrainerMemory>(r.v[0]);
    r.source = NewSource();
    EXPECT_TRUE(r.source->RegisterTensors(r.mem->Mapped()).ok());
    r.mem->Write(r.v[0]);
    EXPECT_TRUE(r.source->Publish({1}).ok());
    return r;
  }

  control::FakeClock clock_;
  std::unique_ptr<control::CoordinatorState> state_;
  std::unique_ptr<control::InProcessClient> client_;
  ThreadPool pool_{2};
};

TEST_F(SourceCoreTest, PublishesVersionsAndRefusesOldOnes) {
  Start();
  auto v = Versions(3);
  TrainerMemory mem(v[0]);
  auto source = NewSource();
  auto reg = source->RegisterTensors(mem.Mapped());
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  EXPECT_EQ(reg->head, 0u);
  for (int k = 0; k < 3; ++k) {
    mem.Write(v[k]);
    auto pub = source->Publish({static_cast<uint64_t>(k + 1)});
    ASSERT_TRUE(pub.ok()) << pub.status().ToString();
    EXPECT_EQ(pub->published.base_version, static_cast<uint64_t>(k));
    EXPECT_EQ(pub->published.set_checksum, codec::SetChecksum(buffers::Views(v[k])));
    EXPECT_EQ(CoordinatorHead(), static_cast<uint64_t>(k + 1));
  }
  auto again = source->Publish({3});
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(again.status().message().find("next valid version is 4"), std::string::npos) << again.status().ToString();
  // The history serves what sinks pull.
  auto patch = source->provider()->Open(1, 3);
  ASSERT_TRUE(patch.ok()) << patch.status().ToString();
  EXPECT_EQ((*patch)->kind(), codec::PatchKind::kPatch);
}

// The layout is the coordinator's: a restarted source registering another
// model is refused, naming the tensor; its versions continue the head.
TEST_F(SourceCoreTest, ARestartedSourceKeepsTheLayoutAndTheVersions) {
  Start();
  auto [v, mem, source] = WithFirstVersion(2);
  source.reset();
  auto restarted = NewSource();
  std::vector<OwnedTensor> other = v[0];
  other[1].name = "c";
  TrainerMemory wrong(other);
  auto refused = restarted->RegisterTensors(wrong.Mapped());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("'c'"), std::string::npos) << refused.status().ToString();
  TrainerMemory right(v[0]);
  auto reg = restarted->RegisterTensors(right.Mapped());
  ASSERT_TRUE(reg.ok());
  EXPECT_EQ(reg->head, 1u);
  right.Write(v[1]);
  EXPECT_EQ(restarted->Publish({1}).status().code(), StatusCode::kFailedPrecondition);
  auto pub = restarted->Publish({2});
  ASSERT_TRUE(pub.ok()) << pub.status().ToString();
  EXPECT_EQ(pub->published.base_version, 0u) << "a restarted source starts with a keyframe";
}

// Registering again with other layouts to serve (a resized rollout fleet)
// changes the tile grids from the next version on: that version is a patch
// from the head, coded on the new grids, which the coordinator records.
TEST_F(SourceCoreTest, OtherLayoutsServedChangeTheGridsFromTheNextVersion) {
  Start();
  auto v = Versions(3);
  auto rows = [](uint64_t n) {
    return std::vector<codec::RuntimeTensor>{
        {{"a.part", codec::DType::kBF16, {n}, nullptr}, {{"a", {0}, {n}, {0}}}},
        {{"b", codec::DType::kBF16, {3000}, nullptr}, {{"b", {0}, {3000}, {0}}}}};
  };
  TrainerMemory first(v[0]);
  auto source = NewSource();
  ASSERT_TRUE(source->RegisterTensors(first.Mapped(), {rows(100000)}).ok());
  for (int k = 0; k < 2; ++k) {
    first.Write(v[k]);
    ASSERT_TRUE(source->Publish({static_cast<uint64_t>(k + 1)}).ok());
  }
  ASSERT_EQ(state_->GetLayout().layout().tensors(0).row_cuts_size(), 1);
  TrainerMemory second(v[1]);
  auto reg = source->RegisterTensors(second.Mapped(), {rows(100000), rows(50000)});
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  EXPECT_EQ(reg->head, 2u);
  EXPECT_EQ(state_->GetLayout().layout().tensors(0).row_cuts_size(), 2) << "recorded at once: new sinks may register";
  second.Write(v[2]);
  auto pub = source->Publish({3});
  ExpectOnGrid(pub, v[2], {50000, 100000});
  auto patch = source->provider()->Open(2, 3);
  ASSERT_TRUE(patch.ok());
  auto work = v[1];
  auto views = buffers::MutableViews(work);
  ASSERT_TRUE(codec::Apply((*patch)->Assemble(), views, {}).ok());
  EXPECT_TRUE(testing::SameBits(work, v[2]));
}

// A source serving the layouts sinks offer reads the offers before every
// publish: a layout offered after registration is served from the next
// version on (new tile grids, a patch from the head), with no registration
// again; a layout that does not fit the tensors is left out.
TEST_F(SourceCoreTest, LayoutsOfferedLaterAreServedFromTheNextVersion) {
  Start();
  auto v = Versions(3);
  auto rows = [](uint64_t n) {
    v1::ServedLayout l;
    for (const auto& [name, shape, extent] : {std::tuple<std::string, uint64_t, uint64_t>{"a.part", n, n},
                                              {"b", 3000, 3000}}) {
      v1::TensorSpec* t = l.add_tensors();
      t->set_name(name);
      t->set_dtype("BF16");
      t->add_shape(shape);
      v1::PieceSpec* p = t->add_pieces();
      p->set_canonical(name == "b" ? "b" : "a");
      p->add_start(0);
      p->add_extent(extent);
      p->add_at(0);
    }
    return l;
  };
  ASSERT_TRUE(client_->OfferLayout("rank-a", rows(100000)).ok());
  TrainerMemory mem(v[0]);
  auto source = NewSource();
  ASSERT_TRUE(source->RegisterTensors(mem.Mapped(), {}, 0, 1, /*serve_offered=*/true).ok());
  for (int k = 0; k < 2; ++k) {
    mem.Write(v[k]);
    ASSERT_TRUE(source->Publish({static_cast<uint64_t>(k + 1)}).ok());
  }
  ASSERT_EQ(state_->GetLayout().layout().tensors(0).row_cuts_size(), 1);
  // A new rank offers another layout, and a sink of another model one that fits nothing here.
  ASSERT_TRUE(client_->OfferLayout("rank-b", rows(50000)).ok());
  v1::ServedLayout foreign = rows(10);
  foreign.mutable_tensors(0)->mutable_pieces(0)->set_canonical("not-here");
  ASSERT_TRUE(client_->OfferLayout("other-model", foreign).ok());
  mem.Write(v[2]);
  auto pub = source->Publish({3});
  ExpectOnGrid(pub, v[2], {50000, 100000});
  // The first rank's offer is gone (its node deregistered, or the coordinator restarted): still served.
  ASSERT_TRUE(client_->OfferLayout("rank-a", rows(50000)).ok());
  ASSERT_TRUE(source->Publish({4}).ok());
  EXPECT_EQ(RowCuts(), (std::vector<uint64_t>{50000, 100000}));
}

// The staleness bound holds a version back and names the sink and why.
TEST_F(SourceCoreTest, TheStalenessBoundNamesTheLaggingSink) {
  control::CoordinatorOptions o;
  o.max_staleness = 1;
  Start(o);
  auto v = Versions(3);
  TrainerMemory mem(v[0]);
  auto source = NewSource();
  ASSERT_TRUE(source->RegisterTensors(mem.Mapped()).ok());
  v1::RegisterRequest sink;
  sink.set_name("rollout-7");
  sink.set_role(v1::ROLE_SINK);
  sink.set_ttl_ms(10'000);
  ASSERT_TRUE(client_->Register(sink).ok());
  v1::HeartbeatRequest hb;
  hb.set_name("rollout-7");
  hb.set_incarnation(2);
  hb.set_active_holds(1);
  hb.set_oldest_hold_ms(42'000);
  (void)client_->Heartbeat(hb);
  mem.Write(v[0]);
  ASSERT_TRUE(source->Publish({1}).ok());
  ASSERT_TRUE(client_->ReportApplied("rollout-7", 1).ok());
  mem.Write(v[1]);
  ASSERT_TRUE(source->Publish({2}).ok());  // one version behind: within the bound
  mem.Write(v[2]);
  auto held = source->Publish({3, /*wait_ms=*/50});
  EXPECT_EQ(held.status().code(), StatusCode::kAborted) << held.status().ToString();
  EXPECT_NE(held.status().message().find("'rollout-7' at version 1 of 2: 1 hold(s) active, the oldest for 42.0 s"),
            std::string::npos)
      << held.status().ToString();
  ASSERT_TRUE(client_->ReportApplied("rollout-7", 2).ok());
  EXPECT_TRUE(source->Publish({3}).ok());
}

// An announce the coordinator never confirms: the version is encoded but
// not published. The same weights again are a retry; other weights are
// refused (they must not pass as that version).
TEST_F(SourceCoreTest, AnUnconfirmedVersionIsRetriedOnlyWithItsWeights) {
  Start();
  auto [v, mem, source] = WithFirstVersion(3);
  mem->Write(v[1]);
  client_->FailNextPublishes(4);  // every attempt of the announce (about 3.5 s of backoff)
  auto lost = source->Publish({2});
  EXPECT_EQ(lost.status().code(), StatusCode::kUnavailable) << lost.status().ToString();
  EXPECT_NE(lost.status().message().find("did not confirm"), std::string::npos) << lost.status().ToString();
  EXPECT_EQ(CoordinatorHead(), 1u);
  // Other weights under the same number: refused, naming the next one.
  mem->Write(v[2]);
  auto other = source->Publish({2});
  EXPECT_EQ(other.status().code(), StatusCode::kFailedPrecondition) << other.status().ToString();
  EXPECT_NE(other.status().message().find("encoded from other weights"), std::string::npos);
  // The same weights: the retry announces the encoded version.
  mem->Write(v[1]);
  auto retried = source->Publish({2});
  ASSERT_TRUE(retried.ok()) << retried.status().ToString();
  EXPECT_EQ(CoordinatorHead(), 2u);
  EXPECT_EQ(retried->published.set_checksum, codec::SetChecksum(buffers::Views(v[1])));
}

// return_after_copy: Publish returns once the copy is taken; the next
// Publish finds the version announced.
TEST_F(SourceCoreTest, APublishReturnsAfterTheCopyAndCompletesInTheBackground) {
  Start();
  auto [v, mem, source] = WithFirstVersion(3);
  mem->Write(v[1]);
  auto pending = source->Publish({2, 0, /*return_after_copy=*/true});
  ASSERT_TRUE(pending.ok()) << pending.status().ToString();
  EXPECT_TRUE(pending->pending);
  mem->Write(v[2]);  // the trainer steps on at once: the copy is the source's
  auto next = source->Publish({3});
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(next->published.base_version, 2u);
  EXPECT_EQ(CoordinatorHead(), 3u);
  const v1::ListVersionsResponse versions = state_->ListVersions(1);
  ASSERT_EQ(versions.versions_size(), 2);
  EXPECT_EQ(versions.versions(0).set_checksum(), codec::SetChecksum(buffers::Views(v[1])));
}

// Heartbeats move the history's oldest copy forward to what live sinks
// need, keeping the last retain_versions (2) versions.
TEST_F(SourceCoreTest, HeartbeatsRetainWhatSinksNeed) {
  Start();
  auto v = Versions(6);
  TrainerMemory mem(v[0]);
  auto source = NewSource();
  ASSERT_TRUE(source->RegisterTensors(mem.Mapped()).ok());
  for (int k = 0; k < 6; ++k) {
    mem.Write(v[k]);
    ASSERT_TRUE(source->Publish({static_cast<uint64_t>(k + 1)}).ok());
  }
  v1::HeartbeatRequest hb;
  hb.set_name("source");
  hb.set_incarnation(1);
  auto r = client_->Heartbeat(hb);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  source->OnHeartbeat(*r);
  // No sink needs anything: the last 2 versions before the head stay.
  EXPECT_TRUE(source->provider()->Open(4, 6).ok());
  auto gone = source->provider()->Open(2, 6);
  ASSERT_TRUE(gone.ok());
  EXPECT_EQ((*gone)->kind(), codec::PatchKind::kKeyframe) << "version 2 is forgotten: a keyframe instead";
}

}  // namespace
}  // namespace wsync::daemon
