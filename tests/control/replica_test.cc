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

int FreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

bool Eventually(const std::function<bool()>& pred, std::chrono::milliseconds timeout = 20s) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(20ms);
  }
  return pred();
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

std::unique_ptr<CoordinatorServer> ServeFollower(Follower* f, std::string* address) {
  ServerOptions o;
  o.listen = {"127.0.0.1:0"};
  auto server = CoordinatorServer::Start(o, f);
  EXPECT_TRUE(server.ok());
  *address = "127.0.0.1:" + std::to_string((*server)->ports()[0]);
  return std::move(*server);
}

TEST(ReplicaClient, FollowsTheLeaderAReplicaNames) {
  Served leader = ServeState();
  Follower follower(leader.address);
  std::string follower_address;
  auto server = ServeFollower(&follower, &follower_address);
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
  auto server_a = ServeFollower(&a, &address_a);
  auto server_b = ServeFollower(&b, &address_b);
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

// One etcd member on loopback, in a directory of its own; with `tls_dir`,
// serving TLS with that directory's server certificate and requiring client
// certificates of its CA.
class Etcd {
 public:
  explicit Etcd(const std::string& tls_dir = "") : tls_dir_(tls_dir) {
    dir_ = std::filesystem::path(::testing::TempDir()) / ("wsync_etcd_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    endpoint_ = "127.0.0.1:" + std::to_string(FreePort());
    const std::string scheme = tls_dir.empty() ? "http://" : "https://";
    const std::string peer = "http://127.0.0.1:" + std::to_string(FreePort());
    std::vector<std::string> args = {"etcd", "--name", "test", "--data-dir", dir_.string(),
                                     "--listen-client-urls", scheme + endpoint_,
                                     "--advertise-client-urls", scheme + endpoint_,
                                     "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                                     "--initial-cluster", "test=" + peer, "--log-outputs", "stderr",
                                     "--logger", "zap", "--log-level", "error"};
    if (!tls_dir.empty()) {
      args.insert(args.end(), {"--cert-file", tls_dir + "/server.pem", "--key-file", tls_dir + "/server.key",
                               "--trusted-ca-file", tls_dir + "/ca.pem", "--client-cert-auth"});
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (::posix_spawnp(&pid_, "etcd", nullptr, nullptr, argv.data(), environ) != 0) pid_ = -1;
  }
  ~Etcd() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    std::filesystem::remove_all(dir_);
  }
  bool started() const { return pid_ > 0; }
  const std::string& endpoint() const { return endpoint_; }
  // etcdctl's exit status.
  int Ctl(const std::string& args) const {
    std::string tls;
    if (!tls_dir_.empty()) {
      tls = " --cacert " + tls_dir_ + "/ca.pem --cert " + tls_dir_ + "/client.pem --key " + tls_dir_ + "/client.key";
    }
    return std::system(
        ("ETCDCTL_API=3 etcdctl --endpoints " + endpoint_ + tls + " " + args + " >/dev/null 2>&1").c_str());
  }

 private:
  std::string tls_dir_;
  std::filesystem::path dir_;
  std::string endpoint_;
  pid_t pid_ = -1;
};

ReplicaOptions Options(const Etcd& etcd, const std::string& advertise) {
  ReplicaOptions o;
  o.etcd_endpoints = {etcd.endpoint()};
  o.prefix = "/wsync-test";
  o.advertise = advertise;
  o.lease_ttl_s = 2;
  o.poll_ms = 50;
  return o;
}

TEST(ReplicaOverEtcd, AReplacedLeaderCannotWriteAndTheNextHoldsWhatItAcknowledged) {
  Etcd etcd;
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

TEST(ReplicaOverEtcd, ALeaderThatResignsIsReplacedAtOnceWithItsState) {
  Etcd etcd;
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
  Etcd etcd;
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
    Etcd etcd(dir);
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
