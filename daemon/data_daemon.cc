#include "data_daemon.h"

#include <sys/stat.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <limits>
#include <map>
#include <random>
#include <thread>
#include <utility>

#include "device_weights.h"
#include "wsync/exchange/exchange.h"
#include "sink_weights.h"
#include "version_history.h"
#include "wsync/buffers/device_region.h"
#include "wsync/buffers/region.h"
#include "wsync/buffers/safetensors.h"
#include "wsync/control/layout.h"
#include "wsync/util/text.h"
#include "wsync/util/thread_pool.h"
#include "wsync/v1/local.grpc.pb.h"

namespace wsync::daemon {
namespace {

namespace v1 = wsync::v1;
using exchange::ExchangeHandler;
using exchange::PatchFetcher;
using exchange::PatchServer;
using Clock = std::chrono::steady_clock;

grpc::Status ToGrpc(const Status& s) {
  return s.ok() ? grpc::Status::OK : grpc::Status(static_cast<grpc::StatusCode>(s.code()), s.message());
}

double MillisecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

constexpr int kMaxRegions = 1 << 16;

StatusOr<std::unique_ptr<buffers::Region>> OpenRegion(const std::string& shm, const std::string& ipc) {
  if (shm.empty() == ipc.empty()) return InvalidArgumentError("needs exactly one of shm_name and cuda_ipc_handle");
  if (!shm.empty()) return buffers::OpenShm(shm);
  return buffers::OpenCudaIpc(ipc);
}

// The memory and table of a RegisterTensors request, mapped and validated.
StatusOr<buffers::MappedTensors> OpenRegistered(const v1::RegisterTensorsRequest& req) {
  std::vector<buffers::TensorEntry> table;
  table.reserve(req.tensors_size());
  for (const auto& t : req.tensors()) {
    auto dtype = codec::ParseDType(t.dtype());
    if (!dtype.ok()) return dtype.status().WithContext("tensor " + Quoted(t.name()));
    table.push_back({t.name(), *dtype, {t.shape().begin(), t.shape().end()}, t.offset(), t.region()});
  }
  std::vector<std::unique_ptr<buffers::Region>> regions;
  if (req.regions_size() > 0) {
    if (!req.shm_name().empty() || !req.cuda_ipc_handle().empty()) {
      return InvalidArgumentError("RegisterTensors takes `regions` or the single-region shm_name / cuda_ipc_handle, "
                                  "not both");
    }
    if (req.regions_size() > kMaxRegions) {
      return InvalidArgumentError(std::to_string(req.regions_size()) + " regions: at most " +
                                  std::to_string(kMaxRegions));
    }
    for (int i = 0; i < req.regions_size(); ++i) {
      auto r = OpenRegion(req.regions(i).shm_name(), req.regions(i).cuda_ipc_handle());
      if (!r.ok()) return r.status().WithContext("region " + std::to_string(i));
      regions.push_back(std::move(*r));
    }
  } else {
    WSYNC_ASSIGN_OR_RETURN(auto r, OpenRegion(req.shm_name(), req.cuda_ipc_handle()));
    regions.push_back(std::move(r));
  }
  return buffers::MappedTensors::Create(std::move(regions), std::move(table));
}

// The layout of `tensors` as the coordinator records it; `published`: with
// the dtypes the source publishes (F32 as BF16).
v1::Layout LayoutOf(std::span<const codec::TensorView> tensors, bool published) {
  v1::Layout l;
  for (const auto& t : tensors) {
    auto* lt = l.add_tensors();
    lt->set_name(t.name);
    lt->set_dtype(std::string(codec::DTypeName(published ? buffers::PublishedDType(t.dtype) : t.dtype)));
    for (uint64_t d : t.shape) lt->add_shape(d);
  }
  return l;
}

// What source and sink share: the data-plane transport with its exchange,
// the coordinator registration and heartbeats, and the local API server.
class Node : public DataDaemon {
 public:
  explicit Node(DataDaemonConfig config, v1::Role role)
      : config_(std::move(config)), role_(role), pool_(config_.threads) {}

  ~Node() override { Shutdown(); }

  Status StartCommon(PatchProvider* provider, grpc::Service* local_service) {
    transport::TransportOptions to;
    to.listen = config_.listen;
    to.rate_limit_bytes_per_s = config_.rate_limit_bytes_per_s;
    to.corrupt_every = config_.corrupt_every;
    to.max_message_bytes = exchange::kMaxMessageBytes;
    if (config_.security.mode != exchange::SecurityMode::kNone) {
      to.max_untrusted_message_bytes = exchange::kMaxUntrustedMessageBytes;
    }
    WSYNC_ASSIGN_OR_RETURN(transport_, transport::CreateUcxTransport(to, &handler_));
    WSYNC_RETURN_IF_ERROR(handler_.Bind(transport_.get()));
    server_ = std::make_unique<PatchServer>(&handler_, provider);
    fetcher_ = std::make_unique<PatchFetcher>(&handler_);
    handler_.Attach(server_.get(), fetcher_.get());
    if (config_.security.mode == exchange::SecurityMode::kNone) {
      spdlog::warn("data plane without security: anyone who reaches {} can pull the weights (give the daemon the "
                   "cluster token: docs/security.md)",
                   transport_->LocalConnInfo());
    }
    control::ClientOptions co = config_.coordinator;
    co.wait_for_ready = true;
    WSYNC_ASSIGN_OR_RETURN(coordinator_, control::NewCoordinatorClient(co));
    WSYNC_RETURN_IF_ERROR(Register());

    ::unlink(config_.local_socket.c_str());
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + config_.local_socket, grpc::InsecureServerCredentials());
    builder.RegisterService(local_service);
    local_ = builder.BuildAndStart();
    if (!local_) return UnavailableError("cannot serve the local API on " + config_.local_socket);
    if (::chmod(config_.local_socket.c_str(), 0600) != 0) {
      return ErrnoToStatus(errno, "chmod 0600 " + config_.local_socket);
    }
    heartbeat_ = std::thread([this] { HeartbeatLoop(); });
    spdlog::info("{} {} up: data plane {} (security {}), local API unix:{}",
                 role_ == v1::ROLE_SOURCE ? "source" : "sink", config_.name, transport_->LocalConnInfo(),
                 exchange::SecurityModeName(config_.security.mode), config_.local_socket);
    return Status::Ok();
  }

  // Within a second, whatever the daemon is doing: calls to the coordinator
  // and pulls in flight are cancelled first, then the role's threads end (an
  // apply in progress completes; one not begun does not start).
  void Shutdown() override {
    if (stopping_.exchange(true)) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      wake_.notify_all();
    }
    if (coordinator_) coordinator_->Cancel();
    if (fetcher_) fetcher_->FailAll(AbortedError("the daemon is shutting down"));
    StopRole();
    if (heartbeat_.joinable()) heartbeat_.join();
    if (local_) local_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    if (coordinator_) (void)coordinator_->Deregister(config_.name);
    handler_.Detach();
    server_.reset();
    fetcher_.reset();
    transport_.reset();
    ::unlink(config_.local_socket.c_str());
  }

  void Wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    wake_.wait(lock, [&] { return stopping_.load(); });
  }

 protected:
  virtual void StopRole() {}
  virtual void OnHeartbeat(const v1::HeartbeatResponse&) {}
  virtual void FillHeartbeat(v1::HeartbeatRequest*) {}
  // After every (re)registration with the coordinator.
  virtual void AfterRegister(const v1::Node&) {}

  Status Register() {
    v1::RegisterRequest r;
    r.set_name(config_.name);
    r.set_role(role_);
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    r.set_host(host);
    r.set_data_address(transport_->LocalConnInfo());
    r.set_ttl_ms(config_.node_ttl_ms);
    WSYNC_ASSIGN_OR_RETURN(auto resp, coordinator_->Register(r));
    incarnation_ = resp.node().incarnation();
    AfterRegister(resp.node());
    return Status::Ok();
  }

  // Sleeps up to `d`; false once the daemon is stopping.
  bool SleepFor(std::chrono::milliseconds d) {
    std::unique_lock<std::mutex> lock(mu_);
    return !wake_.wait_for(lock, d, [&] { return stopping_.load(); });
  }

  void HeartbeatLoop() {
    while (!stopping_) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        heartbeat_in_flight_ = true;
      }
      v1::HeartbeatRequest h;
      h.set_name(config_.name);
      h.set_incarnation(incarnation_);
      FillHeartbeat(&h);
      auto resp = coordinator_->Heartbeat(h);
      if (resp.ok()) {
        OnHeartbeat(*resp);
      } else if (resp.status().code() == StatusCode::kNotFound || resp.status().code() == StatusCode::kAborted) {
        spdlog::warn("{}: {}; registering again", config_.name, resp.status().ToString());
        Status s = Register();
        if (!s.ok()) spdlog::warn("{}: register: {}", config_.name, s.ToString());
      } else if (!stopping_) {
        spdlog::warn("{}: heartbeat: {}", config_.name, resp.status().ToString());
      }
      std::unique_lock<std::mutex> lock(mu_);
      ++heartbeat_rounds_;
      heartbeat_in_flight_ = false;
      wake_.notify_all();
      wake_.wait_for(lock, std::chrono::milliseconds(config_.node_ttl_ms / 4),
                     [&] { return stopping_.load() || heartbeat_now_; });
      heartbeat_now_ = false;
    }
  }

  // Heartbeats now (registering again if the coordinator marked this node
  // dead) and waits up to `timeout` for that round to finish.
  void HeartbeatNow(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    // A round in flight may have been sent before the request: wait for the next.
    const uint64_t done = heartbeat_rounds_ + (heartbeat_in_flight_ ? 2 : 1);
    heartbeat_now_ = true;
    wake_.notify_all();
    wake_.wait_for(lock, timeout, [&] { return stopping_.load() || heartbeat_rounds_ >= done; });
  }

  DataDaemonConfig config_;
  v1::Role role_;
  ThreadPool pool_;
  ExchangeHandler handler_{config_.security};
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<PatchServer> server_;
  std::unique_ptr<PatchFetcher> fetcher_;
  std::unique_ptr<control::CoordinatorClient> coordinator_;
  std::unique_ptr<grpc::Server> local_;
  std::thread heartbeat_;
  std::atomic<uint64_t> incarnation_{0};
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::condition_variable wake_;
  uint64_t heartbeat_rounds_ = 0;     // under mu_
  bool heartbeat_now_ = false;        // under mu_
  bool heartbeat_in_flight_ = false;  // under mu_
};

// ------------------------------------------------------------------ source

class Source : public Node, public v1::Local::Service {
 public:
  explicit Source(DataDaemonConfig config)
      : Node(std::move(config), v1::ROLE_SOURCE), history_([this] {
          VersionHistory::Options o;
          o.encode.pool = &pool_;
          return o;
        }()) {}

  // Stops here, while the members StopRole joins are alive.
  ~Source() override { Shutdown(); }

  wsync::Status Start() { return StartCommon(&history_, this); }

  grpc::Status RegisterTensors(grpc::ServerContext*, const v1::RegisterTensorsRequest* req,
                               v1::RegisterTensorsResponse* resp) override {
    auto reg = OpenRegistered(*req);
    if (!reg.ok()) return ToGrpc(reg.status());
    const auto views = reg->Views();
    const v1::Layout layout = LayoutOf(views, /*published=*/true);
    // The layout is the coordinator's, also across restarts of this source.
    auto published = coordinator_->GetLayout();
    if (published.ok() && published->set()) {
      if (auto s = control::CheckLayout(published->layout(), layout, "the registered tensors"); !s.ok()) {
        return ToGrpc(s);
      }
    } else if (!published.ok()) {
      spdlog::warn("source {}: layout not checked at registration (checked at the first publish): {}", config_.name,
                   published.status().ToString());
    }
    // Wait for a background publish (it reads the source's copy, not the
    // registered memory, but uses the table); its outcome is the next
    // Publish's to report.
    std::lock_guard<std::mutex> publishing(publish_mu_);
    WaitBackground();
    std::lock_guard<std::mutex> lock(state_mu_);
    const bool keep = reg->on_device() && device_ && device_->Matches(views, reg->device());
    if (device_ && !keep) {
      // The device state goes: the history's head copy must not depend on it.
      wsync::Status s = history_.MaterializeHead();
      if (!s.ok()) return ToGrpc(s);
      device_.reset();
    }
    if (reg->on_device() && !device_) {
      auto d = DeviceSource::Create(views, reg->device());
      if (!d.ok()) return ToGrpc(d.status());
      device_ = std::move(*d);
    }
    cast_ = false;
    for (const auto& t : views) {
      if (buffers::PublishedDType(t.dtype) == t.dtype) continue;
      cast_ = true;
      resp->add_cast_to_bf16(t.name);
    }
    tensors_ = std::make_unique<buffers::MappedTensors>(std::move(*reg));
    layout_ = layout;
    layout_set_ = published.ok() && published->set();
    const uint64_t head = std::max(history_.head(), coordinator_head_.load());
    resp->set_head_version(head);
    resp->set_next_version(head + 1);
    spdlog::info("source {}: {} registered{}", config_.name, tensors_->description(),
                 cast_ ? " (" + std::to_string(resp->cast_to_bf16_size()) + " F32 tensors published as BF16)" : "");
    return grpc::Status::OK;
  }

  grpc::Status Unregister(grpc::ServerContext*, const v1::UnregisterRequest*, v1::UnregisterResponse*) override {
    std::lock_guard<std::mutex> publishing(publish_mu_);
    WaitBackground();
    std::lock_guard<std::mutex> lock(state_mu_);
    if (!tensors_) return ToGrpc(FailedPreconditionError("no tensors registered"));
    if (device_) {
      if (wsync::Status s = history_.MaterializeHead(); !s.ok()) return ToGrpc(s);
      device_.reset();
    }
    tensors_.reset();
    spdlog::info("source {}: tensors unregistered", config_.name);
    return grpc::Status::OK;
  }

  grpc::Status Publish(grpc::ServerContext*, const v1::LocalPublishRequest* req,
                       v1::LocalPublishResponse* resp) override {
    const auto entered = Clock::now();
    // Publishes are serialized; the registration lock is taken only for the
    // snapshot, so waiting on the staleness policy blocks nothing else.
    std::lock_guard<std::mutex> publishing(publish_mu_);
    // Once StopRole has joined the background publisher, none may start.
    if (stopping_) return ToGrpc(UnavailableError("the source is shutting down"));
    // A version copied by an earlier Publish is announced first.
    if (wsync::Status s = JoinBackground(); !s.ok()) return ToGrpc(s);
    v1::Layout layout;
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      if (!tensors_) return ToGrpc(FailedPreconditionError("no tensors registered"));
      layout = layout_;
    }
    if (head_pub_.version != 0 && req->version() == head_pub_.version && !head_announced_) {
      // The version is encoded, but the coordinator did not confirm it. The
      // same weights again are a retry: announce it now. Other weights (the
      // trainer stepped on) must not pass as this version.
      auto same = HeadHoldsTheRegisteredWeights();
      if (!same.ok()) return ToGrpc(same.status());
      if (!*same) {
        return ToGrpc(FailedPreconditionError(
            "version " + std::to_string(req->version()) + " was encoded from other weights and its announce failed; "
            "it cannot be published again with these: the next valid version is " +
            std::to_string(req->version() + 1)));
      }
      if (wsync::Status s = Announce(head_pub_, 0); !s.ok()) return ToGrpc(s);
      head_announced_ = true;
      FillResponse(head_pub_, resp);
      resp->set_server_ms(MillisecondsSince(entered));
      return grpc::Status::OK;
    }
    if (wsync::Status s = CheckVersion(req->version()); !s.ok()) return ToGrpc(s);
    if (!layout_set_) {
      // The first publish of this registration fixes (or checks) the layout.
      layout.set_source(config_.name);
      if (wsync::Status s = coordinator_->SetLayout(layout); !s.ok()) return ToGrpc(s);
      layout_set_ = true;
    }
    auto may = coordinator_->MayPublish(req->version(), req->wait_ms());
    if (!may.ok()) return ToGrpc(may.status());
    if (!may->allowed()) {
      return ToGrpc(AbortedError("version " + std::to_string(req->version()) + " is held back by the staleness bound" +
                                 (req->wait_ms() > 0 ? " after waiting " + std::to_string(req->wait_ms()) + " ms" : "") +
                                 "; lagging sinks: " + DescribeLagging(*may)));
    }
    const auto t0 = Clock::now();
    StatusOr<PublishedVersion> pub = UnavailableError("not published");
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      const auto views = tensors_->Views();
      if ((req->return_after_copy() || cast_) && !device_) {
        // The source's own copy: taken (and cast) now, encoded from it.
        if (wsync::Status s = history_.Accepts(req->version(), LayoutViews(views)); !s.ok()) return ToGrpc(s);
        if (wsync::Status s = CopyToSnapshot(views); !s.ok()) return ToGrpc(s);
        if (req->return_after_copy()) {
          resp->set_version(req->version());
          resp->set_base_version(history_.head());
          for (const auto& t : snapshot_) resp->set_dense_bytes(resp->dense_bytes() + t.bytes.size());
          resp->set_pending(true);
          resp->set_copy_ms(MillisecondsSince(t0));
          resp->set_server_ms(MillisecondsSince(entered));
          publisher_ = std::thread([this, version = req->version(), t0] {
            auto published = history_.Publish(version, &snapshot_);
            if (published.ok()) {
              head_pub_ = *published;
              head_announced_ = false;
            }
            wsync::Status s = published.ok() ? Announce(*published, MillisecondsSince(t0)) : published.status();
            if (published.ok() && s.ok()) head_announced_ = true;
            if (!s.ok()) {
              s = s.WithContext("version " + std::to_string(version) + ", copied and published in the background");
              spdlog::error("source {}: {}", config_.name, s.ToString());
            }
            background_status_ = std::move(s);
          });
          return grpc::Status::OK;
        }
        pub = history_.Publish(req->version(), &snapshot_);
      } else {
        pub = device_ ? history_.Publish(req->version(), device_->Next(views)) : history_.Publish(req->version(), views);
      }
    }
    if (!pub.ok()) return ToGrpc(pub.status());
    head_pub_ = *pub;
    head_announced_ = false;
    const double ms = MillisecondsSince(t0);
    if (wsync::Status s = Announce(*pub, ms); !s.ok()) return ToGrpc(s);
    head_announced_ = true;
    FillResponse(*pub, resp);
    resp->set_encode_ms(ms);
    resp->set_server_ms(MillisecondsSince(entered));
    return grpc::Status::OK;
  }

  grpc::Status Status(grpc::ServerContext*, const v1::LocalStatusRequest*, v1::LocalStatusResponse* resp) override {
    std::lock_guard<std::mutex> lock(state_mu_);
    resp->set_role("source");
    resp->set_name(config_.name);
    resp->set_version(history_.head());
    resp->set_head_version(std::max(history_.head(), coordinator_head_.load()));
    resp->set_tensors(tensors_ ? tensors_->table().size() : 0);
    resp->set_bytes_served(Node::server_ ? Node::server_->bytes_served() : 0);
    resp->set_pulls_served(Node::server_ ? Node::server_->pulls_served() : 0);
    return grpc::Status::OK;
  }

 protected:
  void StopRole() override {
    std::lock_guard<std::mutex> publishing(publish_mu_);
    (void)JoinBackground();
  }

  void OnHeartbeat(const v1::HeartbeatResponse& hb) override {
    coordinator_head_ = std::max(coordinator_head_.load(), hb.head_version());
    // Keep what leased or live sinks need, and at least the last
    // retain_versions versions: a sink that restarts reports nothing until
    // its server registers its buffers again, and should still catch up
    // with one merged patch rather than a keyframe.
    auto status = coordinator_->GetStatus();
    if (!status.ok()) return;
    const uint64_t head = history_.head();
    const uint64_t window = head > config_.retain_versions ? head - config_.retain_versions : 0;
    uint64_t needed = status->oldest_needed_version() ? status->oldest_needed_version() : head;
    needed = std::max<uint64_t>(std::min(needed, window), 1);
    wsync::Status s = history_.Retain(needed);
    if (!s.ok()) spdlog::warn("source {}: retain: {}", config_.name, s.ToString());
  }

 private:
  // Names, published dtypes and shapes of `views` (data unused), for
  // VersionHistory::Accepts.
  static std::vector<codec::TensorView> LayoutViews(std::span<const codec::TensorView> views) {
    std::vector<codec::TensorView> out(views.begin(), views.end());
    for (auto& t : out) t.dtype = buffers::PublishedDType(t.dtype);
    return out;
  }

  // Whether the registered weights, as they would be published now (F32
  // cast), are the encoded head's (its set checksum). REQUIRES: publish_mu_.
  StatusOr<bool> HeadHoldsTheRegisteredWeights() {
    std::lock_guard<std::mutex> lock(state_mu_);
    const auto views = tensors_->Views();
    if (device_) {
      if (cast_) return false;  // no device checksum of the cast: treated as other weights
      WSYNC_ASSIGN_OR_RETURN(uint64_t sum, TensorsSetChecksum(*tensors_, &pool_));
      return sum == head_pub_.set_checksum;
    }
    if (!cast_) return codec::SetChecksum(views, &pool_) == head_pub_.set_checksum;
    // snapshot_ is scratch between publishes (the previous head's buffers).
    WSYNC_RETURN_IF_ERROR(CopyToSnapshot(views));
    return codec::SetChecksum(buffers::Views(snapshot_), &pool_) == head_pub_.set_checksum;
  }

  // Copies (and casts) `views` into snapshot_, reallocating it when its
  // layout is not theirs. REQUIRES: publish_mu_ and state_mu_ held.
  wsync::Status CopyToSnapshot(std::span<const codec::TensorView> views) {
    if (buffers::CopyInto(views, snapshot_, &copy_pool_).ok()) return wsync::Status::Ok();
    snapshot_ = buffers::PublishedCopy(views);
    return buffers::CopyInto(views, snapshot_, &copy_pool_);
  }

  static void FillResponse(const PublishedVersion& pub, v1::LocalPublishResponse* resp) {
    resp->set_version(pub.version);
    resp->set_base_version(pub.base_version);
    resp->set_patch_bytes(pub.patch_bytes);
    resp->set_dense_bytes(pub.dense_bytes);
  }

  // A version must be above every version the coordinator acknowledged,
  // also those published before this source restarted.
  wsync::Status CheckVersion(uint64_t version) {
    auto versions = coordinator_->ListVersions(std::numeric_limits<uint64_t>::max());
    if (!versions.ok()) return versions.status().WithContext("reading the head version");
    coordinator_head_ = std::max(coordinator_head_.load(), versions->head_version());
    const uint64_t head = std::max(history_.head(), coordinator_head_.load());
    if (version > head) return wsync::Status::Ok();
    return FailedPreconditionError("version " + std::to_string(version) + " is not above the head version " +
                                   std::to_string(head) + "; the next valid version is " + std::to_string(head + 1));
  }

  // "rollout-1 at version 3 of 9: 1 hold active for 42.0 s, ..." for the
  // sinks a MayPublish named.
  std::string DescribeLagging(const v1::MayPublishResponse& may) {
    auto status = coordinator_->GetStatus();
    std::string out;
    for (const auto& name : may.blocking()) {
      if (!out.empty()) out += "; ";
      out += Quoted(name);
      if (!status.ok()) continue;
      for (const auto& n : status->nodes()) {
        if (n.name() != name) continue;
        out += " at version " + std::to_string(n.applied_version()) + " of " + std::to_string(status->head_version());
        if (n.active_holds() > 0) {
          char held[64];
          std::snprintf(held, sizeof(held), "%.1f", static_cast<double>(n.oldest_hold_ms()) / 1000.0);
          out += ": " + std::to_string(n.active_holds()) + " hold(s) active, the oldest for " + held +
                 " s (a sink applies only when no hold is active)";
        }
        if (!n.sync_error().empty()) out += ": cannot sync: " + n.sync_error();
        if (n.active_holds() == 0 && n.sync_error().empty()) out += ": syncing";
      }
    }
    return out;
  }

  // Tells the coordinator of a version the history holds (`ms`: since the
  // publish began, for the log).
  wsync::Status Announce(const PublishedVersion& pub, double ms) {
    if (pub.version == config_.fail_announce) {
      return UnavailableError("announcing version " + std::to_string(pub.version) + ": injected failure");
    }
    v1::VersionSummary v;
    v.set_version(pub.version);
    v.set_base_version(pub.base_version);
    v.set_patch_bytes(pub.patch_bytes);
    v.set_dense_bytes(pub.dense_bytes);
    v.set_set_checksum(pub.set_checksum);
    v.set_keyframe(pub.base_version == 0);
    v.set_source(config_.name);
    // A lost answer is retried (the coordinator takes the same summary
    // again as a success), a bounded number of times.
    StatusOr<uint64_t> head = UnavailableError("not announced");
    for (int attempt = 0; attempt < 4; ++attempt) {
      if (attempt > 0 && !SleepFor(std::chrono::milliseconds(250 << attempt))) break;
      head = coordinator_->Publish(v);
      if (head.ok() || (head.status().code() != StatusCode::kUnavailable &&
                        head.status().code() != StatusCode::kDeadlineExceeded)) {
        break;
      }
      spdlog::warn("source {}: announcing version {}: {} (attempt {} of 4)", config_.name, pub.version,
                   head.status().ToString(), attempt + 1);
    }
    if (!head.ok()) {
      return head.status().WithContext("version " + std::to_string(pub.version) +
                                       " is encoded, but the coordinator did not confirm it (it may have stored it: "
                                       "`wsync versions` shows it if so)");
    }
    coordinator_head_ = std::max(coordinator_head_.load(), *head);
    spdlog::info("source {}: version {} published: {} patch bytes for {} dense ({:.1f}x), encoded in {:.1f} ms",
                 config_.name, pub.version, pub.patch_bytes, pub.dense_bytes,
                 pub.patch_bytes ? static_cast<double>(pub.dense_bytes) / pub.patch_bytes : 0.0, ms);
    return wsync::Status::Ok();
  }

  // Waits for a version being published in the background; returns (once)
  // what became of it. REQUIRES: publish_mu_ held.
  wsync::Status JoinBackground() {
    WaitBackground();
    return std::exchange(background_status_, wsync::Status::Ok());
  }
  // Waits for it, leaving its outcome to JoinBackground. REQUIRES: publish_mu_ held.
  void WaitBackground() {
    if (publisher_.joinable()) publisher_.join();
  }

  VersionHistory history_;
  std::mutex publish_mu_;  // one Publish at a time
  // Copies the source takes itself (return-after-copy publishes, and F32
  // tensors cast to BF16): the copy of the version being published (in the
  // background, or now), afterwards the previous head's buffers for the
  // next copy; the thread publishing it and its outcome (all under
  // publish_mu_).
  std::vector<buffers::OwnedTensor> snapshot_;
  std::thread publisher_;
  wsync::Status background_status_;
  bool layout_set_ = false;  // the coordinator holds layout_ (under publish_mu_)
  // The last version this source encoded, and whether the coordinator
  // confirmed it (under publish_mu_; written by the background publisher
  // before JoinBackground returns).
  PublishedVersion head_pub_;
  bool head_announced_ = false;
  // The copy's own threads: the codec's pool may be busy serving a merge.
  ThreadPool copy_pool_{config_.threads};
  std::mutex state_mu_;  // tensors_, layout_, cast_, device_
  std::unique_ptr<buffers::MappedTensors> tensors_;
  v1::Layout layout_;    // published layout of tensors_
  bool cast_ = false;    // some of tensors_ are F32, published as BF16
  std::unique_ptr<DeviceSource> device_;  // set for device memory
  std::atomic<uint64_t> coordinator_head_{0};
};

// -------------------------------------------------------------------- sink

class Sink : public Node, public v1::Local::Service, public PatchProvider {
 public:
  explicit Sink(DataDaemonConfig config) : Node(std::move(config), v1::ROLE_SINK), rng_(std::random_device{}()) {}
  // Stops here, while the threads StopRole joins are alive.
  ~Sink() override { Shutdown(); }

  wsync::Status Start() {
    WSYNC_RETURN_IF_ERROR(StartCommon(this, this));
    watcher_ = std::thread([this] { WatchLoop(); });
    syncer_ = std::thread([this] { SyncLoop(); });
    leaser_ = std::thread([this] { LeaseLoop(); });
    return Status::Ok();
  }

  // --- PatchProvider: what this sink can serve its children.
  StatusOr<std::shared_ptr<PatchStream>> Open(uint64_t from, uint64_t to) override {
    std::shared_ptr<SinkWeights> weights;
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      if (auto it = streams_.find({from, to}); it != streams_.end()) return it->second;
      weights = weights_;
    }
    if (!weights || weights->applied() != to || to == 0) {
      return NotFoundError("sink " + config_.name + " holds no patch " + std::to_string(from) + "->" +
                           std::to_string(to));
    }
    // A keyframe of what it holds (the child had another base).
    const uint64_t v = weights->Hold();
    codec::EncodeOptions eo;
    eo.pool = &pool_;
    eo.target_version = v;
    StatusOr<std::string> kf = UnavailableError("no keyframe");
    if (weights->on_device()) {
      auto host = weights->HostCopy();
      kf = host.ok() ? codec::EncodeKeyframe(buffers::Views(*host), eo) : StatusOr<std::string>(host.status());
    } else {
      kf = codec::EncodeKeyframe(weights->Views(), eo);
    }
    weights->Release();
    if (!kf.ok()) return kf.status();
    auto stream = PatchStream::FromBytes(codec::PatchKind::kKeyframe, 0, v, std::move(*kf), 1u << 20);
    std::lock_guard<std::mutex> lock(state_mu_);
    streams_[{0, v}] = stream;
    return stream;
  }

  // --- Local API.
  grpc::Status RegisterTensors(grpc::ServerContext*, const v1::RegisterTensorsRequest* req,
                               v1::RegisterTensorsResponse* resp) override {
    auto reg = OpenRegistered(*req);
    if (!reg.ok()) return ToGrpc(reg.status());
    // Refused at once when the tensors cannot take the versions published.
    if (auto s = CheckPublishedLayout(reg->Views()); !s.ok()) {
      spdlog::warn("sink {}: registration refused: {}", config_.name, s.ToString());
      return ToGrpc(s);
    }
    // Trust a claimed version only if the tensors' checksum is that version's
    // (a sink that died mid-apply leaves torn weights: those get a keyframe).
    uint64_t applied = req->applied_version();
    if (applied != 0) {
      auto versions = coordinator_->ListVersions(applied - 1);
      auto sum = TensorsSetChecksum(*reg, &pool_);
      const bool match = versions.ok() && versions->versions_size() > 0 && versions->versions(0).version() == applied &&
                         sum.ok() && versions->versions(0).set_checksum() == *sum;
      if (!match) {
        spdlog::warn("sink {}: the registered tensors are not version {} (checksum differs): starting from a keyframe",
                     config_.name, applied);
        applied = 0;
      }
    }
    std::unique_ptr<cuda::DeviceCodec> device;
    if (reg->on_device()) {
      auto dc = cuda::DeviceCodec::Create(reg->device());
      if (!dc.ok()) return ToGrpc(dc.status());
      device = std::move(*dc);
    }
    const std::string description = reg->description();
    std::shared_ptr<SinkWeights> old;
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      old = std::exchange(weights_, std::make_shared<SinkWeights>(std::move(*reg), &pool_, applied, std::move(device)));
    }
    // The caller may reuse or free the old memory from now on.
    if (old) Retire(old, "the tensors were registered again");
    ResetBackoff();
    // What the coordinator shows is what these tensors hold.
    if (auto n = coordinator_->ReportApplied(config_.name, applied); !n.ok()) {
      spdlog::warn("sink {}: report: {}", config_.name, n.status().ToString());
    }
    spdlog::info("sink {}: {} registered (holding version {})", config_.name, description, applied);
    resp->set_head_version(head_.load());
    Kick();
    return grpc::Status::OK;
  }

  grpc::Status Unregister(grpc::ServerContext*, const v1::UnregisterRequest*, v1::UnregisterResponse*) override {
    std::shared_ptr<SinkWeights> old;
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      old = std::exchange(weights_, nullptr);
    }
    if (!old) return ToGrpc(FailedPreconditionError("no tensors registered"));
    Retire(old, "the tensors were unregistered");
    if (auto n = coordinator_->ReportApplied(config_.name, 0); !n.ok()) {
      spdlog::warn("sink {}: report: {}", config_.name, n.status().ToString());
    }
    spdlog::info("sink {}: tensors unregistered", config_.name);
    return grpc::Status::OK;
  }

  grpc::Status WaitForVersion(grpc::ServerContext*, const v1::WaitForVersionRequest* req,
                              v1::WaitForVersionResponse* resp) override {
    auto w = weights();
    if (!w) return ToGrpc(FailedPreconditionError("no tensors registered"));
    wsync::Status s = w->WaitForVersion(req->version(), Clock::now() + std::chrono::milliseconds(req->timeout_ms()));
    resp->set_applied_version(w->applied());
    return ToGrpc(s);
  }

  grpc::Status Hold(grpc::ServerContext* ctx, const v1::HoldRequest* req,
                    grpc::ServerWriter<v1::HoldResponse>* writer) override {
    auto w = weights();
    if (!w) return ToGrpc(FailedPreconditionError("no tensors registered"));
    const int64_t ttl_ms = req->ttl_ms() > 0 ? req->ttl_ms() : static_cast<int64_t>(config_.hold_ttl_ms);
    if (ttl_ms > 600'000) return ToGrpc(InvalidArgumentError("hold TTL above 600000 ms"));
    const uint64_t version = w->Hold();  // waits for an apply in progress
    uint64_t id;
    {
      std::lock_guard<std::mutex> lock(holds_mu_);
      id = next_hold_++;
      HoldState& h = holds_[id];
      h.weights = w;
      h.version = version;
      h.holder = req->holder().substr(0, 200);
      h.since = Clock::now();
      h.expires = h.since + std::chrono::milliseconds(ttl_ms);
      h.ttl_ms = ttl_ms;
      holds_cv_.notify_all();  // the lease loop mirrors it
    }
    v1::HoldResponse r;
    r.set_version(version);
    r.set_hold_id(id);
    r.set_ttl_ms(ttl_ms);
    std::string why = "released";
    if (writer->Write(r)) {
      // The call stays open while the hold lasts.
      std::unique_lock<std::mutex> lock(holds_mu_);
      for (;;) {
        auto it = holds_.find(id);
        if (it == holds_.end()) return grpc::Status::OK;  // released by id or retired
        if (ctx->IsCancelled()) {
          why = "the holder cancelled the call or its connection closed";
          break;
        }
        if (Clock::now() >= it->second.expires) {
          why = "not renewed within its TTL of " + std::to_string(ttl_ms) + " ms";
          break;
        }
        if (stopping_) {
          why = "the sink is shutting down";
          break;
        }
        holds_cv_.wait_for(lock, std::chrono::milliseconds(20));
      }
    } else {
      why = "the holder went away before the hold was granted";
    }
    EndHold(id, why);
    return grpc::Status::OK;
  }

  grpc::Status RenewHold(grpc::ServerContext*, const v1::RenewHoldRequest* req, v1::RenewHoldResponse*) override {
    std::lock_guard<std::mutex> lock(holds_mu_);
    auto it = holds_.find(req->hold_id());
    if (it == holds_.end()) return ToGrpc(NotFoundError(HoldGone(req->hold_id())));
    it->second.expires = Clock::now() + std::chrono::milliseconds(it->second.ttl_ms);
    return grpc::Status::OK;
  }

  grpc::Status Release(grpc::ServerContext*, const v1::ReleaseRequest* req, v1::ReleaseResponse*) override {
    if (!EndHold(req->hold_id(), "released")) return ToGrpc(NotFoundError(HoldGone(req->hold_id())));
    return grpc::Status::OK;
  }

  grpc::Status Dump(grpc::ServerContext*, const v1::DumpRequest* req, v1::DumpResponse* resp) override {
    auto w = weights();
    if (!w) return ToGrpc(FailedPreconditionError("no tensors registered"));
    if (req->version() > 0) {
      wsync::Status s = w->WaitForVersion(req->version(), Clock::now() + std::chrono::milliseconds(req->timeout_ms()));
      if (!s.ok()) return ToGrpc(s);
    }
    const uint64_t v = w->Hold();
    wsync::Status s;
    if (w->on_device()) {
      auto host = w->HostCopy();
      s = host.ok() ? buffers::WriteSafetensors(req->path(), buffers::Views(*host), {{"wsync_version", std::to_string(v)}})
                    : host.status();
    } else {
      s = buffers::WriteSafetensors(req->path(), w->Views(), {{"wsync_version", std::to_string(v)}});
    }
    w->Release();
    resp->set_version(v);
    return ToGrpc(s);
  }

  grpc::Status Status(grpc::ServerContext*, const v1::LocalStatusRequest*, v1::LocalStatusResponse* resp) override {
    auto w = weights();
    resp->set_role("sink");
    resp->set_name(config_.name);
    resp->set_version(w ? w->applied() : 0);
    resp->set_head_version(head_.load());
    resp->set_tensors(w ? w->Views().size() : 0);
    resp->set_bytes_served(Node::server_ ? Node::server_->bytes_served() : 0);
    resp->set_pulls_served(Node::server_ ? Node::server_->pulls_served() : 0);
    resp->set_pulls_made(pulls_made_.load());
    resp->set_sync_failures(failures_.load());
    if (w && !w->sync_error().ok()) resp->set_sync_error(w->sync_error().ToString());
    const auto [holds, oldest_ms] = HoldSummary();
    resp->set_active_holds(holds);
    resp->set_oldest_hold_ms(oldest_ms);
    return grpc::Status::OK;
  }

 protected:
  void StopRole() override {
    // An apply in progress completes; none starts after this.
    if (auto w = weights()) w->Close();
    {
      std::lock_guard<std::mutex> lock(holds_mu_);
      holds_cv_.notify_all();
    }
    ResetBackoff();
    Kick();
    if (watcher_.joinable()) watcher_.join();
    if (syncer_.joinable()) syncer_.join();
    if (leaser_.joinable()) leaser_.join();
  }

  void OnHeartbeat(const v1::HeartbeatResponse& hb) override {
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      if (parent_ != hb.node().parent()) ResetBackoffSoon();
      parent_ = hb.node().parent();
      resync_ = hb.node().resync_keyframe();
    }
    head_ = std::max(head_.load(), hb.head_version());
    Kick();
  }

  // The coordinator remembers the applied version of an earlier process of
  // this name: what it shows must be what this one holds.
  void AfterRegister(const v1::Node& node) override {
    const auto w = weights();
    const uint64_t applied = w ? w->applied() : 0;
    if (node.applied_version() == applied) return;
    if (auto n = coordinator_->ReportApplied(config_.name, applied); !n.ok()) {
      spdlog::warn("sink {}: report: {}", config_.name, n.status().ToString());
    }
  }

  void FillHeartbeat(v1::HeartbeatRequest* h) override {
    if (auto w = weights(); w && !w->sync_error().ok()) h->set_sync_error(w->sync_error().ToString());
    const auto [holds, oldest_ms] = HoldSummary();
    h->set_active_holds(holds);
    h->set_oldest_hold_ms(oldest_ms);
  }

 private:
  struct HoldState {
    std::shared_ptr<SinkWeights> weights;
    uint64_t version = 0;
    std::string holder;
    Clock::time_point since, expires;
    int64_t ttl_ms = 0;
    uint64_t lease_id = 0;  // the coordinator lease mirroring it (0: none yet)
    Clock::time_point lease_renewed;
  };

  std::shared_ptr<SinkWeights> weights() {
    std::lock_guard<std::mutex> lock(state_mu_);
    return weights_;
  }

  void Kick() {
    std::lock_guard<std::mutex> lock(sync_mu_);
    kicked_ = true;
    sync_cv_.notify_all();
  }

  static std::string HoldGone(uint64_t id) {
    return "hold " + std::to_string(id) + " is not held (released, not renewed within its TTL, its connection "
           "closed, or the tensors were registered again)";
  }

  // Ends hold `id` (releasing the weights); false if it is not held.
  bool EndHold(uint64_t id, const std::string& why) {
    std::lock_guard<std::mutex> lock(holds_mu_);
    auto it = holds_.find(id);
    if (it == holds_.end()) return false;
    it->second.weights->Release();
    if (it->second.lease_id != 0) leases_to_release_.push_back(it->second.lease_id);
    const double held_s = std::chrono::duration<double>(Clock::now() - it->second.since).count();
    if (why == "released") {
      spdlog::debug("sink {}: hold {} released after {:.3f} s", config_.name, id, held_s);
    } else {
      spdlog::warn("sink {}: hold {} of {} ended after {:.1f} s: {}", config_.name, id,
                   it->second.holder.empty() ? "a holder" : Quoted(it->second.holder), held_s, why);
    }
    holds_.erase(it);
    holds_cv_.notify_all();
    return true;
  }

  // Ends every hold on `old`, then closes it (an apply into it completes).
  void Retire(const std::shared_ptr<SinkWeights>& old, const std::string& why) {
    std::vector<uint64_t> ids;
    {
      std::lock_guard<std::mutex> lock(holds_mu_);
      for (const auto& [id, h] : holds_) {
        if (h.weights == old) ids.push_back(id);
      }
    }
    for (uint64_t id : ids) EndHold(id, why);
    old->Close();
  }

  std::pair<uint32_t, int64_t> HoldSummary() {
    std::lock_guard<std::mutex> lock(holds_mu_);
    int64_t oldest = 0;
    for (const auto& [id, h] : holds_) {
      oldest = std::max<int64_t>(oldest, std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - h.since).count());
    }
    return {static_cast<uint32_t>(holds_.size()), oldest};
  }

  // Mirrors the active holds as coordinator leases (`wsync leases`; the
  // source keeps what leased versions need), renewed at a third of their TTL.
  void LeaseLoop() {
    std::unique_lock<std::mutex> lock(holds_mu_);
    while (!stopping_) {
      holds_cv_.wait_for(lock, std::chrono::milliseconds(500));
      std::vector<uint64_t> release = std::move(leases_to_release_);
      leases_to_release_.clear();
      struct Renewal {
        uint64_t hold, lease, version;
        int64_t ttl_ms;
      };
      std::vector<Renewal> due;
      const auto now = Clock::now();
      for (const auto& [id, h] : holds_) {
        if (h.lease_id == 0 || now - h.lease_renewed >= std::chrono::milliseconds(h.ttl_ms / 3)) {
          due.push_back({id, h.lease_id, h.version, h.ttl_ms});
        }
      }
      if (release.empty() && due.empty()) continue;
      lock.unlock();
      for (uint64_t lease : release) (void)coordinator_->ReleaseLease(lease);
      std::vector<std::pair<uint64_t, uint64_t>> granted;  // hold, lease
      for (const auto& d : due) {
        auto l = d.lease ? coordinator_->RenewLease(d.lease, d.ttl_ms)
                         : coordinator_->AcquireLease(config_.name, d.version, d.ttl_ms);
        if (l.ok()) {
          granted.push_back({d.hold, l->id()});
        } else if (d.lease != 0 && l.status().code() == StatusCode::kNotFound) {
          granted.push_back({d.hold, 0});  // the lease ended (the node was marked dead): acquire anew
        } else if (!stopping_) {
          spdlog::debug("sink {}: lease for hold {}: {}", config_.name, d.hold, l.status().ToString());
        }
      }
      lock.lock();
      for (const auto& [hold, lease] : granted) {
        auto it = holds_.find(hold);
        if (it == holds_.end()) {
          if (lease != 0) leases_to_release_.push_back(lease);  // ended meanwhile
          continue;
        }
        it->second.lease_id = lease;
        it->second.lease_renewed = Clock::now();
        if (lease == 0) holds_cv_.notify_all();
      }
    }
  }

  void WatchLoop() {
    while (!stopping_) {
      v1::WatchRequest req;
      req.set_after(head_.load());
      req.set_node(config_.name);
      req.set_incarnation(incarnation_.load());
      wsync::Status s = coordinator_->Watch(req, [this](const v1::VersionSummary& v) {
        head_ = std::max(head_.load(), v.version());
        Kick();
        return !stopping_.load();
      });
      if (stopping_) return;
      if (!s.ok()) spdlog::debug("sink {}: watch: {}", config_.name, s.ToString());
      // A broken stream marks this node dead at the coordinator: register
      // again (a heartbeat does) before watching under the new incarnation.
      HeartbeatNow(std::chrono::seconds(2));
      SleepFor(std::chrono::milliseconds(200));
    }
  }

  // Parent's peer id on the data plane, connecting when needed.
  StatusOr<transport::PeerId> ParentPeer(const std::string& parent) {
    if (auto it = peers_.find(parent); it != peers_.end()) return it->second;
    WSYNC_ASSIGN_OR_RETURN(auto status, coordinator_->GetStatus());
    for (const auto& n : status.nodes()) {
      if (n.name() != parent) continue;
      WSYNC_ASSIGN_OR_RETURN(transport::PeerId peer, transport_->Connect(n.data_address()));
      peers_[parent] = peer;
      return peer;
    }
    return NotFoundError("parent " + Quoted(parent) + " is not registered");
  }

  // Closes and forgets the connection to `parent` (the next attempt
  // connects again, to the address the coordinator has then): endpoints are
  // released, not leaked, when a parent fails or restarts.
  void DropPeer(const std::string& parent) {
    auto it = peers_.find(parent);
    if (it == peers_.end()) return;
    transport_->Disconnect(it->second);
    peers_.erase(it);
  }

  // The next attempt after a failure comes at once (new tensors registered,
  // a new parent, shutdown).
  void ResetBackoff() {
    std::lock_guard<std::mutex> lock(sync_mu_);
    backoff_reset_ = true;
    failures_ = 0;
    sync_cv_.notify_all();
  }
  void ResetBackoffSoon() {  // REQUIRES: state_mu_ held (takes sync_mu_ only)
    std::lock_guard<std::mutex> lock(sync_mu_);
    backoff_reset_ = true;
    sync_cv_.notify_all();
  }

  // Exponential backoff with jitter: the n-th consecutive failure waits a
  // uniform draw in [d/2, d], d = min(first * 2^(n-1), max).
  std::chrono::milliseconds RetryDelay(uint64_t failures) {
    const uint64_t shift = std::min<uint64_t>(failures - 1, 30);
    const uint64_t d = std::min<uint64_t>(config_.retry_first_ms << shift, config_.retry_max_ms);
    std::uniform_int_distribution<uint64_t> jitter(d / 2, d);
    return std::chrono::milliseconds(jitter(rng_));
  }

  void SyncLoop() {
    Clock::time_point next_attempt = Clock::now();
    while (!stopping_) {
      {
        std::unique_lock<std::mutex> lock(sync_mu_);
        sync_cv_.wait_for(lock, std::chrono::milliseconds(500), [&] { return kicked_ || stopping_.load(); });
        kicked_ = false;
        // After a failure, wait out the delay: new versions do not shorten
        // it, unless the parent lacked the version (then a newer one may be
        // what it has: a restarted source starts its history again).
        sync_cv_.wait_until(lock, next_attempt, [&] {
          return stopping_.load() || backoff_reset_ || (retry_on_new_head_ > 0 && head_.load() > retry_on_new_head_);
        });
        retry_on_new_head_ = 0;
        if (backoff_reset_) next_attempt = Clock::now();
        backoff_reset_ = false;
        if (Clock::now() < next_attempt) continue;
      }
      if (stopping_) return;
      auto w = weights();
      std::string parent;
      bool resync;
      {
        std::lock_guard<std::mutex> lock(state_mu_);
        parent = parent_;
        resync = resync_;
      }
      const uint64_t head = head_.load();
      if (!w || w.get() == mismatched_ || parent.empty() || w->applied() >= head) continue;
      wsync::Status s = CheckPublishedLayout(w->Views());
      if (!s.ok()) {
        // Tensors that cannot take the published versions never will: no
        // pull until they are registered again.
        spdlog::error("sink {}: {}", config_.name, s.ToString());
        w->SetSyncError(s, /*permanent=*/true);
        mismatched_ = w.get();
        continue;
      }
      s = SyncOnce(w, parent, resync || w->applied() == 0 ? 0 : w->applied(), head);
      if (!s.ok() && !stopping_ && (s.code() == StatusCode::kFailedPrecondition || s.code() == StatusCode::kDataLoss)) {
        // The patch does not fit what we hold: a keyframe in the same attempt.
        spdlog::warn("sink {}: sync {}->{} from {}: {}; pulling a keyframe", config_.name, w->applied(), head, parent,
                     s.ToString());
        s = SyncOnce(w, parent, 0, head);
      }
      if (stopping_) return;
      if (s.ok()) {
        failures_ = 0;
        w->SetSyncError(wsync::Status::Ok(), false);
        Kick();  // a version may have come meanwhile
        continue;
      }
      if (s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded) DropPeer(parent);
      const auto delay = RetryDelay(++failures_);
      next_attempt = Clock::now() + delay;
      if (s.code() == StatusCode::kNotFound) {
        std::lock_guard<std::mutex> lock(sync_mu_);
        retry_on_new_head_ = head;
      }
      s = s.WithContext("sync " + std::to_string(w->applied()) + "->" + std::to_string(head) + " from " + Quoted(parent));
      w->SetSyncError(s, /*permanent=*/false);
      spdlog::warn("sink {}: {} (failure {}; next attempt in {} ms)", config_.name, s.ToString(), failures_.load(),
                   delay.count());
    }
  }

  // Ok unless a layout is published and `views` do not match it.
  wsync::Status CheckPublishedLayout(std::span<const codec::TensorView> views) {
    auto published = coordinator_->GetLayout();
    if (!published.ok() || !published->set()) return wsync::Status::Ok();  // checked again next time
    return control::CheckLayout(published->layout(), LayoutOf(views, false), "the registered tensors")
        .WithContext("the registered tensors cannot take the published versions; register tensors of the "
                     "published layout");
  }


  wsync::Status SyncOnce(const std::shared_ptr<SinkWeights>& w, const std::string& parent, uint64_t from,
                         uint64_t to) {
    const auto t0 = Clock::now();
    WSYNC_ASSIGN_OR_RETURN(transport::PeerId peer, ParentPeer(parent));
    ++pulls_made_;
    WSYNC_ASSIGN_OR_RETURN(auto stream, fetcher_->Pull(peer, from, to, std::chrono::seconds(30)));
    {
      // Children may pull the same range from us while it arrives.
      std::lock_guard<std::mutex> lock(state_mu_);
      streams_[{stream->from(), stream->to()}] = stream;
      if (stream->from() != from) streams_[{from, to}] = stream;
      while (streams_.size() > 16) streams_.erase(streams_.begin());
    }
    WSYNC_RETURN_IF_ERROR(stream->WaitComplete(Clock::now() + std::chrono::minutes(5)));
    const auto received = Clock::now();
    WSYNC_RETURN_IF_ERROR(w->Apply(*stream));
    auto node = coordinator_->ReportApplied(config_.name, w->applied());
    if (!node.ok()) spdlog::warn("sink {}: report: {}", config_.name, node.status().ToString());
    using Ms = std::chrono::duration<double, std::milli>;
    const auto done = Clock::now();
    spdlog::info("sink {}: version {} applied from {} ({} {} bytes, {:.1f} ms: transfer {:.1f} ms, apply {:.1f} ms)",
                 config_.name, w->applied(), parent, stream->kind() == codec::PatchKind::kKeyframe ? "keyframe" : "patch",
                 stream->total_bytes(), Ms(done - t0).count(), Ms(received - t0).count(), Ms(done - received).count());
    return wsync::Status::Ok();
  }

  std::mutex state_mu_;
  std::shared_ptr<SinkWeights> weights_;
  std::string parent_;
  bool resync_ = false;
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<PatchStream>> streams_;
  std::map<std::string, transport::PeerId> peers_;  // sync thread only
  const SinkWeights* mismatched_ = nullptr;         // sync thread only: weights refused by the layout check
  std::atomic<uint64_t> head_{0};
  std::atomic<uint64_t> pulls_made_{0};
  std::atomic<uint64_t> failures_{0};  // consecutive failed sync attempts
  std::mt19937_64 rng_;                 // sync thread only
  std::mutex sync_mu_;
  std::condition_variable sync_cv_;
  bool kicked_ = false;
  bool backoff_reset_ = false;
  uint64_t retry_on_new_head_ = 0;  // > 0: a head above it ends the retry delay (under sync_mu_)
  std::mutex holds_mu_;
  std::condition_variable holds_cv_;
  std::map<uint64_t, HoldState> holds_;
  std::vector<uint64_t> leases_to_release_;
  uint64_t next_hold_ = 1;
  std::thread watcher_, syncer_, leaser_;
};

}  // namespace

StatusOr<std::unique_ptr<DataDaemon>> StartSource(const DataDaemonConfig& config) {
  auto s = std::make_unique<Source>(config);
  WSYNC_RETURN_IF_ERROR(s->Start());
  return std::unique_ptr<DataDaemon>(std::move(s));
}

StatusOr<std::unique_ptr<DataDaemon>> StartSink(const DataDaemonConfig& config) {
  auto s = std::make_unique<Sink>(config);
  WSYNC_RETURN_IF_ERROR(s->Start());
  return std::unique_ptr<DataDaemon>(std::move(s));
}

}  // namespace wsync::daemon
