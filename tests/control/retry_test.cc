// Answers lost after the coordinator acted: the real server over real gRPC,
// a client whose channel turns chosen OK answers into UNAVAILABLE (what a
// client sees when the connection drops after the leader committed). Every
// mutating call is retried by the client and must act once: no second lease
// or incarnation, no committed call reported failed.
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/client_interceptor.h>
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "channel.h"
#include "wsync/control/client.h"
#include "wsync/control/server.h"
#include "wsync/control/store.h"

namespace wsync::control {
namespace {

namespace v1 = wsync::v1;
namespace gx = grpc::experimental;

// Which answers to lose: the first answer of each method named, once.
class AnswerLoss {
 public:
  void LoseNext(const std::string& method) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.insert("/wsync.v1.Coordinator/" + method);
  }
  // Whether the answer of this call of `method` is lost (consumes the order).
  bool Take(const std::string& method) {
    std::lock_guard<std::mutex> lock(mu_);
    if (pending_.erase(method) == 0) return false;
    ++lost_[method];
    return true;
  }
  int lost(const std::string& method) {
    std::lock_guard<std::mutex> lock(mu_);
    return lost_["/wsync.v1.Coordinator/" + method];
  }

 private:
  std::mutex mu_;
  std::set<std::string> pending_;
  std::map<std::string, int> lost_;
};

class LoseAnswer : public gx::Interceptor {
 public:
  LoseAnswer(AnswerLoss* loss, std::string method) : loss_(loss), method_(std::move(method)) {}
  void Intercept(gx::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(gx::InterceptionHookPoints::POST_RECV_STATUS)) {
      grpc::Status* status = methods->GetRecvStatus();
      if (status->ok() && loss_->Take(method_)) {
        *status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "connection lost before the answer (test)");
      }
    }
    methods->Proceed();
  }

 private:
  AnswerLoss* loss_;
  std::string method_;
};

class LoseAnswers : public gx::ClientInterceptorFactoryInterface {
 public:
  explicit LoseAnswers(AnswerLoss* loss) : loss_(loss) {}
  gx::Interceptor* CreateClientInterceptor(gx::ClientRpcInfo* info) override {
    return new LoseAnswer(loss_, info->method());
  }

 private:
  AnswerLoss* loss_;
};

struct Coordinator {
  std::unique_ptr<CoordinatorState> state;
  std::unique_ptr<CoordinatorServer> server;
  std::string address;
};

Coordinator Start(const std::string& store_dir) {
  Coordinator c;
  Recovered recovered;
  auto store = OpenLogStore(store_dir, &recovered);
  EXPECT_TRUE(store.ok()) << store.status().ToString();
  auto state = CoordinatorState::Create({}, SystemClock(), std::move(*store), recovered);
  EXPECT_TRUE(state.ok()) << state.status().ToString();
  c.state = std::move(*state);
  ServerOptions o;
  o.listen = {"127.0.0.1:0"};
  auto server = CoordinatorServer::Start(o, c.state.get());
  EXPECT_TRUE(server.ok()) << server.status().ToString();
  c.server = std::move(*server);
  c.address = "127.0.0.1:" + std::to_string(c.server->ports()[0]);
  return c;
}

// A daemon's client (one address, wait_for_ready) whose answers `loss` drops.
std::unique_ptr<CoordinatorClient> LossyClient(const std::string& address, AnswerLoss* loss) {
  ClientOptions o;
  o.address = address;
  o.wait_for_ready = true;
  auto c = NewCoordinatorClient(o, [loss](const std::string& a) {
    std::vector<std::unique_ptr<gx::ClientInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(std::make_unique<LoseAnswers>(loss));
    return gx::CreateCustomChannelWithInterceptors(a, grpc::InsecureChannelCredentials(), grpc::ChannelArguments(),
                                                   std::move(interceptors));
  });
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return std::move(*c);
}

v1::RegisterRequest Registration(const std::string& name, v1::Role role) {
  v1::RegisterRequest r;
  r.set_name(name);
  r.set_role(role);
  return r;
}

std::string TempDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/" + name + "-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

TEST(LostAnswers, EveryMutatingCallActsOnceAndSucceeds) {
  const std::string dir = TempDir("wsync-lost-answers");
  Coordinator coord = Start(dir);
  AnswerLoss loss;
  auto c = LossyClient(coord.address, &loss);

  loss.LoseNext("Register");
  auto source = c->Register(Registration("trainer-0", v1::ROLE_SOURCE));
  ASSERT_TRUE(source.ok()) << source.status().ToString();
  loss.LoseNext("Register");
  auto sink = c->Register(Registration("rollout-0", v1::ROLE_SINK));
  ASSERT_TRUE(sink.ok()) << sink.status().ToString();
  EXPECT_EQ(loss.lost("Register"), 2);
  // One incarnation per registration: the retry got the first attempt's.
  EXPECT_EQ(source->node().incarnation(), 1u);
  EXPECT_EQ(sink->node().incarnation(), 2u);

  loss.LoseNext("SetLayout");
  v1::Layout layout;
  v1::LayoutTensor* t = layout.add_tensors();
  t->set_name("w");
  t->set_dtype("BF16");
  t->add_shape(4);
  ASSERT_TRUE(c->SetLayout(layout).ok());

  v1::VersionSummary v;
  v.set_version(1);
  v.set_keyframe(true);
  v.set_source("trainer-0");
  loss.LoseNext("Publish");
  auto head = c->Publish(v);
  ASSERT_TRUE(head.ok()) << head.status().ToString();
  EXPECT_EQ(*head, 1u);

  loss.LoseNext("ReportApplied");
  ASSERT_TRUE(c->ReportApplied("rollout-0", 1).ok());

  v1::HeartbeatRequest hb;
  hb.set_name("rollout-0");
  hb.set_incarnation(sink->node().incarnation());
  loss.LoseNext("Heartbeat");
  ASSERT_TRUE(c->Heartbeat(hb).ok());

  loss.LoseNext("AcquireLease");
  auto lease = c->AcquireLease("rollout-0", 1, 60'000);
  ASSERT_TRUE(lease.ok()) << lease.status().ToString();
  auto leases = c->ListLeases();
  ASSERT_TRUE(leases.ok());
  ASSERT_EQ(leases->leases_size(), 1) << "a retried acquisition left a second lease";
  EXPECT_EQ(leases->leases(0).id(), lease->id());

  loss.LoseNext("RenewLease");
  ASSERT_TRUE(c->RenewLease(lease->id(), 60'000).ok());
  loss.LoseNext("ReleaseLease");
  ASSERT_TRUE(c->ReleaseLease(lease->id()).ok());
  leases = c->ListLeases();
  ASSERT_TRUE(leases.ok());
  EXPECT_EQ(leases->leases_size(), 0);

  v1::ServedLayout served;
  *served.add_tensors() = v1::TensorSpec();
  served.mutable_tensors(0)->set_name("w");
  served.mutable_tensors(0)->set_dtype("BF16");
  served.mutable_tensors(0)->add_shape(4);
  loss.LoseNext("OfferLayout");
  auto offered = c->OfferLayout("rollout-0", served);
  ASSERT_TRUE(offered.ok()) << offered.status().ToString();
  EXPECT_EQ(*offered, 1u);

  loss.LoseNext("MayPublish");
  auto may = c->MayPublish(2, 0);
  ASSERT_TRUE(may.ok()) << may.status().ToString();
  EXPECT_TRUE(may->allowed());

  loss.LoseNext("Deregister");
  ASSERT_TRUE(c->Deregister("rollout-0").ok());
  auto status = c->GetStatus();
  ASSERT_TRUE(status.ok());
  ASSERT_EQ(status->nodes_size(), 1);
  EXPECT_EQ(status->nodes(0).name(), "trainer-0");
  EXPECT_EQ(status->nodes(0).incarnation(), 1u);

  for (const char* m : {"SetLayout", "Publish", "ReportApplied", "Heartbeat", "AcquireLease", "RenewLease",
                        "ReleaseLease", "OfferLayout", "MayPublish", "Deregister"}) {
    EXPECT_EQ(loss.lost(m), 1) << m;
  }
  // A deliberate registration (a new call) is a new incarnation still.
  auto again = c->Register(Registration("trainer-0", v1::ROLE_SOURCE));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->node().incarnation(), 3u);
  coord.server->Shutdown();
  std::filesystem::remove_all(dir);
}

// What makes a retry recognizable is durable: a coordinator that recovers
// from the store (a replica that takes over replays the same records) gives a
// retry of an acquisition or a registration the first attempt's answer.
TEST(LostAnswers, RetriesAreRecognizedAfterRecovery) {
  const std::string dir = TempDir("wsync-lost-answers-recovery");
  v1::RegisterRequest reg = Registration("rollout-0", v1::ROLE_SINK);
  reg.set_request_id("register-attempts-1");
  uint64_t lease_id = 0;
  {
    Recovered recovered;
    auto store = OpenLogStore(dir, &recovered);
    ASSERT_TRUE(store.ok());
    auto s = CoordinatorState::Create({}, SystemClock(), std::move(*store), recovered);
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE((*s)->Register(Registration("trainer-0", v1::ROLE_SOURCE)).ok());
    ASSERT_EQ((*s)->Register(reg)->node().incarnation(), 2u);
    v1::VersionSummary v;
    v.set_version(1);
    v.set_keyframe(true);
    v.set_source("trainer-0");
    ASSERT_TRUE((*s)->Publish(v).ok());
    auto l = (*s)->AcquireLease("rollout-0", 1, 60'000, "acquire-attempts-1");
    ASSERT_TRUE(l.ok());
    lease_id = l->id();
    // A retry on the same coordinator, and a different acquisition.
    EXPECT_EQ((*s)->AcquireLease("rollout-0", 1, 60'000, "acquire-attempts-1")->id(), lease_id);
    EXPECT_NE((*s)->AcquireLease("rollout-0", 1, 60'000, "acquire-attempts-2")->id(), lease_id);
    // The same key from another node is that node's own acquisition.
    ASSERT_TRUE((*s)->Register(Registration("rollout-1", v1::ROLE_SINK)).ok());
    EXPECT_NE((*s)->AcquireLease("rollout-1", 1, 60'000, "acquire-attempts-1")->id(), lease_id);
    EXPECT_EQ((*s)->ListLeases().leases_size(), 3);
  }
  Recovered recovered;
  auto store = OpenLogStore(dir, &recovered);
  ASSERT_TRUE(store.ok());
  auto s = CoordinatorState::Create({}, SystemClock(), std::move(*store), recovered);
  ASSERT_TRUE(s.ok());
  auto retried = (*s)->Register(reg);
  ASSERT_TRUE(retried.ok());
  EXPECT_EQ(retried->node().incarnation(), 2u);
  auto l = (*s)->AcquireLease("rollout-0", 1, 60'000, "acquire-attempts-1");
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->id(), lease_id);
  EXPECT_EQ((*s)->ListLeases().leases_size(), 3);
  // Released, the lease is no longer what the key names: a new acquisition.
  ASSERT_TRUE((*s)->ReleaseLease(lease_id).ok());
  EXPECT_NE((*s)->AcquireLease("rollout-0", 1, 60'000, "acquire-attempts-1")->id(), lease_id);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace wsync::control
