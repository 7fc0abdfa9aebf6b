#include "wsync/control/client.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <deque>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "channel.h"
#include "wsync/control/rpc_status.h"
#include "wsync/util/text.h"
#include "wsync/v1/coordinator.grpc.pb.h"

namespace wsync::control {
namespace {

namespace v1 = wsync::v1;

// A key for the attempts of one call (RegisterRequest.request_id,
// AcquireLeaseRequest.request_id): 128 random bits in hex.
std::string NewRequestId() {
  thread_local std::mt19937_64 rng(std::random_device{}());
  char buf[33];
  std::snprintf(buf, sizeof buf, "%016" PRIx64 "%016" PRIx64, rng(), rng());
  return buf;
}

// What a retried call may find when an earlier attempt took effect and only
// its answer was lost.
enum class Retried {
  kSameAnswer,      // the call is idempotent: the retry answers as the first attempt would
  kNotFoundIsDone,  // releases: NotFound after a lost answer is the first attempt's work
};

// A client of one coordinator, or of replicas: calls go to the one that
// led last; NOT_LEADER (naming the leader) or an unreachable replica moves
// them on, until the call's deadline. Every call is safe to retry
// (docs/control-plane.md, "Retries"): Register and AcquireLease carry a
// request id that every attempt of the call shares.
class GrpcClient : public CoordinatorClient {
 public:
  GrpcClient(std::vector<std::string> addresses, ChannelFactory channels, ClientOptions options)
      : channels_(std::move(channels)), options_(std::move(options)), several_(addresses.size() > 1) {
    for (auto& a : addresses) Add(a);
  }

  StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& request) override {
    v1::RegisterRequest req = request;
    if (req.request_id().empty()) req.set_request_id(NewRequestId());
    return Call<v1::RegisterResponse>("Register", [&](v1::Coordinator::Stub* stub, grpc::ClientContext* c, v1::RegisterResponse* r) {
      return stub->Register(c, req, r);
    });
  }
  StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& req) override {
    return Call<v1::HeartbeatResponse>("Heartbeat", [&](v1::Coordinator::Stub* stub, grpc::ClientContext* c, v1::HeartbeatResponse* r) {
      return stub->Heartbeat(c, req, r);
    });
  }
  Status Deregister(const std::string& name) override {
    v1::DeregisterRequest req;
    req.set_name(name);
    return Call<v1::DeregisterResponse>(
               "Deregister",
               [&](v1::Coordinator::Stub* stub, grpc::ClientContext* c, v1::DeregisterResponse* r) {
                 return stub->Deregister(c, req, r);
               },
               0, Retried::kNotFoundIsDone)
        .status();
  }
  StatusOr<uint64_t> Publish(const v1::VersionSummary& version) override {
    v1::PublishRequest req;
    *req.mutable_version() = version;
    auto r = Call<v1::PublishResponse>("Publish", [&](v1::Coordinator::Stub* stub, grpc::ClientContext* c, v1::PublishResponse* resp) {
      return stub->Publish(c, req, resp);
    });
    if (!r.ok()) return r.status();
    return r->head_version();
  }
  StatusOr<v1::ListVersionsResponse> ListVersions(uint64_t after) override {
    v1::ListVersionsRequest req;
    req.set_after(after);
    return Call<v1::ListVersionsResponse>("ListVersions", [&](v1::Coordinator::Stub* stub, grpc::ClientContext* c, v1::ListVersionsResponse* r) {
      return stub->ListVersions(c, req, r);
    });
  }
  Status Watch(const v1::WatchRequest& req, const std::function<bool(const v1::VersionSummary&)>& on_version) override {
    grpc::ClientContext ctx;
    Prepare(&ctx, /*deadline=*/false);
    if (!Track(&ctx)) return Status::Ok();  // cancelled before it began
    const size_t at = Current();
    auto reader = Stub(at)->Watch(&ctx, req);
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
    Status failed = FromGrpc(s, "Watch " + Address(at));
    (void)MoveOn(at, failed);  // the caller's next Watch goes to the leader
    return failed;
  }
  StatusOr<v1::Node> ReportApplied(const std::string& name, uint64_t version) override {
    v1::ReportAppliedRequest req;
    req.set_name(name);
    req.set_version(version);
    auto r = Call<v1::ReportAppliedResponse>("ReportApplied", [&](v1::Coordinator::Stub* stub, grpc::ClientContext* c, v1::ReportAppliedResponse* resp) {
      return stub->ReportApplied(c, req, resp);
    });
    if (!r.ok()) return r.status();
    return r->node();
  }
  StatusOr<v1::Lease> AcquireLease(const std::string& node, uint64_t version, uint64_t ttl_ms) override {
    v1::AcquireLeaseRequest req;
    req.set_node(node);
    req.set_version(version);
    req.set_ttl_ms(ttl_ms);
    req.set_request_id(NewRequestId());
    auto r = Call<v1::AcquireLeaseResponse>("AcquireLease", [&](v1::Coordinator::Stub* stub, grpc::ClientContext* c, v1::AcquireLeaseResponse* resp) {
      return stub->AcquireLease(c, req, resp);
    });
    if (!r.ok()) return r.status();
    return r->lease();
  }
  StatusOr<v1::Lease> RenewLease(uint64_t id, uint64_t ttl_ms) override {
    v1::RenewLeaseRequest req;
    req.set_id(id);
    req.set_ttl_ms(ttl_ms);
    auto r = Call<v1::RenewLeaseResponse>("RenewLease", [&](v1::Coordinator::Stub* stub, grpc::ClientContext* c, v1::RenewLeaseResponse* resp) {
      return stub->RenewLease(c, req, resp);
    });
    if (!r.ok()) return r.status();
    return r->lease();
  }
  Status ReleaseLease(uint64_t id) override {
    v1::ReleaseLeaseRequest req;
    req.set_id(id);
    return Call<v1::ReleaseLeaseResponse>(
               "ReleaseLease",
               [&](v1::Coordinator::Stub* stub, grpc::ClientContext* c, v1::ReleaseLeaseResponse* r) {
                 return stub->ReleaseLease(c, req, r);
               },
               0, Retried::kNotFoundIsDone)
        .status();
  }
  StatusOr<v1::ListLeasesResponse> ListLeases() override {
    v1::ListLeasesRequest req;
    return Call<v1::ListLeasesResponse>("ListLeases", [&](v1::Coordinator::Stub* stub, grpc::ClientContext* c, v1::ListLeasesResponse* r) {
      return stub->ListLeases(c, req, r);
    });
  }
  StatusOr<v1::MayPublishResponse> MayPublish(uint64_t version, int64_t wait_ms) override {
    v1::MayPublishRequest req;
    req.set_version(version);
    req.set_wait_ms(wait_ms);
    return Call<v1::MayPublishResponse>(
        "MayPublish",
        [&](v1::Coordinator::Stub* stub, grpc::ClientContext* c, v1::MayPublishResponse* r) { return stub->MayPublish(c, req, r); },
        wait_ms);
  }
  StatusOr<v1::StatusResponse> GetStatus() override {
    v1::StatusRequest req;
    return Call<v1::StatusResponse>("Status", [&](v1::Coordinator::Stub* stub, grpc::ClientContext* c, v1::StatusResponse* r) {
      return stub->Status(c, req, r);
    });
  }
  StatusOr<v1::ReplicaResponse> DescribeReplica() override {
    // The replica asked, not the leader: no moving on.
    const size_t at = Current();
    grpc::ClientContext ctx;
    Prepare(&ctx, true);
    v1::ReplicaRequest req;
    v1::ReplicaResponse resp;
    grpc::Status s = Stub(at)->Replica(&ctx, req, &resp);
    if (!s.ok()) return FromGrpc(s, "Replica " + Address(at));
    return resp;
  }
  StatusOr<v1::GetLayoutResponse> GetLayout() override {
    v1::GetLayoutRequest req;
    return Call<v1::GetLayoutResponse>("GetLayout", [&](v1::Coordinator::Stub* stub, grpc::ClientContext* c, v1::GetLayoutResponse* r) {
      return stub->GetLayout(c, req, r);
    });
  }
  Status SetLayout(const v1::Layout& layout) override {
    v1::SetLayoutRequest req;
    *req.mutable_layout() = layout;
    return Call<v1::SetLayoutResponse>("SetLayout", [&](v1::Coordinator::Stub* stub, grpc::ClientContext* c, v1::SetLayoutResponse* r) {
             return stub->SetLayout(c, req, r);
           }).status();
  }
  StatusOr<uint32_t> OfferLayout(const std::string& node, const v1::ServedLayout& layout) override {
    v1::OfferLayoutRequest req;
    req.set_node(node);
    *req.mutable_layout() = layout;
    WSYNC_ASSIGN_OR_RETURN(auto resp, Call<v1::OfferLayoutResponse>("OfferLayout", [&](v1::Coordinator::Stub* stub, grpc::ClientContext* c, v1::OfferLayoutResponse* r) {
                             return stub->OfferLayout(c, req, r);
                           }));
    return resp.layouts();
  }
  StatusOr<std::vector<v1::ServedLayout>> ListOfferedLayouts() override {
    v1::ListOfferedLayoutsRequest req;
    WSYNC_ASSIGN_OR_RETURN(auto resp, Call<v1::ListOfferedLayoutsResponse>("ListOfferedLayouts", [&](v1::Coordinator::Stub* stub, grpc::ClientContext* c, v1::ListOfferedLayoutsResponse* r) {
                             return stub->ListOfferedLayouts(c, req, r);
                           }));
    return std::vector<v1::ServedLayout>(resp.layouts().begin(), resp.layouts().end());
  }
  void Cancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    for (grpc::ClientContext* c : in_flight_) c->TryCancel();
  }

 private:
  void Prepare(grpc::ClientContext* ctx, bool deadline, int64_t extra_ms = 0) const {
    if (!options_.token.empty()) ctx->AddMetadata("authorization", "Bearer " + options_.token);
    for (const auto& [key, value] : options_.test_metadata) ctx->AddMetadata(key, value);
    ctx->set_wait_for_ready(options_.wait_for_ready);
    if (deadline) {
      // Among replicas, one that is stopped (not dead) must not hold a call for all of its time.
      const int64_t ms = several_ ? std::min<int64_t>(options_.timeout_ms, kReplicaAttemptMs) : options_.timeout_ms;
      ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms + extra_ms));
    }
  }

  template <typename R, typename F>
  StatusOr<R> Call(const char* method, F&& f, int64_t extra_ms = 0, Retried retried = Retried::kSameAnswer) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.timeout_ms + extra_ms);
    bool may_have_taken_effect = false;  // an attempt failed in a way that may have lost only its answer
    size_t without_etcd = 0;             // replicas in a row that cannot reach etcd's majority
    for (;;) {
      const size_t at = Current();
      grpc::ClientContext ctx;
      Prepare(&ctx, true, extra_ms);
      // After Cancel, calls still run (Deregister on the way out) but no
      // longer wait for a coordinator that is not there.
      if (!Track(&ctx)) ctx.set_wait_for_ready(false);
      R resp;
      grpc::Status s = f(Stub(at), &ctx, &resp);
      Untrack(&ctx);
      if (s.ok()) return resp;
      Status failed = FromGrpc(s, std::string(method) + " " + Address(at));
      if (may_have_taken_effect && retried == Retried::kNotFoundIsDone && failed.code() == StatusCode::kNotFound) {
        return R();
      }
      // Every replica has waited out its lease and grace without etcd: no
      // leader can be elected until etcd's majority is back; say so now.
      if (failed.HasReason(reasons::kEtcdUnreachable)) {
        if (++without_etcd >= EndpointCount()) return failed;
      } else if (failed.HasReason(reasons::kNotLeader)) {
        without_etcd = 0;
      }
      if (!MoveOn(at, failed) || std::chrono::steady_clock::now() >= deadline || cancelled()) return failed;
      may_have_taken_effect |= !failed.HasReason(reasons::kNotLeader) && !failed.HasReason(reasons::kEtcdUnreachable);
    }
  }

  // After a failure at replica `at`: points the client at the leader it
  // named, or at the next replica; false when there is no other to try (a
  // failure that is not transient or about who leads, or one address without
  // wait_for_ready: the CLI fails fast). Waits a moment when no leader is
  // known (an election in progress) or before trying one address again.
  bool MoveOn(size_t at, const Status& failed) {
    const bool not_leader = failed.HasReason(reasons::kNotLeader) || failed.HasReason(reasons::kEtcdUnreachable);
    if (!not_leader && failed.code() != StatusCode::kUnavailable && failed.code() != StatusCode::kDeadlineExceeded) {
      return false;
    }
    std::string leader;
    if (not_leader) {
      if (auto it = failed.reason()->metadata.find("leader"); it != failed.reason()->metadata.end()) leader = it->second;
    }
    bool pause = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (endpoints_.size() == 1 && leader.empty() && !options_.wait_for_ready) return false;
      if (!leader.empty()) {
        current_ = AddLocked(leader);
        return true;
      }
      if (current_ == at) current_ = (at + 1) % endpoints_.size();
      pause = current_ == 0 || not_leader;
    }
    // A round of every replica, or a replica that knows no leader: an
    // election is under way; give it a moment.
    if (pause) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    return true;
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

  struct Endpoint {
    std::string address;
    std::unique_ptr<v1::Coordinator::Stub> stub;
  };

  size_t Add(const std::string& address) {
    std::lock_guard<std::mutex> lock(mu_);
    return AddLocked(address);
  }
  size_t AddLocked(const std::string& address) {
    for (size_t i = 0; i < endpoints_.size(); ++i) {
      if (endpoints_[i].address == address) return i;
    }
    endpoints_.push_back({address, v1::Coordinator::NewStub(channels_(address))});
    return endpoints_.size() - 1;
  }
  size_t Current() {
    std::lock_guard<std::mutex> lock(mu_);
    return current_;
  }
  size_t EndpointCount() {
    std::lock_guard<std::mutex> lock(mu_);
    return endpoints_.size();
  }
  v1::Coordinator::Stub* Stub(size_t i) {
    std::lock_guard<std::mutex> lock(mu_);
    return endpoints_[i].stub.get();  // endpoints_ only grows (a deque keeps it in place)
  }
  std::string Address(size_t i) {
    std::lock_guard<std::mutex> lock(mu_);
    return endpoints_[i].address;
  }
  bool cancelled() {
    std::lock_guard<std::mutex> lock(mu_);
    return cancelled_;
  }

  static constexpr int64_t kReplicaAttemptMs = 1500;

  ChannelFactory channels_;
  ClientOptions options_;
  const bool several_;
  std::mutex mu_;
  std::deque<Endpoint> endpoints_;
  size_t current_ = 0;
  bool cancelled_ = false;
  std::set<grpc::ClientContext*> in_flight_;
};

}  // namespace

StatusOr<std::unique_ptr<CoordinatorClient>> NewCoordinatorClient(const ClientOptions& options,
                                                                  ChannelFactory channels) {
  const std::vector<std::string> addresses = SplitList(options.address);
  if (addresses.empty()) return InvalidArgumentError("no coordinator address (--coordinator or WSYNC_COORDINATOR)");
  for (const auto& a : addresses) {
    if (a.rfind("unix:", 0) != 0 && a.find(':') == std::string::npos) {
      return InvalidArgumentError("coordinator address '" + a + "' is not host:port or unix:PATH");
    }
  }
  ClientOptions opts = options;
  // Several replicas: a call moves on from one that does not answer instead of waiting for it.
  if (addresses.size() > 1) opts.wait_for_ready = false;
  return std::unique_ptr<CoordinatorClient>(new GrpcClient(addresses, std::move(channels), std::move(opts)));
}

StatusOr<std::unique_ptr<CoordinatorClient>> NewCoordinatorClient(const ClientOptions& options) {
  WSYNC_ASSIGN_OR_RETURN(auto creds, ClientCredentials(options.tls_ca_file, options.tls_cert_file,
                                                       options.tls_key_file));
  grpc::ChannelArguments args;
  ReconnectQuickly(&args, 2000);
  // Layouts offered by the ranks of a large mixture of experts run to megabytes.
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  if (!options.tls_ca_file.empty() && !options.tls_server_name.empty()) {
    args.SetSslTargetNameOverride(options.tls_server_name);
  }
  return NewCoordinatorClient(options, [creds, args](const std::string& address) {
    // Unix sockets never use TLS (local, protected by file permissions).
    const bool unix_socket = address.rfind("unix:", 0) == 0;
    return grpc::CreateCustomChannel(address, unix_socket ? grpc::InsecureChannelCredentials() : creds, args);
  });
}

}  // namespace wsync::control
