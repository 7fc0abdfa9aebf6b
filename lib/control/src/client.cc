#include "wsync/control/client.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <mutex>
#include <set>

#include "wsync/control/rpc_status.h"
#include "wsync/util/file.h"
#include "wsync/v1/coordinator.grpc.pb.h"

namespace wsync::control {
namespace {

namespace v1 = wsync::v1;

class GrpcClient : public CoordinatorClient {
 public:
  GrpcClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options)
      : stub_(v1::Coordinator::NewStub(channel)), options_(std::move(options)) {}

  StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& req) override {
    return Call<v1::RegisterResponse>("Register", [&](grpc::ClientContext* c, v1::RegisterResponse* r) {
      return stub_->Register(c, req, r);
    });
  }
  StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& req) override {
    return Call<v1::HeartbeatResponse>("Heartbeat", [&](grpc::ClientContext* c, v1::HeartbeatResponse* r) {
      return stub_->Heartbeat(c, req, r);
    });
  }
  Status Deregister(const std::string& name) override {
    v1::DeregisterRequest req;
    req.set_name(name);
    return Call<v1::DeregisterResponse>("Deregister", [&](grpc::ClientContext* c, v1::DeregisterResponse* r) {
             return stub_->Deregister(c, req, r);
           }).status();
  }
  StatusOr<uint64_t> Publish(const v1::VersionSummary& version) override {
    v1::PublishRequest req;
    *req.mutable_version() = version;
    auto r = Call<v1::PublishResponse>("Publish", [&](grpc::ClientContext* c, v1::PublishResponse* resp) {
      return stub_->Publish(c, req, resp);
    });
    if (!r.ok()) return r.status();
    return r->head_version();
  }
  StatusOr<v1::ListVersionsResponse> ListVersions(uint64_t after) override {
    v1::ListVersionsRequest req;
    req.set_after(after);
    return Call<v1::ListVersionsResponse>("ListVersions", [&](grpc::ClientContext* c, v1::ListVersionsResponse* r) {
      return stub_->ListVersions(c, req, r);
    });
  }
  Status Watch(const v1::WatchRequest& req, const std::function<bool(const v1::VersionSummary&)>& on_version) override {
    grpc::ClientContext ctx;
    Prepare(&ctx, /*deadline=*/false);
    if (!Track(&ctx)) return Status::Ok();  // cancelled before it began
    auto reader = stub_->Watch(&ctx, req);
    v1::VersionSummary v;
    bool stopped = false;
    while (reader->Read(&v)) {
      if (!on_version(v)) {
        stopped = true;
        ctx.TryCancel();
        break;
      }
    }
    grpc::Status s = reader->Finish();
    Untrack(&ctx);
    if (stopped || s.error_code() == grpc::StatusCode::CANCELLED) return Status::Ok();
    if (s.ok()) return UnavailableError("watch stream ended by the coordinator");
    return FromGrpc(s, "Watch " + options_.address);
  }
  StatusOr<v1::Node> ReportApplied(const std::string& name, uint64_t version) override {
    v1::ReportAppliedRequest req;
    req.set_name(name);
    req.set_version(version);
    auto r = Call<v1::ReportAppliedResponse>("ReportApplied", [&](grpc::ClientContext* c, v1::ReportAppliedResponse* resp) {
      return stub_->ReportApplied(c, req, resp);
    });
    if (!r.ok()) return r.status();
    return r->node();
  }
  StatusOr<v1::Lease> AcquireLease(const std::string& node, uint64_t version, uint64_t ttl_ms) override {
    v1::AcquireLeaseRequest req;
    req.set_node(node);
    req.set_version(version);
    req.set_ttl_ms(ttl_ms);
    auto r = Call<v1::AcquireLeaseResponse>("AcquireLease", [&](grpc::ClientContext* c, v1::AcquireLeaseResponse* resp) {
      return stub_->AcquireLease(c, req, resp);
    });
    if (!r.ok()) return r.status();
    return r->lease();
  }
  StatusOr<v1::Lease> RenewLease(uint64_t id, uint64_t ttl_ms) override {
    v1::RenewLeaseRequest req;
    req.set_id(id);
    req.set_ttl_ms(ttl_ms);
    auto r = Call<v1::RenewLeaseResponse>("RenewLease", [&](grpc::ClientContext* c, v1::RenewLeaseResponse* resp) {
      return stub_->RenewLease(c, req, resp);
    });
    if (!r.ok()) return r.status();
    return r->lease();
  }
  Status ReleaseLease(uint64_t id) override {
    v1::ReleaseLeaseRequest req;
    req.set_id(id);
    return Call<v1::ReleaseLeaseResponse>("ReleaseLease", [&](grpc::ClientContext* c, v1::ReleaseLeaseResponse* r) {
             return stub_->ReleaseLease(c, req, r);
           }).status();
  }
  StatusOr<v1::ListLeasesResponse> ListLeases() override {
    v1::ListLeasesRequest req;
    return Call<v1::ListLeasesResponse>("ListLeases", [&](grpc::ClientContext* c, v1::ListLeasesResponse* r) {
      return stub_->ListLeases(c, req, r);
    });
  }
  StatusOr<v1::MayPublishResponse> MayPublish(uint64_t version, int64_t wait_ms) override {
    v1::MayPublishRequest req;
    req.set_version(version);
    req.set_wait_ms(wait_ms);
    return Call<v1::MayPublishResponse>(
        "MayPublish",
        [&](grpc::ClientContext* c, v1::MayPublishResponse* r) { return stub_->MayPublish(c, req, r); },
        wait_ms);
  }
  StatusOr<v1::StatusResponse> GetStatus() override {
    v1::StatusRequest req;
    return Call<v1::StatusResponse>("Status", [&](grpc::ClientContext* c, v1::StatusResponse* r) {
      return stub_->Status(c, req, r);
    });
  }
  StatusOr<v1::GetLayoutResponse> GetLayout() override {
    v1::GetLayoutRequest req;
    return Call<v1::GetLayoutResponse>("GetLayout", [&](grpc::ClientContext* c, v1::GetLayoutResponse* r) {
      return stub_->GetLayout(c, req, r);
    });
  }
  Status SetLayout(const v1::Layout& layout) override {
    v1::SetLayoutRequest req;
    *req.mutable_layout() = layout;
    return Call<v1::SetLayoutResponse>("SetLayout", [&](grpc::ClientContext* c, v1::SetLayoutResponse* r) {
             return stub_->SetLayout(c, req, r);
           }).status();
  }
  void Cancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    for (grpc::ClientContext* c : in_flight_) c->TryCancel();
  }

 private:
  void Prepare(grpc::ClientContext* ctx, bool deadline, int64_t extra_ms = 0) const {
    if (!options_.token.empty()) ctx->AddMetadata("authorization", "Bearer " + options_.token);
    ctx->set_wait_for_ready(options_.wait_for_ready);
    if (deadline) {
      ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(options_.timeout_ms + extra_ms));
    }
  }

  template <typename R, typename F>
  StatusOr<R> Call(const char* method, F&& f, int64_t extra_ms = 0) {
    grpc::ClientContext ctx;
    Prepare(&ctx, true, extra_ms);
    // After Cancel, calls still run (Deregister on the way out) but no
    // longer wait for a coordinator that is not there.
    if (!Track(&ctx)) ctx.set_wait_for_ready(false);
    R resp;
    grpc::Status s = f(&ctx, &resp);
    Untrack(&ctx);
    if (!s.ok()) return FromGrpc(s, std::string(method) + " " + options_.address);
    return resp;
  }

  // Registers a call for Cancel; false (not registered) once cancelled.
  bool Track(grpc::ClientContext* ctx) {
    std::lock_guard<std::mutex> lock(mu_);
    if (cancelled_) return false;
    in_flight_.insert(ctx);
    return true;
  }
  void Untrack(grpc::ClientContext* ctx) {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.erase(ctx);
  }

  std::unique_ptr<v1::Coordinator::Stub> stub_;
  ClientOptions options_;
  std::mutex mu_;
  bool cancelled_ = false;
  std::set<grpc::ClientContext*> in_flight_;
};

}  // namespace

StatusOr<std::unique_ptr<CoordinatorClient>> NewCoordinatorClient(const ClientOptions& options) {
  if (options.address.empty()) return InvalidArgumentError("no coordinator address (--coordinator or WSYNC_COORDINATOR)");
  const bool unix_socket = options.address.rfind("unix:", 0) == 0;
  if (!unix_socket && options.address.find(':') == std::string::npos) {
    return InvalidArgumentError("coordinator address '" + options.address + "' is not host:port or unix:PATH");
  }
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  grpc::ChannelArguments args;
  // Reconnect quickly after a coordinator restart (gRPC's default starts at 1 s).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  if (!options.tls_ca_file.empty() && !unix_socket) {
    grpc::SslCredentialsOptions ssl;
    WSYNC_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFile(options.tls_ca_file));
    if (!options.tls_cert_file.empty()) {
      WSYNC_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadFile(options.tls_cert_file));
      WSYNC_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadFile(options.tls_key_file));
    }
    creds = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  }
  auto channel = grpc::CreateCustomChannel(options.address, creds, args);
  return std::unique_ptr<CoordinatorClient>(new GrpcClient(channel, options));
}

}  // namespace wsync::control
