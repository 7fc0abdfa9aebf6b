#include "wsync/control/server.h"

#include "wsync/control/client.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "fault_injection.h"
#include "watch_streams.h"
#include "wsync/control/rpc_status.h"
#include "wsync/util/file.h"
#include "wsync/v1/coordinator.grpc.pb.h"

namespace wsync::control {
namespace {

using grpc::ServerContext;
namespace v1 = wsync::v1;

// Removes the reflection plugin, which linking gRPC's reflection library
// registers for every server of the process.
class WithoutReflection : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    std::erase_if(*plugins, [](const auto& p) { return p->name() == "proto_server_reflection"; });
  }
};

// Constant-time comparison, so the token does not leak through timing.
bool SameSecret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

class Metrics {
 public:
  // `token` non-empty: requests must carry it as the basic-auth password.
  Metrics(const std::string& listen, const std::string& token) {
    registry_ = std::make_shared<prometheus::Registry>();
    exposer_ = std::make_unique<prometheus::Exposer>(listen);
    if (!token.empty()) {
      exposer_->RegisterAuth([token](const std::string&, const std::string& password) {
        return SameSecret(password, token);
      }, "wsync");
    }
    exposer_->RegisterCollectable(registry_);
    rpcs_ = &prometheus::BuildCounter().Name("wsync_coordinator_rpcs_total").Help("RPCs by method and code").Register(*registry_);
    latency_ = &prometheus::BuildHistogram().Name("wsync_coordinator_rpc_seconds").Help("RPC latency").Register(*registry_);
    head_ = &prometheus::BuildGauge().Name("wsync_head_version").Help("Newest published version").Register(*registry_);
    nodes_ = &prometheus::BuildGauge().Name("wsync_nodes").Help("Nodes by role and state").Register(*registry_);
    staleness_ = &prometheus::BuildGauge().Name("wsync_sink_staleness").Help("head - applied version per sink").Register(*registry_);
  }
  int port() const {
    auto ports = exposer_->GetListeningPorts();
    return ports.empty() ? 0 : ports[0];
  }
  // A call that ended (a stream: that started), by code.
  void Count(const std::string& method, grpc::StatusCode code) {
    rpcs_->Add({{"method", method}, {"code", std::to_string(static_cast<int>(code))}}).Increment();
  }
  void Rpc(const std::string& method, grpc::StatusCode code, double seconds) {
    Count(method, code);
    latency_->Add({{"method", method}}, prometheus::Histogram::BucketBoundaries{1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1})
        .Observe(seconds);
  }
  void Update(const v1::StatusResponse& s) {
    head_->Add({}).Set(static_cast<double>(s.head_version()));
    std::map<std::pair<std::string, std::string>, int> counts;
    for (const auto& n : s.nodes()) {
      ++counts[{v1::Role_Name(n.role()), v1::NodeState_Name(n.state())}];
      if (n.role() == v1::ROLE_SINK) staleness_->Add({{"sink", n.name()}}).Set(static_cast<double>(n.staleness()));
    }
    for (const auto& [k, c] : counts) nodes_->Add({{"role", k.first}, {"state", k.second}}).Set(c);
  }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  prometheus::Family<prometheus::Counter>* rpcs_;
  prometheus::Family<prometheus::Histogram>* latency_;
  prometheus::Family<prometheus::Gauge>* head_;
  prometheus::Family<prometheus::Gauge>* nodes_;
  prometheus::Family<prometheus::Gauge>* staleness_;
};

// The calls every sink makes all the time (a heartbeat per TTL / 4, a
// report per version) use gRPC's callback API: answered on the thread that
// read them, without a hand-off to a thread of the synchronous pool (at a
// fleet's rate the hand-offs were most of the coordinator's CPU). Their
// handlers wait only for the state's mutex (held through another call's
// store write) and, when a lease has just expired, for the record of its end.
// Watch streams too (every sink holds one open): watch_streams.h. The other
// calls wait by design (a commit to etcd, MayPublish) and stay synchronous.
using ServiceBase = v1::Coordinator::WithCallbackMethod_Heartbeat<
    v1::Coordinator::WithCallbackMethod_ReportApplied<v1::Coordinator::WithCallbackMethod_Watch<v1::Coordinator::Service>>>;

class Service final : public ServiceBase {
 public:
  Service(StateHolder* holder, std::string token, Metrics* metrics, bool inject_faults)
      : holder_(holder), token_(std::move(token)), metrics_(metrics), inject_faults_(inject_faults) {}

  void Stop() {
    stopping_ = true;
    watches_.Stop();
  }

  grpc::Status Register(ServerContext* ctx, const v1::RegisterRequest* req, v1::RegisterResponse* resp) override {
    return Handle("Register", ctx, [&](CoordinatorState* state) { return Fill(state->Register(*req), resp); });
  }
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx, const v1::HeartbeatRequest* req,
                                      v1::HeartbeatResponse* resp) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(Handle("Heartbeat", ctx, [&](CoordinatorState* state) { return Fill(state->Heartbeat(*req), resp); }));
    return reactor;
  }
  grpc::Status Deregister(ServerContext* ctx, const v1::DeregisterRequest* req, v1::DeregisterResponse*) override {
    return Handle("Deregister", ctx, [&](CoordinatorState* state) { return state->Deregister(req->name()); });
  }
  grpc::Status Publish(ServerContext* ctx, const v1::PublishRequest* req, v1::PublishResponse* resp) override {
    return Handle("Publish", ctx, [&](CoordinatorState* state) {
      auto head = state->Publish(req->version());
      if (head.ok()) resp->set_head_version(*head);
      return head.status();
    });
  }
  grpc::Status ListVersions(ServerContext* ctx, const v1::ListVersionsRequest* req,
                            v1::ListVersionsResponse* resp) override {
    return Handle("ListVersions", ctx, [&](CoordinatorState* state) {
      *resp = state->ListVersions(req->after());
      return wsync::Status::Ok();
    });
  }
  grpc::ServerWriteReactor<v1::VersionSummary>* Watch(grpc::CallbackServerContext* ctx,
                                                      const v1::WatchRequest* req) override {
    wsync::Status s = Authenticate(ctx);
    auto state = s.ok() ? holder_->Current() : StatusOr<std::shared_ptr<CoordinatorState>>(s);
    if (metrics_ != nullptr) metrics_->Count("Watch", ToGrpc(state.status()).error_code());
    if (!state.ok()) return new RefusedWatch(ToGrpc(state.status()));
    auto* reactor = new WatchReactor(&watches_, std::move(*state), *req);
    watches_.Add(reactor);
    return reactor;
  }
  grpc::ServerUnaryReactor* ReportApplied(grpc::CallbackServerContext* ctx, const v1::ReportAppliedRequest* req,
                                          v1::ReportAppliedResponse* resp) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(Handle("ReportApplied", ctx, [&](CoordinatorState* state) {
      auto n = state->ReportApplied(req->name(), req->version());
      if (n.ok()) *resp->mutable_node() = *n;
      return n.status();
    }));
    return reactor;
  }
  grpc::Status AcquireLease(ServerContext* ctx, const v1::AcquireLeaseRequest* req,
                            v1::AcquireLeaseResponse* resp) override {
    return Handle("AcquireLease", ctx, [&](CoordinatorState* state) {
      auto l = state->AcquireLease(req->node(), req->version(), req->ttl_ms(), req->request_id());
      if (l.ok()) *resp->mutable_lease() = *l;
      return l.status();
    });
  }
  grpc::Status RenewLease(ServerContext* ctx, const v1::RenewLeaseRequest* req, v1::RenewLeaseResponse* resp) override {
    return Handle("RenewLease", ctx, [&](CoordinatorState* state) {
      auto l = state->RenewLease(req->id(), req->ttl_ms());
      if (l.ok()) *resp->mutable_lease() = *l;
      return l.status();
    });
  }
  grpc::Status ReleaseLease(ServerContext* ctx, const v1::ReleaseLeaseRequest* req, v1::ReleaseLeaseResponse*) override {
    return Handle("ReleaseLease", ctx, [&](CoordinatorState* state) { return state->ReleaseLease(req->id()); });
  }
  grpc::Status ListLeases(ServerContext* ctx, const v1::ListLeasesRequest*, v1::ListLeasesResponse* resp) override {
    return Handle("ListLeases", ctx, [&](CoordinatorState* state) {
      *resp = state->ListLeases();
      return wsync::Status::Ok();
    });
  }
  grpc::Status MayPublish(ServerContext* ctx, const v1::MayPublishRequest* req, v1::MayPublishResponse* resp) override {
    return Handle("MayPublish", ctx, [&](CoordinatorState* state) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max<int64_t>(0, req->wait_ms()));
      WSYNC_ASSIGN_OR_RETURN(*resp, state->MayPublishWaiting(req->version(), deadline,
                                                               [&] { return ctx->IsCancelled() || stopping_.load() || !Holds(state); }));
      return wsync::Status::Ok();
    });
  }
  grpc::Status SetLayout(ServerContext* ctx, const v1::SetLayoutRequest* req, v1::SetLayoutResponse*) override {
    return Handle("SetLayout", ctx, [&](CoordinatorState* state) { return state->SetLayout(req->layout()); });
  }
  grpc::Status GetLayout(ServerContext* ctx, const v1::GetLayoutRequest*, v1::GetLayoutResponse* resp) override {
    return Handle("GetLayout", ctx, [&](CoordinatorState* state) {
      *resp = state->GetLayout();
      return wsync::Status::Ok();
    });
  }
  grpc::Status OfferLayout(ServerContext* ctx, const v1::OfferLayoutRequest* req,
                           v1::OfferLayoutResponse* resp) override {
    return Handle("OfferLayout", ctx, [&](CoordinatorState* state) {
      WSYNC_ASSIGN_OR_RETURN(uint32_t n, state->offers().Offer(req->node(), req->layout()));
      resp->set_layouts(n);
      return wsync::Status::Ok();
    });
  }
  grpc::Status ListOfferedLayouts(ServerContext* ctx, const v1::ListOfferedLayoutsRequest*,
                                  v1::ListOfferedLayoutsResponse* resp) override {
    return Handle("ListOfferedLayouts", ctx, [&](CoordinatorState* state) {
      for (auto& l : state->offers().List()) *resp->add_layouts() = std::move(l);
      return wsync::Status::Ok();
    });
  }
  grpc::Status Replica(ServerContext* ctx, const v1::ReplicaRequest*, v1::ReplicaResponse* resp) override {
    wsync::Status s = Authenticate(ctx);
    if (s.ok()) *resp = holder_->Describe();
    return ToGrpc(s);
  }
  grpc::Status Status(ServerContext* ctx, const v1::StatusRequest*, v1::StatusResponse* resp) override {
    return Handle("Status", ctx, [&](CoordinatorState* state) {
      *resp = state->GetStatus();
      return wsync::Status::Ok();
    });
  }

 private:
  template <typename T, typename R>
  static wsync::Status Fill(StatusOr<T> r, R* resp) {
    if (r.ok()) *resp = std::move(*r);
    return r.status();
  }

  wsync::Status Authenticate(grpc::ServerContextBase* ctx) const {
    if (token_.empty()) return wsync::Status::Ok();
    const auto& md = ctx->client_metadata();
    auto it = md.find("authorization");
    if (it == md.end()) return UnauthenticatedError("missing bearer token");
    const std::string value(it->second.data(), it->second.size());
    if (value.rfind("Bearer ", 0) != 0 || !SameSecret(value.substr(7), token_)) {
      return UnauthenticatedError("invalid bearer token");
    }
    return wsync::Status::Ok();
  }

  template <typename F>
  grpc::Status Handle(const char* method, grpc::ServerContextBase* ctx, F&& body) {
    const auto t0 = std::chrono::steady_clock::now();
    wsync::Status s = Authenticate(ctx);
    if (!s.ok()) {
      spdlog::warn("{} from {} rejected: {}", method, ctx->peer(), s.message());
    } else if (auto state = holder_->Current(); !state.ok()) {
      s = state.status();
    } else {
      fault::die_after_commit = inject_faults_ && Injected(ctx, fault::kDieAfterCommit);
      s = body(state->get());  // the pointer keeps a state a replica gave up alive until the call ends
      fault::die_after_commit = false;
    }
    grpc::Status g = ToGrpc(s);
    if (metrics_ != nullptr) {
      metrics_->Rpc(method, g.error_code(),
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return g;
  }

  // Whether `state` is still the one this server answers with (a replica
  // that stopped leading ends its watches).
  bool Holds(const CoordinatorState* state) const {
    auto now = holder_->Current();
    return now.ok() && now->get() == state;
  }

  static bool Injected(grpc::ServerContextBase* ctx, const char* fault) {
    const auto& md = ctx->client_metadata();
    auto it = md.find(fault::kMetadataKey);
    return it != md.end() && std::string(it->second.data(), it->second.size()) == fault;
  }

  StateHolder* holder_;
  std::string token_;
  Metrics* metrics_;
  const bool inject_faults_;
  std::atomic<bool> stopping_{false};
  WatchHub watches_{holder_};
};

// The embedded coordinator's state: always here.
class FixedHolder : public StateHolder {
 public:
  explicit FixedHolder(CoordinatorState* state) : state_(state, [](CoordinatorState*) {}) {}
  StatusOr<std::shared_ptr<CoordinatorState>> Current() override { return state_; }

 private:
  std::shared_ptr<CoordinatorState> state_;
};

class ServerImpl : public CoordinatorServer {
 public:
  ~ServerImpl() override { Shutdown(); }

  std::vector<int> ports() const override { return ports_; }
  int metrics_port() const override { return metrics_ ? metrics_->port() : 0; }

  void Shutdown() override {
    if (stopped_.exchange(true)) return;
    service_->Stop();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    ticker_stop_ = true;
    if (ticker_.joinable()) ticker_.join();
    // The applied versions reported since the last tick.
    if (auto state = holder_->Current(); state.ok()) {
      if (wsync::Status s = (*state)->Flush(); !s.ok()) spdlog::warn("at shutdown: {}", s.ToString());
    }
  }
  void Wait() override { server_->Wait(); }

  std::unique_ptr<FixedHolder> fixed_;
  StateHolder* holder_ = nullptr;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  std::vector<int> ports_;
  std::thread ticker_;
  std::atomic<bool> ticker_stop_{false};
  std::atomic<bool> stopped_{false};
};

}  // namespace

StatusOr<std::string> ReadTokenFile(const std::string& path) {
  WSYNC_ASSIGN_OR_RETURN(std::string token, ReadFile(path));
  const auto first = token.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return InvalidArgumentError("token file " + path + " is empty");
  const auto last = token.find_last_not_of(" \t\r\n");
  return token.substr(first, last - first + 1);
}

StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(const ServerOptions& options,
                                                                      CoordinatorState* state) {
  auto fixed = std::make_unique<FixedHolder>(state);
  StateHolder* holder = fixed.get();
  WSYNC_ASSIGN_OR_RETURN(auto server, Start(options, holder));
  static_cast<ServerImpl*>(server.get())->fixed_ = std::move(fixed);
  return server;
}

StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(const ServerOptions& options,
                                                                      StateHolder* holder) {
  if (options.listen.empty()) return InvalidArgumentError("no listen address");
  auto impl = std::make_unique<ServerImpl>();
  impl->holder_ = holder;
  if (!options.metrics_listen.empty()) {
    try {
      impl->metrics_ = std::make_unique<Metrics>(options.metrics_listen, options.metrics_auth ? options.token : "");
    } catch (const std::exception& e) {
      return UnavailableError("metrics listener " + options.metrics_listen + ": " + e.what());
    }
  }
  impl->service_ = std::make_unique<Service>(holder, options.token, impl->metrics_.get(), options.inject_faults);

  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (!options.tls.cert_file.empty()) {
    grpc::SslServerCredentialsOptions ssl(options.tls.client_ca_file.empty()
                                              ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                              : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    WSYNC_ASSIGN_OR_RETURN(std::string cert, ReadFile(options.tls.cert_file));
    WSYNC_ASSIGN_OR_RETURN(std::string key, ReadFile(options.tls.key_file));
    ssl.pem_key_cert_pairs.push_back({key, cert});
    if (!options.tls.client_ca_file.empty()) {
      WSYNC_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFile(options.tls.client_ca_file));
    }
    creds = grpc::SslServerCredentials(ssl);
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);  // layouts offered by large models' ranks
  if (!options.reflection) builder.SetOption(std::make_unique<WithoutReflection>());
  std::vector<std::unique_ptr<int>> bound;
  for (const auto& addr : options.listen) {
    bound.push_back(std::make_unique<int>(0));
    // Unix sockets never use TLS (local, protected by file permissions).
    const bool unix_socket = addr.rfind("unix:", 0) == 0;
    builder.AddListeningPort(addr, unix_socket ? grpc::InsecureServerCredentials() : creds,
                             unix_socket ? nullptr : bound.back().get());
  }
  builder.RegisterService(impl->service_.get());
  impl->server_ = builder.BuildAndStart();
  if (!impl->server_) {
    std::string all;
    for (const auto& a : options.listen) all += (all.empty() ? "" : ", ") + a;
    return UnavailableError("cannot listen on " + all + " (address in use or invalid?)");
  }
  for (size_t i = 0; i < options.listen.size(); ++i) {
    if (options.listen[i].rfind("unix:", 0) != 0) {
      if (*bound[i] == 0) {
        return UnavailableError("cannot listen on " + options.listen[i]);
      }
      impl->ports_.push_back(*bound[i]);
    }
  }
  impl->server_->GetHealthCheckService()->SetServingStatus(true);
  ServerImpl* raw = impl.get();
  impl->ticker_ = std::thread([raw, tick = options.tick_ms] {
    while (!raw->ticker_stop_) {
      if (auto state = raw->holder_->Current(); state.ok()) {
        (*state)->Tick();
        if (raw->metrics_) raw->metrics_->Update((*state)->GetStatus());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(tick));
    }
  });
  return std::unique_ptr<CoordinatorServer>(std::move(impl));
}

}  // namespace wsync::control
