#include "etcd.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <mutex>
#include <set>

#include "channel.h"
#include "etcd/rpc.grpc.pb.h"
#include "wsync/control/rpc_status.h"

namespace wsync::control {
namespace {

namespace pb = etcdserverpb;

std::string StripScheme(const std::string& endpoint) {
  for (const char* scheme : {"http://", "https://"}) {
    if (endpoint.rfind(scheme, 0) == 0) return endpoint.substr(std::char_traits<char>::length(scheme));
  }
  return endpoint;
}

// Errors after which another member may answer: unreachable, no leader, overloaded.
bool TryAnother(const grpc::Status& s) {
  return s.error_code() == grpc::StatusCode::UNAVAILABLE || s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
         s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
}

bool TokenExpired(const grpc::Status& s) {
  return s.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
         s.error_message().find("invalid auth token") != std::string::npos;
}

class GrpcEtcd : public Etcd {
 public:
  GrpcEtcd(EtcdOptions options, std::vector<std::shared_ptr<grpc::Channel>> channels)
      : options_(std::move(options)) {
    for (auto& c : channels) {
      members_.push_back({pb::KV::NewStub(c), pb::Lease::NewStub(c), pb::Auth::NewStub(c), pb::Watch::NewStub(c)});
    }
  }

  StatusOr<pb::RangeResponse> Range(const pb::RangeRequest& req) override {
    return Call<pb::RangeResponse>("Range", [&](Member& m, grpc::ClientContext* c, pb::RangeResponse* r) {
      return m.kv->Range(c, req, r);
    });
  }
  StatusOr<pb::TxnResponse> Txn(const pb::TxnRequest& req) override {
    return Call<pb::TxnResponse>("Txn", [&](Member& m, grpc::ClientContext* c, pb::TxnResponse* r) {
      return m.kv->Txn(c, req, r);
    });
  }
  StatusOr<int64_t> Grant(int64_t ttl_s) override {
    pb::LeaseGrantRequest req;
    req.set_ttl(ttl_s);
    auto r = Call<pb::LeaseGrantResponse>("LeaseGrant", [&](Member& m, grpc::ClientContext* c, pb::LeaseGrantResponse* resp) {
      return m.lease->LeaseGrant(c, req, resp);
    });
    if (!r.ok()) return r.status();
    if (!r->error().empty()) return UnavailableError("etcd LeaseGrant: " + r->error());
    return r->id();
  }
  Status Revoke(int64_t id) override {
    pb::LeaseRevokeRequest req;
    req.set_id(id);
    return Call<pb::LeaseRevokeResponse>("LeaseRevoke", [&](Member& m, grpc::ClientContext* c, pb::LeaseRevokeResponse* r) {
             return m.lease->LeaseRevoke(c, req, r);
           }).status();
  }
  StatusOr<int64_t> KeepAlive(int64_t id) override {
    pb::LeaseKeepAliveRequest req;
    req.set_id(id);
    auto r = Call<pb::LeaseKeepAliveResponse>(
        "LeaseKeepAlive", [&](Member& m, grpc::ClientContext* c, pb::LeaseKeepAliveResponse* resp) {
          // One renewal per stream: a renewal every third of a TTL does not need a stream kept open.
          auto stream = m.lease->LeaseKeepAlive(c);
          if (!stream->Write(req) || !stream->Read(resp)) {
            stream->WritesDone();
            grpc::Status s = stream->Finish();
            return s.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "keepalive stream closed") : s;
          }
          stream->WritesDone();
          c->TryCancel();
          (void)stream->Finish();
          return grpc::Status::OK;
        });
    if (!r.ok()) return r.status();
    return std::max<int64_t>(0, r->ttl());
  }

  StatusOr<bool> WaitForChange(const std::string& key, int64_t after_revision, int timeout_ms) override {
    size_t m;
    {
      std::lock_guard<std::mutex> lock(mu_);
      m = current_;
    }
    WSYNC_ASSIGN_OR_RETURN(std::string token, Token(m, false));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
    if (!token.empty()) ctx.AddMetadata("token", token);
    // Without it a member cut off from the majority keeps the watch open, silent.
    ctx.AddMetadata("hasleader", "true");
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (waits_cancelled_) return false;
      waits_.insert(&ctx);
    }
    auto stream = members_[m].watch->Watch(&ctx);
    pb::WatchRequest req;
    req.mutable_create_request()->set_key(key);
    req.mutable_create_request()->set_start_revision(after_revision + 1);
    bool changed = false;
    pb::WatchResponse resp;
    if (stream->Write(req)) {
      while (stream->Read(&resp)) {
        if (resp.canceled()) break;
        if (resp.events_size() > 0) {
          changed = true;
          break;
        }
      }
    }
    ctx.TryCancel();
    grpc::Status s = stream->Finish();
    bool cancelled;
    {
      std::lock_guard<std::mutex> lock(mu_);
      waits_.erase(&ctx);
      cancelled = waits_cancelled_;
    }
    if (changed || cancelled || s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) return changed;
    if (resp.canceled()) {
      // Compacted past after_revision: the key may have changed; the caller reads it again.
      return resp.compact_revision() > 0 ? StatusOr<bool>(true)
                                         : StatusOr<bool>(UnavailableError("etcd Watch cancelled: " + resp.cancel_reason()));
    }
    return FromGrpc(s, "etcd Watch at " + options_.endpoints[m]);
  }

  void CancelWaits() override {
    std::lock_guard<std::mutex> lock(mu_);
    waits_cancelled_ = true;
    for (grpc::ClientContext* c : waits_) c->TryCancel();
  }

 private:
  struct Member {
    std::unique_ptr<pb::KV::Stub> kv;
    std::unique_ptr<pb::Lease::Stub> lease;
    std::unique_ptr<pb::Auth::Stub> auth;
    std::unique_ptr<pb::Watch::Stub> watch;
  };

  // A token for `m` (authenticating when there is none).
  StatusOr<std::string> Token(size_t member, bool renew) {
    std::lock_guard<std::mutex> lock(mu_);
    if (options_.user.empty()) return std::string();
    if (!token_.empty() && !renew) return token_;
    pb::AuthenticateRequest req;
    req.set_name(options_.user);
    req.set_password(options_.password);
    pb::AuthenticateResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(options_.timeout_ms));
    grpc::Status s = members_[member].auth->Authenticate(&ctx, req, &resp);
    if (!s.ok()) return FromGrpc(s, "etcd Authenticate as " + options_.user);
    token_ = resp.token();
    return token_;
  }

  template <typename R, typename F>
  StatusOr<R> Call(const char* method, F&& f) {
    size_t first;
    {
      std::lock_guard<std::mutex> lock(mu_);
      first = current_;
    }
    grpc::Status last;
    bool renewed = false;
    for (size_t tried = 0; tried < members_.size(); ++tried) {
      const size_t m = (first + tried) % members_.size();
      auto token = Token(m, false);
      if (!token.ok()) {
        last = grpc::Status(grpc::StatusCode::UNAVAILABLE, token.status().message());
        continue;
      }
      R resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(options_.timeout_ms));
      if (!token->empty()) ctx.AddMetadata("token", *token);
      last = f(members_[m], &ctx, &resp);
      if (last.ok()) {
        std::lock_guard<std::mutex> lock(mu_);
        current_ = m;
        return resp;
      }
      if (TokenExpired(last) && !options_.user.empty() && !renewed) {
        renewed = true;
        (void)Token(m, true);
        --tried;  // the same member again, with a new token
        continue;
      }
      if (!TryAnother(last)) break;
      spdlog::debug("etcd {} at {}: {}; trying the next member", method, options_.endpoints[m], last.error_message());
    }
    return FromGrpc(last, std::string("etcd ") + method);
  }

  EtcdOptions options_;
  std::vector<Member> members_;
  std::mutex mu_;
  size_t current_ = 0;
  std::string token_;
  std::set<grpc::ClientContext*> waits_;  // WaitForChange calls in flight
  bool waits_cancelled_ = false;
};

}  // namespace

std::string PrefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

StatusOr<std::unique_ptr<Etcd>> Etcd::Connect(const EtcdOptions& options) {
  if (options.endpoints.empty()) return InvalidArgumentError("no etcd endpoints (--etcd host:port,...)");
  WSYNC_ASSIGN_OR_RETURN(auto creds, ClientCredentials(options.ca_file, options.cert_file, options.key_file));
  grpc::ChannelArguments args;
  ReconnectQuickly(&args, 1000);
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (const auto& e : options.endpoints) {
    const std::string target = StripScheme(e);
    if (target.find(':') == std::string::npos) {
      return InvalidArgumentError("etcd endpoint '" + e + "' is not host:port");
    }
    channels.push_back(grpc::CreateCustomChannel(target, creds, args));
  }
  return std::unique_ptr<Etcd>(new GrpcEtcd(options, std::move(channels)));
}

}  // namespace wsync::control
