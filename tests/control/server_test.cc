// The coordinator over real gRPC: TCP on port 0 and a unix socket, the bearer
// token, health checks without it, Watch with resume (a fleet's streams on
// no thread each, a broken one marking its node), MayPublish waiting, TLS
// and mTLS with certificates generated for the test.
#include "wsync/control/server.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <thread>

#include "wsync/control/client.h"
#include "wsync/control/rpc_status.h"
#include "wsync/v1/coordinator.grpc.pb.h"
#include "wsync/v1/errors.pb.h"
#include "wsync/util/file.h"

namespace wsync::control {
namespace {

namespace v1 = wsync::v1;

struct Running {
  std::unique_ptr<CoordinatorState> state;
  std::unique_ptr<CoordinatorServer> server;
  std::string tcp;  // "127.0.0.1:PORT"
};

Running StartServer(ServerOptions options, CoordinatorOptions state_options = {}) {
  Running r;
  auto state = CoordinatorState::Create(state_options, SystemClock(), NewNullStore(), Recovered());
  EXPECT_TRUE(state.ok());
  r.state = std::move(*state);
  auto server = CoordinatorServer::Start(options, r.state.get());
  EXPECT_TRUE(server.ok()) << server.status().ToString();
  r.server = std::move(*server);
  if (!r.server->ports().empty()) r.tcp = "127.0.0.1:" + std::to_string(r.server->ports()[0]);
  return r;
}

v1::WatchRequest WatchFrom(uint64_t after) {
  v1::WatchRequest r;
  r.set_after(after);
  return r;
}

std::unique_ptr<CoordinatorClient> Client(const std::string& address, const std::string& token = "") {
  ClientOptions o;
  o.address = address;
  o.token = token;
  auto c = NewCoordinatorClient(o);
  EXPECT_TRUE(c.ok());
  return std::move(*c);
}

v1::RegisterRequest Registration(const std::string& name, v1::Role role) {
  v1::RegisterRequest r;
  r.set_name(name);
  r.set_role(role);
  return r;
}

v1::VersionSummary V(uint64_t v) {
  v1::VersionSummary s;
  s.set_version(v);
  s.set_keyframe(true);
  s.set_source("trainer-0");
  return s;
}

TEST(CoordinatorServer, ServesOnPortZeroAndUnixSocket) {
  const std::string sock = ::testing::TempDir() + "/wsync_coord_" + std::to_string(::getpid()) + ".sock";
  ServerOptions o;
  o.listen = {"127.0.0.1:0", "unix:" + sock};
  Running r = StartServer(o);
  ASSERT_GT(r.server->ports()[0], 0);
  auto tcp = Client(r.tcp);
  auto local = Client("unix:" + sock);
  v1::RegisterRequest reg = Registration("src", v1::ROLE_SOURCE);
  reg.set_data_address(std::string("\x00\x01opaque", 8));
  auto resp = tcp->Register(reg);
  ASSERT_TRUE(resp.ok()) << resp.status().ToString();
  ASSERT_TRUE(tcp->Publish(V(1)).ok());
  auto status = local->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ(status->head_version(), 1u);
  ASSERT_EQ(status->nodes_size(), 1);
  EXPECT_EQ(status->nodes(0).data_address(), std::string("\x00\x01opaque", 8));  // opaque bytes survive
  // Errors keep their code and their reason across the wire (another
  // summary of version 1; the same one again would be a retry, answered
  // with success).
  auto other = V(1);
  other.set_set_checksum(42);
  auto again = tcp->Publish(other);
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(again.status().message().find("versions only grow"), std::string::npos);
  ASSERT_TRUE(again.status().HasReason(reasons::kStaleVersion)) << again.status().ToString();
  EXPECT_EQ(again.status().reason()->metadata.at("next_version"), "2");
  EXPECT_EQ(again.status().reason()->metadata.at("head_version"), "1");
  r.server->Shutdown();
}

// A rank of a large mixture of experts offers tens of thousands of pieces:
// past gRPC's default 4 MiB, both ways. A deregistered sink's offer goes.
TEST(CoordinatorServer, LargeLayoutsAreOfferedAndListedAndGoWithTheirNode) {
  ServerOptions o;
  o.listen = {"127.0.0.1:0"};
  Running r = StartServer(o);
  auto c = Client(r.tcp);
  const v1::RegisterRequest reg = Registration("rank-0", v1::ROLE_SINK);
  ASSERT_TRUE(c->Register(reg).ok());
  v1::ServedLayout layout;
  for (int e = 0; e < 60000; ++e) {
    v1::TensorSpec* t = layout.add_tensors();
    t->set_name("model.layers." + std::to_string(e / 256) + ".mlp.experts.w13_weight[" + std::to_string(e % 256) + "]");
    t->set_dtype("BF16");
    t->add_shape(3072);
    t->add_shape(7168);
    for (int half = 0; half < 2; ++half) {
      v1::PieceSpec* p = t->add_pieces();
      p->set_canonical("model.layers." + std::to_string(e / 256) + ".mlp.experts." + std::to_string(e % 256) +
                       (half ? ".up_proj.weight" : ".gate_proj.weight"));
      p->add_start(0), p->add_start(0);
      p->add_extent(1536), p->add_extent(7168);
      p->add_at(half * 1536), p->add_at(0);
    }
  }
  ASSERT_GT(layout.ByteSizeLong(), 4u << 20);
  auto n = c->OfferLayout("rank-0", layout);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(*n, 1u);
  auto listed = c->ListOfferedLayouts();
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].SerializeAsString(), layout.SerializeAsString());
  ASSERT_TRUE(c->Deregister("rank-0").ok());
  listed = c->ListOfferedLayouts();
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty());
  r.server->Shutdown();
}

TEST(CoordinatorServer, TokenIsRequiredExceptForHealth) {
  ServerOptions o;
  o.listen = {"127.0.0.1:0"};
  o.token = "s3cret-token";
  Running r = StartServer(o);
  EXPECT_EQ(Client(r.tcp)->GetStatus().status().code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(Client(r.tcp, "wrong")->GetStatus().status().code(), StatusCode::kUnauthenticated);
  EXPECT_TRUE(Client(r.tcp, "s3cret-token")->GetStatus().ok());
  // grpc.health.v1 answers without a token.
  auto channel = grpc::CreateChannel(r.tcp, grpc::InsecureChannelCredentials());
  grpc::ByteBuffer request, response;
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  // An empty HealthCheckRequest (service "") serializes to zero bytes.
  grpc::Slice empty;
  request = grpc::ByteBuffer(&empty, 1);
  std::atomic<bool> done{false};
  grpc::Status status;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   status = s;
                   done = true;
                 });
  for (int i = 0; i < 500 && !done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(done);
  EXPECT_TRUE(status.ok()) << status.error_message();
}

TEST(CoordinatorServer, WatchStreamsBacklogThenNewVersionsAndResumes) {
  ServerOptions o;
  o.listen = {"127.0.0.1:0"};
  Running r = StartServer(o);
  auto publisher = Client(r.tcp);
  ASSERT_TRUE(publisher->Publish(V(1)).ok());
  ASSERT_TRUE(publisher->Publish(V(2)).ok());
  auto watcher = Client(r.tcp);
  std::vector<uint64_t> seen;
  std::thread t([&] {
    Status s = watcher->Watch(WatchFrom(0), [&](const v1::VersionSummary& v) {
      seen.push_back(v.version());
      return v.version() < 4;
    });
    EXPECT_TRUE(s.ok()) << s.ToString();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(publisher->Publish(V(3)).ok());
  ASSERT_TRUE(publisher->Publish(V(4)).ok());
  t.join();
  EXPECT_EQ(seen, (std::vector<uint64_t>{1, 2, 3, 4}));
  // A reconnecting watcher resumes after what it saw, missing nothing.
  ASSERT_TRUE(publisher->Publish(V(5)).ok());
  std::vector<uint64_t> resumed;
  ASSERT_TRUE(watcher->Watch(WatchFrom(4), [&](const v1::VersionSummary& v) {
                       resumed.push_back(v.version());
                       return false;
                     }).ok());
  EXPECT_EQ(resumed, (std::vector<uint64_t>{5}));
}

// A sink's Watch stream as a fleet's are served: the versions it reads,
// counted; Wait* wait for events, not for time.
class WatchStream : public grpc::ClientReadReactor<v1::VersionSummary> {
 public:
  WatchStream(v1::Coordinator::Stub* stub, v1::WatchRequest req) : req_(std::move(req)) {
    stub->async()->Watch(&ctx, &req_, this);
    StartRead(&msg_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      last_ = msg_.version();
    }
    cv_.notify_all();
    StartRead(&msg_);
  }
  void OnDone(const grpc::Status& s) override {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = s;
    done_ = true;
    cv_.notify_all();
  }
  bool WaitForVersion(uint64_t v) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(30), [&] { return last_ >= v || done_; }) && last_ >= v;
  }
  grpc::Status WaitDone() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(30), [&] { return done_; });
    return done_ ? status_ : grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "stream still open");
  }
  grpc::ClientContext ctx;

 private:
  v1::WatchRequest req_;
  v1::VersionSummary msg_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t last_ = 0;
  bool done_ = false;
  grpc::Status status_;
};

size_t ThreadsOfThisProcess() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// Every sink holds a Watch stream open: a fleet's streams must not hold a
// server thread each (thousands of threads, each woken by every change).
TEST(CoordinatorServer, WatchStreamsHoldNoServerThreadEach) {
  ServerOptions o;
  o.listen = {"127.0.0.1:0"};
  Running r = StartServer(o);
  auto publisher = Client(r.tcp);
  ASSERT_TRUE(publisher->Publish(V(1)).ok());
  auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(r.tcp, grpc::InsecureChannelCredentials()));
  const size_t threads_before = ThreadsOfThisProcess();
  constexpr int kStreams = 300;
  std::vector<std::unique_ptr<WatchStream>> streams;
  for (int i = 0; i < kStreams; ++i) streams.push_back(std::make_unique<WatchStream>(stub.get(), WatchFrom(0)));
  for (auto& w : streams) ASSERT_TRUE(w->WaitForVersion(1));
  ASSERT_TRUE(publisher->Publish(V(2)).ok());
  for (auto& w : streams) ASSERT_TRUE(w->WaitForVersion(2)) << "every stream gets the new version";
  EXPECT_LT(ThreadsOfThisProcess(), threads_before + kStreams / 10)
      << "threads grew with the open streams (before: " << threads_before << ")";
  // The server stopping ends every stream.
  r.server->Shutdown();
  for (auto& w : streams) EXPECT_TRUE(w->WaitDone().ok());
}

// A stream that breaks under its sink (the process died) marks the node
// disconnected at once: its children move without waiting out its TTL.
TEST(CoordinatorServer, ABrokenWatchMarksItsNodeDisconnected) {
  ServerOptions o;
  o.listen = {"127.0.0.1:0"};
  Running r = StartServer(o);
  auto c = Client(r.tcp);
  const v1::RegisterRequest reg = Registration("sink", v1::ROLE_SINK);
  auto registered = c->Register(reg);
  ASSERT_TRUE(registered.ok());
  ASSERT_TRUE(c->Publish(V(1)).ok());
  auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(r.tcp, grpc::InsecureChannelCredentials()));
  v1::WatchRequest req = WatchFrom(0);
  req.set_node("sink");
  req.set_incarnation(registered->node().incarnation());
  WatchStream w(stub.get(), req);
  ASSERT_TRUE(w.WaitForVersion(1));
  auto state_of_sink = [&] {
    const v1::StatusResponse status = r.state->GetStatus();
    for (const auto& n : status.nodes()) {
      if (n.name() == "sink") return n.state();
    }
    return v1::NODE_STATE_UNSPECIFIED;
  };
  EXPECT_EQ(state_of_sink(), v1::NODE_ALIVE);
  w.ctx.TryCancel();
  EXPECT_EQ(w.WaitDone().error_code(), grpc::StatusCode::CANCELLED);
  for (int i = 0; i < 3000 && state_of_sink() != v1::NODE_DISCONNECTED; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(state_of_sink(), v1::NODE_DISCONNECTED);
}

TEST(CoordinatorServer, AWatchNeedsTheToken) {
  ServerOptions o;
  o.listen = {"127.0.0.1:0"};
  o.token = "s3cret-token";
  Running r = StartServer(o);
  auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(r.tcp, grpc::InsecureChannelCredentials()));
  WatchStream w(stub.get(), WatchFrom(0));
  EXPECT_EQ(w.WaitDone().error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

TEST(CoordinatorServer, MayPublishWaitsUntilTheLaggardCatchesUp) {
  ServerOptions o;
  o.listen = {"127.0.0.1:0"};
  CoordinatorOptions so;
  so.max_staleness = 1;
  Running r = StartServer(o, so);
  auto c = Client(r.tcp);
  const v1::RegisterRequest reg = Registration("sink", v1::ROLE_SINK);
  ASSERT_TRUE(c->Register(reg).ok());
  ASSERT_TRUE(c->Publish(V(1)).ok());
  ASSERT_TRUE(c->Publish(V(2)).ok());
  ASSERT_TRUE(c->ReportApplied("sink", 1).ok());
  auto now = c->MayPublish(3, 0);
  ASSERT_TRUE(now.ok());
  EXPECT_FALSE(now->allowed());
  ASSERT_EQ(now->blocking_size(), 1);
  std::thread catch_up([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    ASSERT_TRUE(Client(r.tcp)->ReportApplied("sink", 2).ok());
  });
  auto waited = c->MayPublish(3, 5000);
  catch_up.join();
  ASSERT_TRUE(waited.ok());
  EXPECT_TRUE(waited->allowed());
}

// Certificates made with the openssl CLI: a CA, a server certificate for
// localhost / 127.0.0.1 and a client certificate.
class Tls : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::system("command -v openssl > /dev/null") != 0) GTEST_SKIP() << "openssl CLI not installed";
    dir_ = ::testing::TempDir() + "/wsync_tls_" + std::to_string(::getpid());
    std::filesystem::create_directories(dir_);
    const std::string d = dir_;
    const std::string script =
        "set -e; cd '" + d + "';"
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 -subj /CN=wsync-test-ca 2>/dev/null;"
        "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1' > san.ext;"
        "openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=localhost 2>/dev/null;"
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 1 -extfile san.ext 2>/dev/null;"
        "openssl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr -subj /CN=wsync-client 2>/dev/null;"
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 1 2>/dev/null";
    ASSERT_EQ(std::system(("bash -c \"" + script + "\"").c_str()), 0);
  }
  void TearDown() override {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  std::string dir_;
};

TEST_F(Tls, ServerTlsAndRequiredClientCertificates) {
  ServerOptions o;
  o.listen = {"127.0.0.1:0"};
  o.tls = {dir_ + "/server.pem", dir_ + "/server.key", dir_ + "/ca.pem"};
  Running r = StartServer(o);
  ClientOptions c;
  c.address = "localhost:" + std::to_string(r.server->ports()[0]);
  c.tls_ca_file = dir_ + "/ca.pem";
  c.timeout_ms = 3000;
  // Without a client certificate: refused.
  EXPECT_FALSE((*NewCoordinatorClient(c))->GetStatus().ok());
  // Plaintext: refused.
  ClientOptions plain;
  plain.address = c.address;
  plain.timeout_ms = 3000;
  EXPECT_FALSE((*NewCoordinatorClient(plain))->GetStatus().ok());
  // With the client certificate: served.
  c.tls_cert_file = dir_ + "/client.pem";
  c.tls_key_file = dir_ + "/client.key";
  auto s = (*NewCoordinatorClient(c))->GetStatus();
  EXPECT_TRUE(s.ok()) << s.status().ToString();
}

}  // namespace
}  // namespace wsync::control

namespace wsync::control {
namespace {

// Fetches http://127.0.0.1:port/metrics with a plain socket (`auth`: an
// Authorization header value).
std::string HttpGet(int port, const std::string& path, const std::string& auth = "") {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return "";
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n" +
                          (auth.empty() ? "" : "Authorization: " + auth + "\r\n") + "\r\n";
  (void)!::write(fd, req.data(), req.size());
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return out;
}

TEST(CoordinatorServer, ExportsPrometheusMetrics) {
  ServerOptions o;
  o.listen = {"127.0.0.1:0"};
  o.metrics_listen = "127.0.0.1:0";
  o.tick_ms = 20;
  Running r = StartServer(o);
  ASSERT_GT(r.server->metrics_port(), 0);
  auto c = Client(r.tcp);
  const v1::RegisterRequest reg = Registration("sink-m", v1::ROLE_SINK);
  ASSERT_TRUE(c->Register(reg).ok());
  ASSERT_TRUE(c->Publish(V(7)).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const std::string body = HttpGet(r.server->metrics_port(), "/metrics");
  EXPECT_NE(body.find("wsync_head_version 7"), std::string::npos) << body;
  EXPECT_NE(body.find("wsync_sink_staleness{sink=\"sink-m\"} 7"), std::string::npos) << body;
  EXPECT_NE(body.find("wsync_coordinator_rpcs_total{code=\"0\",method=\"Publish\"} 1"), std::string::npos) << body;
  EXPECT_NE(body.find("wsync_nodes{role=\"ROLE_SINK\",state=\"NODE_ALIVE\"} 1"), std::string::npos) << body;
}

// Issue 18, item 6: the metrics endpoint served sink names and staleness to
// anyone. With a token it asks for it (basic auth, the token as password).
TEST(CoordinatorServer, MetricsAreBehindTheToken) {
  ServerOptions o;
  o.listen = {"127.0.0.1:0"};
  o.metrics_listen = "127.0.0.1:0";
  o.token = "s3cret";
  o.tick_ms = 20;
  Running r = StartServer(o);
  auto c = Client(r.tcp, "s3cret");
  const v1::RegisterRequest reg = Registration("sink-secret-name", v1::ROLE_SINK);
  ASSERT_TRUE(c->Register(reg).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const std::string anonymous = HttpGet(r.server->metrics_port(), "/metrics");
  EXPECT_NE(anonymous.find("401"), std::string::npos) << anonymous;
  EXPECT_EQ(anonymous.find("sink-secret-name"), std::string::npos) << anonymous;
  // "wsync:wrong" and "wsync:s3cret" in base64.
  EXPECT_EQ(HttpGet(r.server->metrics_port(), "/metrics", "Basic d3N5bmM6d3Jvbmc=").find("sink-secret-name"),
            std::string::npos);
  const std::string body = HttpGet(r.server->metrics_port(), "/metrics", "Basic d3N5bmM6czNjcmV0");
  EXPECT_NE(body.find("sink-secret-name"), std::string::npos) << body;
}

}  // namespace
}  // namespace wsync::control

namespace wsync::control {
namespace {

namespace v1 = wsync::v1;

TEST(RpcStatus, AReasonSurvivesTheGrpcEdgeAndForeignDetailsAreIgnored) {
  const Status s = StaleVersionError(3, 5).WithContext("publish");
  const grpc::Status g = control::ToGrpc(s);
  EXPECT_EQ(g.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  const Status back = control::FromGrpc(g, "call");
  EXPECT_EQ(back.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(back.message(), "call: " + s.message());
  ASSERT_TRUE(back.HasReason(reasons::kStaleVersion));
  EXPECT_EQ(back.reason()->metadata.at("next_version"), "6");
  // No reason, garbage details, another domain's ErrorInfo: a plain status.
  EXPECT_EQ(control::FromGrpc(control::ToGrpc(DataLossError("x")), "c").reason(), nullptr);
  EXPECT_EQ(control::FromGrpc(grpc::Status(grpc::StatusCode::ABORTED, "m", "\xff\x01garbage"), "c").reason(),
            nullptr);
  v1::ErrorInfo info;
  info.set_reason("STALE_VERSION");
  info.set_domain("someone.else");
  v1::RpcStatus st;
  auto* any = st.add_details();
  any->set_type_url("type.googleapis.com/google.rpc.ErrorInfo");
  any->set_value(info.SerializeAsString());
  EXPECT_EQ(control::FromGrpc(grpc::Status(grpc::StatusCode::ABORTED, "m", st.SerializeAsString()), "c").reason(),
            nullptr);
  // OK stays OK, with no reason.
  EXPECT_TRUE(control::ToGrpc(Status::Ok().WithReason("X")).ok());
}

}  // namespace
}  // namespace wsync::control
