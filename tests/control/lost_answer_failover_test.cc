// Multi-process: three `wsyncd coordinator --etcd` replicas over a real
// etcd. The leader is killed between committing a call and answering it
// (the call carries fault-injection metadata only that replica honours), so
// the client's retry reaches the replica elected next. For every mutating
// call that commits, the retry returns the first attempt's effect: no second
// lease or incarnation, no committed call reported failed, no version lost
// or published twice.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "etcd_member.h"
#include "fault_injection.h"
#include "wsync/control/client.h"

namespace wsync::control {
namespace {

namespace v1 = wsync::v1;
using namespace std::chrono_literals;

class Replica {
 public:
  Replica(const EtcdMember& etcd, const std::string& prefix, bool inject) {
    address_ = "127.0.0.1:" + std::to_string(FreePort());
    std::vector<std::string> args = {WSYNCD_BINARY, "coordinator", "--listen", address_, "--advertise", address_,
                                     "--etcd", etcd.endpoint(), "--etcd-prefix", prefix, "--lease-ttl-s", "1"};
    if (inject) args.push_back("--inject-faults");
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    EXPECT_EQ(::posix_spawn(&pid_, WSYNCD_BINARY, nullptr, nullptr, argv.data(), environ), 0);
  }
  ~Replica() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  const std::string& address() const { return address_; }
  // Whether the process ended (and reaps it).
  bool Died() {
    if (pid_ <= 0) return true;
    if (::waitpid(pid_, nullptr, WNOHANG) == pid_) pid_ = -1;
    return pid_ <= 0;
  }

 private:
  std::string address_;
  pid_t pid_ = -1;
};

std::unique_ptr<CoordinatorClient> Client(const std::string& addresses, bool inject) {
  ClientOptions o;
  o.address = addresses;
  o.timeout_ms = 30'000;  // past the election that follows the kill
  if (inject) o.test_metadata = {{fault::kMetadataKey, fault::kDieAfterCommit}};
  auto c = NewCoordinatorClient(o);
  EXPECT_TRUE(c.ok());
  return std::move(*c);
}

v1::RegisterRequest Node(const std::string& name) {
  v1::RegisterRequest r;
  r.set_name(name);
  r.set_role(v1::ROLE_SINK);
  r.set_ttl_ms(60'000);
  return r;
}

v1::VersionSummary Version(uint64_t v) {
  v1::VersionSummary s;
  s.set_version(v);
  s.set_keyframe(v == 1);
  s.set_base_version(v - 1);
  s.set_source("trainer");
  return s;
}

// Replica 0 (which honours the injected fault) leads, 1 and 2 follow, over
// a fresh prefix; `setup` runs through a client without the fault; then
// `call` through one with it: replica 0 dies after committing, the others
// take over, and `call` must succeed there; `check` runs after.
class LostAnswerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { etcd_ = new EtcdMember(); }
  static void TearDownTestSuite() {
    delete etcd_;
    etcd_ = nullptr;
  }

  void SetUp() override {
    ASSERT_TRUE(etcd_->started()) << "etcd is not installed (scripts/install-deps.sh installs etcd-server)";
    ASSERT_TRUE(Eventually([&] { return etcd_->Ctl("endpoint health") == 0; })) << "etcd did not come up";
    const std::string prefix = std::string("/lost-") + ::testing::UnitTest::GetInstance()->current_test_info()->name();
    replicas_.push_back(std::make_unique<Replica>(*etcd_, prefix, true));
    ASSERT_TRUE(Eventually([&] {
      // A new channel each time: one refused at first waits out gRPC's reconnect backoff.
      auto r = Client(replicas_[0]->address(), false)->DescribeReplica();
      return r.ok() && r->role() == v1::ReplicaResponse::LEADER;
    })) << "the first replica did not lead";
    replicas_.push_back(std::make_unique<Replica>(*etcd_, prefix, false));
    replicas_.push_back(std::make_unique<Replica>(*etcd_, prefix, false));
    addresses_ = replicas_[0]->address() + "," + replicas_[1]->address() + "," + replicas_[2]->address();
    plain_ = Client(addresses_, false);
    injected_ = Client(addresses_, true);
  }

  // After the injected call: the leader died of it (its answer was lost).
  void ExpectTheLeaderDied() {
    EXPECT_TRUE(Eventually([&] { return replicas_[0]->Died(); }, 10s))
        << "the leader did not die after the commit: the fault was not exercised";
  }

  static EtcdMember* etcd_;
  std::vector<std::unique_ptr<Replica>> replicas_;
  std::string addresses_;
  std::unique_ptr<CoordinatorClient> plain_, injected_;
};
EtcdMember* LostAnswerTest::etcd_ = nullptr;

TEST_F(LostAnswerTest, RegisterGivesOneIncarnation) {
  ASSERT_TRUE(plain_->Register(Node("first")).ok());
  auto r = injected_->Register(Node("sink"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectTheLeaderDied();
  auto next = plain_->Register(Node("later"));
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->node().incarnation(), r->node().incarnation() + 1)
      << "the retry minted a second incarnation of the node";
  auto status = plain_->GetStatus();
  ASSERT_TRUE(status.ok());
  for (const auto& n : status->nodes()) {
    if (n.name() == "sink") {
      EXPECT_EQ(n.incarnation(), r->node().incarnation());
    }
  }
}

TEST_F(LostAnswerTest, AcquireLeaseGrantsOneLease) {
  ASSERT_TRUE(plain_->Register(Node("sink")).ok());
  ASSERT_TRUE(plain_->Publish(Version(1)).ok());
  auto lease = injected_->AcquireLease("sink", 1, 60'000);
  ASSERT_TRUE(lease.ok()) << lease.status().ToString();
  ExpectTheLeaderDied();
  auto leases = plain_->ListLeases();
  ASSERT_TRUE(leases.ok());
  ASSERT_EQ(leases->leases_size(), 1) << "the retry granted a second lease";
  EXPECT_EQ(leases->leases(0).id(), lease->id());
}

TEST_F(LostAnswerTest, RenewLeaseRenewsTheLease) {
  ASSERT_TRUE(plain_->Register(Node("sink")).ok());
  ASSERT_TRUE(plain_->Publish(Version(1)).ok());
  auto lease = plain_->AcquireLease("sink", 1, 10'000);
  ASSERT_TRUE(lease.ok());
  auto renewed = injected_->RenewLease(lease->id(), 60'000);
  ASSERT_TRUE(renewed.ok()) << renewed.status().ToString();
  ExpectTheLeaderDied();
  auto leases = plain_->ListLeases();
  ASSERT_TRUE(leases.ok());
  ASSERT_EQ(leases->leases_size(), 1);
  EXPECT_GT(leases->leases(0).expires_unix_ms(), lease->expires_unix_ms());
}

TEST_F(LostAnswerTest, ReleaseLeaseSucceedsOnce) {
  ASSERT_TRUE(plain_->Register(Node("sink")).ok());
  ASSERT_TRUE(plain_->Publish(Version(1)).ok());
  auto lease = plain_->AcquireLease("sink", 1, 60'000);
  ASSERT_TRUE(lease.ok());
  Status released = injected_->ReleaseLease(lease->id());
  EXPECT_TRUE(released.ok()) << "a committed release reported failed: " << released.ToString();
  ExpectTheLeaderDied();
  auto leases = plain_->ListLeases();
  ASSERT_TRUE(leases.ok());
  EXPECT_EQ(leases->leases_size(), 0);
}

TEST_F(LostAnswerTest, DeregisterSucceedsOnce) {
  ASSERT_TRUE(plain_->Register(Node("sink")).ok());
  Status gone = injected_->Deregister("sink");
  EXPECT_TRUE(gone.ok()) << "a committed deregistration reported failed: " << gone.ToString();
  ExpectTheLeaderDied();
  auto status = plain_->GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->nodes_size(), 0);
}

TEST_F(LostAnswerTest, PublishStoresTheVersionOnce) {
  ASSERT_TRUE(plain_->Publish(Version(1)).ok());
  auto head = injected_->Publish(Version(2));
  ASSERT_TRUE(head.ok()) << head.status().ToString();
  EXPECT_EQ(*head, 2u);
  ExpectTheLeaderDied();
  auto versions = plain_->ListVersions(0);
  ASSERT_TRUE(versions.ok());
  ASSERT_EQ(versions->versions_size(), 2);
  EXPECT_EQ(versions->versions(1).version(), 2u);
  EXPECT_TRUE(plain_->Publish(Version(2)).ok()) << "the same summary again is Ok";
}

TEST_F(LostAnswerTest, SetLayoutSetsItOnce) {
  v1::Layout layout;
  layout.set_source("trainer");
  auto* t = layout.add_tensors();
  t->set_name("w");
  t->set_dtype("BF16");
  t->add_shape(8);
  Status set = injected_->SetLayout(layout);
  EXPECT_TRUE(set.ok()) << set.ToString();
  ExpectTheLeaderDied();
  auto got = plain_->GetLayout();
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(got->set());
  EXPECT_EQ(got->layout().tensors_size(), 1);
}

}  // namespace
}  // namespace wsync::control
