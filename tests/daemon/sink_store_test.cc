// A sink's store tier in-process: SinkCore over the coordinator state
// machine and the loopback transport, reading a real S3-compatible server
// (SeaweedFS on loopback) into which a source's StoreMirror uploads. A
// sink whose parent cannot be reached reads the store and relays what it
// read; a store of another run under the same version numbers is refused,
// naming the setting, with the weights left as they were.
#include <gtest/gtest.h>

#include <cstdlib>

#include "../store/seaweedfs.h"
#include "sink_fixture.h"
#include "store_mirror.h"
#include "store_tier.h"

namespace wsync::daemon {
namespace {

using namespace sinktest;  // NOLINT

class SinkStoreTest : public SinkCoreTest {
 protected:
  void SetUp() override {
    SinkCoreTest::SetUp();
    ASSERT_TRUE(server_.Ready("weights"));
    url_ = "s3://weights?endpoint=" + server_.endpoint();
  }
  void As(const char* access, const char* secret) {
    ::setenv("AWS_ACCESS_KEY_ID", access, 1);
    ::setenv("AWS_SECRET_ACCESS_KEY", secret, 1);
  }
  // Mirrors each version `source` publishes of `versions` into run `run`.
  void PublishMirrored(TestSource& source, const std::string& run, const std::vector<std::vector<OwnedTensor>>& versions) {
    As(store::testing::SeaweedServer::kAccessKey, store::testing::SeaweedServer::kSecretKey);
    StoreMirrorOptions o;
    o.url = url_;
    o.run = run;
    auto mirror = StoreMirror::Start(o, &source.history);
    ASSERT_TRUE(mirror.ok()) << mirror.status().ToString();
    for (size_t k = 0; k < versions.size(); ++k) {
      source.Publish(k + 1, versions[k]);
      (*mirror)->Published(source.published);
    }
    ASSERT_TRUE((*mirror)->WaitUploaded(versions.size(), std::chrono::steady_clock::now() + kEventDeadline));
    ASSERT_EQ((*mirror)->stats().uploaded, versions.size()) << (*mirror)->stats().last_error.ToString();
  }
  // The store tier of run `run`, with read-only credentials.
  std::unique_ptr<StoreTier> Tier(const std::string& run) {
    As(store::testing::SeaweedServer::kReadKey, store::testing::SeaweedServer::kReadSecret);
    StoreTierOptions o;
    o.url = url_;
    o.run = run;
    auto tier = StoreTier::Open(o);
    EXPECT_TRUE(tier.ok()) << tier.status().ToString();
    return tier.ok() ? std::move(*tier) : nullptr;
  }
  store::testing::SeaweedServer server_;
  std::string url_;
};

TEST_F(SinkStoreTest, ReadsTheStoreWhenItsParentIsUnreachableAndRelaysIt) {
  auto v = Versions(3);
  TestSource source(state_.get(), fabric_);
  PublishMirrored(source, "runs/a", v);
  // The source's data plane goes (its registration stays): no daemon serves version 3.
  source.plane.Close();
  source.plane.transport.reset();
  auto tier = Tier("runs/a");
  ASSERT_TRUE(tier);
  TestSink reader("sink-a", state_.get(), fabric_, {}, true, tier.get());
  ASSERT_TRUE(reader.RegisterMemory(Zeros(v[0])).ok());
  reader.ExpectReaches(3, v[2]);
  WaitReported("sink-a", 3);
  // Rooted by the store, it is a parent (fan-out 1: the source has its one
  // child): the next sink, which reads no store, gets version 3 from it.
  TestSink child("sink-b", state_.get(), fabric_);
  ASSERT_TRUE(child.RegisterMemory(Zeros(v[0])).ok());
  child.ExpectReaches(3, v[2]);
  EXPECT_EQ(ParentOf("sink-b"), "sink-a");
}

TEST_F(SinkStoreTest, AStoreOfAnotherRunIsRefusedNamingTheSetting) {
  auto v = Versions(3);
  TestSource source(state_.get(), fabric_);
  PublishMirrored(source, "runs/a", v);
  // Another run's versions 1..3 (other weights under the same numbers).
  {
    control::CoordinatorOptions o;
    auto other_state = control::CoordinatorState::Create(o, &clock_, control::NewNullStore(), control::Recovered());
    ASSERT_TRUE(other_state.ok());
    TestSource other(other_state->get(), fabric_, {}, "other-source");
    PublishMirrored(other, "runs/b", {v[2], v[1], v[0]});
  }
  source.plane.Close();
  source.plane.transport.reset();
  auto tier = Tier("runs/b");
  ASSERT_TRUE(tier);
  TestSink sink("sink-a", state_.get(), fabric_, {}, true, tier.get());
  const auto zeros = Zeros(v[0]);
  ASSERT_TRUE(sink.RegisterMemory(zeros).ok());
  const auto until = std::chrono::steady_clock::now() + kEventDeadline;
  while (sink.core->status().sync_error.message().find("--store-run") == std::string::npos &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(10ms);
  }
  const SinkStatus st = sink.core->status();
  EXPECT_NE(st.sync_error.message().find("set checksums differ"), std::string::npos) << st.sync_error.ToString();
  EXPECT_EQ(st.applied, 0u);
  auto w = sink.core->weights();
  w->Hold();
  std::vector<OwnedTensor> held;
  for (const auto& t : w->Views()) held.push_back({t.name, t.dtype, t.shape, {t.data, t.data + t.NumBytes()}});
  w->Release();
  EXPECT_TRUE(testing::SameBits(held, zeros)) << "nothing of the other run was written";
}

}  // namespace
}  // namespace wsync::daemon
