// Coordinator replicas: a client follows the leader a replica names, over
// real gRPC; and over a real etcd (Debian's etcd-server, one member started
// by the test), a leader that another replica replaced can no longer write:
// its write fails NOT_LEADER, changes nothing, and the new leader holds
// exactly what the old one acknowledged.
#include "wsync/control/replica.h"

#include <gtest/gtest.h>

#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <thread>

#include "etcd_member.h"
#include "wsync/control/client.h"
#include "wsync/control/server.h"

extern char** environ;

namespace wsync::control {
namespace {

namespace v1 = wsync::v1;
using namespace std::chrono_literals;

v1::VersionSummary V(uint64_t v) {
  v1::VersionSummary s;
  s.set_version(v);
  s.set_keyframe(true);
  s.set_source("trainer-0");
  return s;
}


// A replica that never leads and names `leader` (empty: none known).
class Follower : public StateHolder {
 public:
  explicit Follower(std::string leader) : leader_(std::move(leader)) {}
  StatusOr<std::shared_ptr<CoordinatorState>> Current() override { return NotLeaderError(leader_); }

 private:
  std::string leader_;
};

struct Served {
  std::unique_ptr<CoordinatorState> state;
  std::unique_ptr<CoordinatorServer> server;
  std::string address;
};

Served ServeState() {
  Served s;
  s.state = std::move(*CoordinatorState::Create({}, SystemClock(), NewNullStore(), Recovered()));
  ServerOptions o;
  o.listen = {"127.0.0.1:0"};
  s.server = std::move(*CoordinatorServer::Start(o, s.state.get()));
  s.address = "127.0.0.1:" + std::to_string(s.server->ports()[0]);
  return s;
}

// Serves what `holder` holds on loopback; its address.
std::unique_ptr<CoordinatorServer> Serve(StateHolder* holder, std::string* address) {
  ServerOptions o;
  o.listen = {"127.0.0.1:0"};
  auto server = CoordinatorServer::Start(o, holder);
  EXPECT_TRUE(server.ok());
  *address = "127.0.0.1:" + std::to_string((*server)->ports()[0]);
  return std::move(*server);
}

TEST(ReplicaClient, FollowsTheLeaderAReplicaNames) {
  Served leader = ServeState();
  Follower follower(leader.address);
  std::string follower_address;
  auto server = Serve(&follower, &follower_address);
  ClientOptions o;
  o.address = follower_address;  // only the follower: the leader is learnt from its answer
  auto client = NewCoordinatorClient(o);
  ASSERT_TRUE(client.ok());
  auto head = (*client)->Publish(V(1));
  ASSERT_TRUE(head.ok()) << head.status().ToString();
  EXPECT_EQ(*head, 1u);
  EXPECT_EQ(leader.state->head(), 1u);
}

TEST(ReplicaClient, WithoutALeaderACallFailsAtItsDeadlineNamingWhy) {
  Follower a(""), b("");
  std::string address_a, address_b;
  auto server_a = Serve(&a, &address_a);
  auto server_b = Serve(&b, &address_b);
  ClientOptions o;
  o.address = address_a + "," + address_b;
  o.timeout_ms = 1000;
  auto client = NewCoordinatorClient(o);
  ASSERT_TRUE(client.ok());
  const auto t0 = std::chrono::steady_clock::now();
  auto head = (*client)->Publish(V(1));
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(head.ok());
  EXPECT_TRUE(head.status().HasReason(reasons::kNotLeader)) << head.status().ToString();
  EXPECT_GE(took, 900ms);
  EXPECT_LT(took, 5s);
}

ReplicaOptions Options(const EtcdMember& etcd, const std::string& advertise) {
  ReplicaOptions o;
  o.etcd_endpoints = {etcd.endpoint()};
  o.prefix = "/wsync-test";
  o.advertise = advertise;
  o.lease_ttl_s = 2;
  o.poll_ms = 50;
  return o;
}

TEST(ReplicaOverEtcd, AReplacedLeaderCannotWriteAndTheNextHoldsWhatItAcknowledged) {
  EtcdMember etcd;
  ASSERT_TRUE(etcd.started()) << "etcd is not installed (scripts/install-deps.sh installs etcd-server)";
  ASSERT_TRUE(Eventually([&] { return etcd.Ctl("endpoint health") == 0; })) << "etcd did not come up";

  auto a = Replica::Start(Options(etcd, "replica-a:1"), SystemClock());
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(Eventually([&] { return (*a)->leading(); }));
  auto b = Replica::Start(Options(etcd, "replica-b:1"), SystemClock());
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(Eventually([&] { return (*b)->leader() == "replica-a:1"; }));
  auto not_leader = (*b)->Current();
  EXPECT_TRUE(not_leader.status().HasReason(reasons::kNotLeader));
  EXPECT_EQ(not_leader.status().reason()->metadata.at("leader"), "replica-a:1");

  auto state_a = (*a)->Current();
  ASSERT_TRUE(state_a.ok());
  ASSERT_TRUE((*state_a)->Publish(V(1)).ok());
  ASSERT_TRUE((*state_a)->Publish(V(2)).ok());

  // The leader key is taken from a (its lease lives on: a does not notice),
  // and b is elected.
  ASSERT_EQ(etcd.Ctl("del /wsync-test/leader"), 0);
  ASSERT_TRUE(Eventually([&] { return (*b)->leading(); }));
  EXPECT_TRUE((*a)->leading()) << "a still believes it leads: only the fence stops it";

  // a's next write fails at etcd and changes nothing; a steps down.
  auto refused = (*state_a)->Publish(V(3));
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(refused.status().HasReason(reasons::kNotLeader)) << refused.status().ToString();
  EXPECT_EQ((*state_a)->head(), 2u);
  EXPECT_TRUE(Eventually([&] { return !(*a)->leading(); }));

  // b holds versions 1 and 2, and version 3 is free.
  auto state_b = (*b)->Current();
  ASSERT_TRUE(state_b.ok());
  EXPECT_EQ((*state_b)->head(), 2u);
  auto v3 = (*state_b)->Publish(V(3));
  ASSERT_TRUE(v3.ok()) << v3.status().ToString();
  EXPECT_EQ((*state_b)->ListVersions(0).versions_size(), 3);
}

TEST(ReplicaOverEtcd, WithoutEtcdACallFailsSoonNamingEtcdAndCallsResumeWhenItReturns) {
  EtcdMember etcd;
  ASSERT_TRUE(etcd.started()) << "etcd is not installed (scripts/install-deps.sh installs etcd-server)";
  ASSERT_TRUE(Eventually([&] { return etcd.Ctl("endpoint health") == 0; })) << "etcd did not come up";
  ReplicaOptions oa = Options(etcd, "replica-a:1"), ob = Options(etcd, "replica-b:1");
  oa.lease_ttl_s = ob.lease_ttl_s = 1;
  auto a = Replica::Start(oa, SystemClock());
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(Eventually([&] { return (*a)->leading(); }));
  auto b = Replica::Start(ob, SystemClock());
  ASSERT_TRUE(b.ok());
  std::string address_a, address_b;
  auto server_a = Serve(a->get(), &address_a);
  auto server_b = Serve(b->get(), &address_b);
  ClientOptions o;
  o.address = address_a + "," + address_b;
  o.timeout_ms = 60'000;  // the failure must come from the replicas, long before this
  auto client = NewCoordinatorClient(o);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->Publish(V(1)).ok());
  EXPECT_EQ((*a)->Describe().role(), v1::ReplicaResponse::LEADER);
  EXPECT_EQ((*a)->Describe().etcd_failing_ms(), 0);
  ASSERT_TRUE(Eventually([&] { return (*b)->Describe().leader() == "replica-a:1"; }));

  etcd.Signal(SIGSTOP);
  const auto t0 = std::chrono::steady_clock::now();
  auto refused = (*client)->Publish(V(2));
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(refused.status().HasReason(reasons::kEtcdUnreachable)) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("majority of etcd"), std::string::npos) << refused.status().ToString();
  // Lease 1 s + grace 3 s + an etcd call's 2 s: well inside the client's 60 s.
  EXPECT_LT(took, 20s) << "the call waited for its own deadline instead of the replicas' verdict";
  v1::ReplicaResponse seen = (*b)->Describe();
  EXPECT_EQ(seen.role(), v1::ReplicaResponse::FOLLOWER);
  EXPECT_GE(seen.etcd_failing_ms(), seen.unreachable_after_ms());
  EXPECT_FALSE(seen.etcd_error().empty());
  // Any replica answers Replica, leading or not.
  ClientOptions only_b;
  only_b.address = address_b;
  auto ask_b = NewCoordinatorClient(only_b);
  ASSERT_TRUE(ask_b.ok());
  auto described = (*ask_b)->DescribeReplica();
  ASSERT_TRUE(described.ok()) << described.status().ToString();
  EXPECT_EQ(described->address(), "replica-b:1");
  EXPECT_GT(described->etcd_failing_ms(), 0);

  etcd.Signal(SIGCONT);
  ASSERT_TRUE(Eventually([&] { return (*client)->Publish(V(2)).ok(); }, 30s));
  EXPECT_TRUE(Eventually([&] { return (*a)->Describe().etcd_failing_ms() == 0 && (*b)->Describe().etcd_failing_ms() == 0; }));
}

TEST(ReplicaOverEtcd, AFollowerLearnsOfAVacancyFromTheWatchNotAPoll) {
  EtcdMember etcd;
  ASSERT_TRUE(etcd.started()) << "etcd is not installed (scripts/install-deps.sh installs etcd-server)";
  ASSERT_TRUE(Eventually([&] { return etcd.Ctl("endpoint health") == 0; })) << "etcd did not come up";
  auto a = Replica::Start(Options(etcd, "replica-a:1"), SystemClock());
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(Eventually([&] { return (*a)->leading(); }));
  ReplicaOptions ob = Options(etcd, "replica-b:1");
  ob.poll_ms = ob.watch_ms = 600'000;  // only the watch can wake it within the test
  auto b = Replica::Start(ob, SystemClock());
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(Eventually([&] { return (*b)->leader() == "replica-a:1"; }));
  ASSERT_EQ(etcd.Ctl("del /wsync-test/leader"), 0);
  EXPECT_TRUE(Eventually([&] { return (*b)->leading() || (*b)->leader() != "replica-a:1"; }))
      << "the follower did not see the leader key go";
}

TEST(ReplicaOverEtcd, ALeaderThatResignsIsReplacedAtOnceWithItsState) {
  EtcdMember etcd;
  ASSERT_TRUE(etcd.started()) << "etcd is not installed (scripts/install-deps.sh installs etcd-server)";
  ASSERT_TRUE(Eventually([&] { return etcd.Ctl("endpoint health") == 0; })) << "etcd did not come up";
  auto a = Replica::Start(Options(etcd, "replica-a:1"), SystemClock());
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(Eventually([&] { return (*a)->leading(); }));
  auto b = Replica::Start(Options(etcd, "replica-b:1"), SystemClock());
  ASSERT_TRUE(b.ok());
  {
    auto state = (*a)->Current();
    ASSERT_TRUE(state.ok());
    for (uint64_t v = 1; v <= 5; ++v) ASSERT_TRUE((*state)->Publish(V(v)).ok());
  }
  const auto t0 = std::chrono::steady_clock::now();
  a->reset();  // resigns: revokes its lease
  ASSERT_TRUE(Eventually([&] { return (*b)->leading(); }));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1500ms) << "a resignation does not wait for the lease to expire";
  auto state = (*b)->Current();
  ASSERT_TRUE(state.ok());
  EXPECT_EQ((*state)->head(), 5u);
}

TEST(ReplicaOverEtcd, AuthenticatesAsItsUserAndSaysNothingWorksWithAWrongPassword) {
  EtcdMember etcd;
  ASSERT_TRUE(etcd.started()) << "etcd is not installed (scripts/install-deps.sh installs etcd-server)";
  ASSERT_TRUE(Eventually([&] { return etcd.Ctl("endpoint health") == 0; })) << "etcd did not come up";
  for (const char* cmd : {"user add root:rootpw", "user add wsync:secret", "role add wsync",
                          "role grant-permission wsync --prefix=true readwrite /wsync-test",
                          "user grant-role wsync wsync", "auth enable"}) {
    ASSERT_EQ(etcd.Ctl(cmd), 0) << cmd;
  }
  ReplicaOptions wrong = Options(etcd, "replica-x:1");
  wrong.etcd_user = "wsync";
  wrong.etcd_password = "not-the-password";
  auto x = Replica::Start(wrong, SystemClock());
  ASSERT_TRUE(x.ok());
  std::this_thread::sleep_for(1s);
  EXPECT_FALSE((*x)->leading());
  EXPECT_TRUE((*x)->Current().status().HasReason(reasons::kNotLeader));

  ReplicaOptions right = Options(etcd, "replica-a:1");
  right.etcd_user = "wsync";
  right.etcd_password = "secret";
  auto a = Replica::Start(right, SystemClock());
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(Eventually([&] { return (*a)->leading(); }));
  auto state = (*a)->Current();
  ASSERT_TRUE(state.ok());
  ASSERT_TRUE((*state)->Publish(V(1)).ok());
  EXPECT_FALSE((*x)->leading());
}

TEST(ReplicaOverEtcd, TalksTlsWithAClientCertificate) {
  if (std::system("command -v openssl > /dev/null") != 0) GTEST_FAIL() << "the openssl CLI is not installed";
  const std::string dir = ::testing::TempDir() + "/wsync_etcd_tls_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const std::string script =
      "set -e; cd '" + dir + "';"
      "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 -subj /CN=wsync-test-ca 2>/dev/null;"
      "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1' > san.ext;"
      "openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=localhost 2>/dev/null;"
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 1 -extfile san.ext 2>/dev/null;"
      "printf 'extendedKeyUsage=clientAuth' > client.ext;"
      "openssl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr -subj /CN=wsync 2>/dev/null;"
      "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 1 -extfile client.ext 2>/dev/null";
  ASSERT_EQ(std::system(("bash -c \"" + script + "\"").c_str()), 0);
  {
    EtcdMember etcd(dir);
    ASSERT_TRUE(etcd.started()) << "etcd is not installed (scripts/install-deps.sh installs etcd-server)";
    ASSERT_TRUE(Eventually([&] { return etcd.Ctl("endpoint health") == 0; })) << "etcd did not come up with TLS";
    ReplicaOptions o = Options(etcd, "replica-a:1");
    auto plain = Replica::Start(o, SystemClock());  // no TLS: etcd does not answer it
    ASSERT_TRUE(plain.ok());
    o.etcd_ca_file = dir + "/ca.pem";
    o.etcd_cert_file = dir + "/client.pem";
    o.etcd_key_file = dir + "/client.key";
    o.advertise = "replica-b:1";
    auto tls = Replica::Start(o, SystemClock());
    ASSERT_TRUE(tls.ok());
    ASSERT_TRUE(Eventually([&] { return (*tls)->leading(); }));
    auto state = (*tls)->Current();
    ASSERT_TRUE(state.ok());
    ASSERT_TRUE((*state)->Publish(V(1)).ok());
    EXPECT_FALSE((*plain)->leading());
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace wsync::control
