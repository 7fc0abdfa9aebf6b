#include "data_daemon.h"

#include <sys/stat.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <condition_variable>
#include <map>
#include <thread>
#include <utility>

#include "device_weights.h"
#include "patch_exchange.h"
#include "sink_weights.h"
#include "version_history.h"
#include "wsync/buffers/device_region.h"
#include "wsync/buffers/region.h"
#include "wsync/buffers/safetensors.h"
#include "wsync/util/thread_pool.h"
#include "wsync/v1/local.grpc.pb.h"

namespace wsync::daemon {
namespace {

namespace v1 = wsync::v1;
using Clock = std::chrono::steady_clock;

grpc::Status ToGrpc(const Status& s) {
  return s.ok() ? grpc::Status::OK : grpc::Status(static_cast<grpc::StatusCode>(s.code()), s.message());
}

// The memory and table of a RegisterTensors request, mapped and validated.
struct Registered {
  std::unique_ptr<buffers::Region> region;
  std::vector<buffers::TensorEntry> table;
};

StatusOr<Registered> OpenRegistered(const v1::RegisterTensorsRequest& req) {
  Registered r;
  for (const auto& t : req.tensors()) {
    WSYNC_ASSIGN_OR_RETURN(codec::DType dtype, codec::ParseDType(t.dtype()));
    r.table.push_back({t.name(), dtype, {t.shape().begin(), t.shape().end()}, t.offset()});
  }
  if (req.shm_name().empty() == req.cuda_ipc_handle().empty()) {
    return InvalidArgumentError("RegisterTensors needs exactly one of shm_name and cuda_ipc_handle");
  }
  if (!req.shm_name().empty()) {
    WSYNC_ASSIGN_OR_RETURN(r.region, buffers::OpenShm(req.shm_name()));
  } else {
    WSYNC_ASSIGN_OR_RETURN(r.region, buffers::OpenCudaIpc(req.cuda_ipc_handle()));
  }
  WSYNC_RETURN_IF_ERROR(buffers::ValidateTable(r.table, r.region->size()));
  return r;
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
    WSYNC_ASSIGN_OR_RETURN(transport_, transport::CreateUcxTransport(to, &handler_));
    server_ = std::make_unique<PatchServer>(transport_.get(), provider);
    fetcher_ = std::make_unique<PatchFetcher>(transport_.get());
    handler_.Attach(server_.get(), fetcher_.get());
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
    spdlog::info("{} {} up: data plane {}, local API unix:{}", role_ == v1::ROLE_SOURCE ? "source" : "sink",
                 config_.name, transport_->LocalConnInfo(), config_.local_socket);
    return Status::Ok();
  }

  void Shutdown() override {
    if (stopping_.exchange(true)) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      wake_.notify_all();
    }
    StopRole();
    if (coordinator_) coordinator_->Cancel();
    if (heartbeat_.joinable()) heartbeat_.join();
    if (local_) local_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
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
    return Status::Ok();
  }

  void HeartbeatLoop() {
    while (!stopping_) {
      v1::HeartbeatRequest h;
      h.set_name(config_.name);
      h.set_incarnation(incarnation_);
      auto resp = coordinator_->Heartbeat(h);
      if (resp.ok()) {
        OnHeartbeat(*resp);
      } else if (resp.status().code() == StatusCode::kNotFound || resp.status().code() == StatusCode::kAborted) {
        spdlog::warn("{}: {}; registering again", config_.name, resp.status().ToString());
        Status s = Register();
        if (!s.ok()) spdlog::warn("{}: register: {}", config_.name, s.ToString());
      } else {
        spdlog::warn("{}: heartbeat: {}", config_.name, resp.status().ToString());
      }
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait_for(lock, std::chrono::milliseconds(config_.node_ttl_ms / 4), [&] { return stopping_.load(); });
    }
  }

  DataDaemonConfig config_;
  v1::Role role_;
  ThreadPool pool_;
  ExchangeHandler handler_;
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
    std::lock_guard<std::mutex> lock(state_mu_);
    const auto views = buffers::TableViews(reg->table, *reg->region);
    const bool keep = reg->region->on_device() && device_ && device_->Matches(views, reg->region->device());
    if (device_ && !keep) {
      // The device state goes: the history's head copy must not depend on it.
      wsync::Status s = history_.MaterializeHead();
      if (!s.ok()) return ToGrpc(s);
      device_.reset();
    }
    if (reg->region->on_device() && !device_) {
      auto d = DeviceSource::Create(views, reg->region->device());
      if (!d.ok()) return ToGrpc(d.status());
      device_ = std::move(*d);
    }
    region_ = std::move(reg->region);
    table_ = std::move(reg->table);
    resp->set_head_version(history_.head());
    spdlog::info("source {}: {} tensors registered in {}", config_.name, table_.size(), region_->description());
    return grpc::Status::OK;
  }

  grpc::Status Publish(grpc::ServerContext*, const v1::LocalPublishRequest* req,
                       v1::LocalPublishResponse* resp) override {
    // Publishes are serialized; the registration lock is taken only for the
    // snapshot, so waiting on the staleness policy blocks nothing else.
    std::lock_guard<std::mutex> publishing(publish_mu_);
    // Once StopRole has joined the background publisher, none may start.
    if (stopping_) return ToGrpc(UnavailableError("the source is shutting down"));
    // A version copied by an earlier Publish is announced first.
    if (wsync::Status s = JoinBackground(); !s.ok()) return ToGrpc(s);
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      if (!region_) return ToGrpc(FailedPreconditionError("no tensors registered"));
    }
    auto may = coordinator_->MayPublish(req->version(), req->wait_ms());
    if (!may.ok()) return ToGrpc(may.status());
    if (!may->allowed()) {
      std::string who;
      for (const auto& b : may->blocking()) who += (who.empty() ? "" : ", ") + b;
      return ToGrpc(AbortedError("version " + std::to_string(req->version()) +
                                 " is held back by the staleness bound; lagging sinks: " + who));
    }
    const auto t0 = Clock::now();
    StatusOr<PublishedVersion> pub = UnavailableError("not published");
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      const auto views = buffers::TableViews(table_, *region_);
      if (req->return_after_copy() && !device_) {
        // Checked now, so that the trainer hears of a bad version at once.
        if (wsync::Status s = history_.Accepts(req->version(), views); !s.ok()) return ToGrpc(s);
        if (!buffers::SameLayout(snapshot_, views)) {
          snapshot_ = buffers::CopyTensors(views);
        } else if (wsync::Status s = buffers::CopyInto(views, snapshot_, &copy_pool_); !s.ok()) {
          return ToGrpc(s);
        }
        resp->set_version(req->version());
        resp->set_base_version(history_.head());
        for (const auto& t : views) resp->set_dense_bytes(resp->dense_bytes() + t.NumBytes());
        resp->set_pending(true);
        resp->set_copy_ms(MillisecondsSince(t0));
        publisher_ = std::thread([this, version = req->version(), t0] {
          auto published = history_.Publish(version, &snapshot_);
          wsync::Status s = published.ok() ? Announce(*published, MillisecondsSince(t0)) : published.status();
          if (!s.ok()) {
            s = s.WithContext("version " + std::to_string(version) + ", copied and published in the background");
            spdlog::error("source {}: {}", config_.name, s.ToString());
          }
          background_status_ = std::move(s);
        });
        return grpc::Status::OK;
      }
      pub = device_ ? history_.Publish(req->version(), device_->Next(views)) : history_.Publish(req->version(), views);
    }
    if (!pub.ok()) return ToGrpc(pub.status());
    const double ms = MillisecondsSince(t0);
    if (wsync::Status s = Announce(*pub, ms); !s.ok()) return ToGrpc(s);
    resp->set_version(pub->version);
    resp->set_base_version(pub->base_version);
    resp->set_patch_bytes(pub->patch_bytes);
    resp->set_dense_bytes(pub->dense_bytes);
    resp->set_encode_ms(ms);
    return grpc::Status::OK;
  }

  grpc::Status Status(grpc::ServerContext*, const v1::LocalStatusRequest*, v1::LocalStatusResponse* resp) override {
    std::lock_guard<std::mutex> lock(state_mu_);
    resp->set_role("source");
    resp->set_name(config_.name);
    resp->set_version(history_.head());
    resp->set_tensors(table_.size());
    resp->set_bytes_served(Node::server_ ? Node::server_->bytes_served() : 0);
    return grpc::Status::OK;
  }

 protected:
  void StopRole() override {
    std::lock_guard<std::mutex> publishing(publish_mu_);
    (void)JoinBackground();
  }

  void OnHeartbeat(const v1::HeartbeatResponse&) override {
    // Keep what leased or live sinks need; with none, only the head.
    auto status = coordinator_->GetStatus();
    if (!status.ok()) return;
    const uint64_t needed = status->oldest_needed_version() ? status->oldest_needed_version() : history_.head();
    wsync::Status s = history_.Retain(needed);
    if (!s.ok()) spdlog::warn("source {}: retain: {}", config_.name, s.ToString());
  }

 private:
  static double MillisecondsSince(Clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
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
    auto head = coordinator_->Publish(v);
    if (!head.ok()) return head.status();
    spdlog::info("source {}: version {} published: {} patch bytes for {} dense ({:.1f}x), encoded in {:.1f} ms",
                 config_.name, pub.version, pub.patch_bytes, pub.dense_bytes,
                 pub.patch_bytes ? static_cast<double>(pub.dense_bytes) / pub.patch_bytes : 0.0, ms);
    return wsync::Status::Ok();
  }

  // Waits for a version being published in the background; returns (once)
  // what became of it. REQUIRES: publish_mu_ held.
  wsync::Status JoinBackground() {
    if (publisher_.joinable()) publisher_.join();
    return std::exchange(background_status_, wsync::Status::Ok());
  }

  VersionHistory history_;
  std::mutex publish_mu_;  // one Publish at a time
  // Return-after-copy publishes: the copy of the version being published in
  // the background (afterwards the previous head's buffers, for the next
  // copy), the thread publishing it and its outcome (all under publish_mu_).
  std::vector<buffers::OwnedTensor> snapshot_;
  std::thread publisher_;
  wsync::Status background_status_;
  // The copy's own threads: the codec's pool may be busy serving a merge.
  ThreadPool copy_pool_{config_.threads};
  std::mutex state_mu_;    // region_ and table_
  std::unique_ptr<buffers::Region> region_;
  std::vector<buffers::TensorEntry> table_;
  std::unique_ptr<DeviceSource> device_;  // set for device regions
};

// -------------------------------------------------------------------- sink

class Sink : public Node, public v1::Local::Service, public PatchProvider {
 public:
  explicit Sink(DataDaemonConfig config) : Node(std::move(config), v1::ROLE_SINK) {}
  // Stops here, while the threads StopRole joins are alive.
  ~Sink() override { Shutdown(); }

  wsync::Status Start() {
    WSYNC_RETURN_IF_ERROR(StartCommon(this, this));
    watcher_ = std::thread([this] { WatchLoop(); });
    syncer_ = std::thread([this] { SyncLoop(); });
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
    // Trust a claimed version only if the region's checksum is that version's
    // (a sink that died mid-apply leaves torn weights: those get a keyframe).
    uint64_t applied = req->applied_version();
    if (applied != 0) {
      auto versions = coordinator_->ListVersions(applied - 1);
      const auto views = buffers::TableViews(reg->table, *reg->region);
      auto sum = RegionSetChecksum(views, *reg->region, &pool_);
      const bool match = versions.ok() && versions->versions_size() > 0 && versions->versions(0).version() == applied &&
                         sum.ok() && versions->versions(0).set_checksum() == *sum;
      if (!match) {
        spdlog::warn("sink {}: the registered tensors are not version {} (checksum differs): starting from a keyframe",
                     config_.name, applied);
        applied = 0;
      }
    }
    std::unique_ptr<cuda::DeviceCodec> device;
    if (reg->region->on_device()) {
      auto dc = cuda::DeviceCodec::Create(reg->region->device());
      if (!dc.ok()) return ToGrpc(dc.status());
      device = std::move(*dc);
    }
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      weights_ = std::make_shared<SinkWeights>(std::move(reg->region), std::move(reg->table), &pool_, applied,
                                               std::move(device));
    }
    spdlog::info("sink {}: tensors registered (holding version {})", config_.name, applied);
    resp->set_head_version(head_.load());
    Kick();
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

  grpc::Status Hold(grpc::ServerContext*, const v1::HoldRequest*, v1::HoldResponse* resp) override {
    auto w = weights();
    if (!w) return ToGrpc(FailedPreconditionError("no tensors registered"));
    resp->set_version(w->Hold());
    std::lock_guard<std::mutex> lock(state_mu_);
    resp->set_hold_id(next_hold_);
    holds_[next_hold_++] = w;
    return grpc::Status::OK;
  }

  grpc::Status Release(grpc::ServerContext*, const v1::ReleaseRequest* req, v1::ReleaseResponse*) override {
    std::lock_guard<std::mutex> lock(state_mu_);
    auto it = holds_.find(req->hold_id());
    if (it == holds_.end()) return ToGrpc(NotFoundError("hold " + std::to_string(req->hold_id()) + " is not held"));
    it->second->Release();
    holds_.erase(it);
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
    resp->set_tensors(w ? w->Views().size() : 0);
    resp->set_bytes_served(Node::server_ ? Node::server_->bytes_served() : 0);
    return grpc::Status::OK;
  }

 protected:
  void StopRole() override {
    Kick();
    if (watcher_.joinable()) watcher_.join();
    if (syncer_.joinable()) syncer_.join();
  }

  void OnHeartbeat(const v1::HeartbeatResponse& hb) override {
    {
      std::lock_guard<std::mutex> lock(state_mu_);
      parent_ = hb.node().parent();
      resync_ = hb.node().resync_keyframe();
    }
    head_ = std::max(head_.load(), hb.head_version());
    Kick();
  }

 private:
  std::shared_ptr<SinkWeights> weights() {
    std::lock_guard<std::mutex> lock(state_mu_);
    return weights_;
  }

  void Kick() {
    std::lock_guard<std::mutex> lock(sync_mu_);
    kicked_ = true;
    sync_cv_.notify_all();
  }

  void WatchLoop() {
    while (!stopping_) {
      wsync::Status s = coordinator_->Watch(head_.load(), [this](const v1::VersionSummary& v) {
        head_ = std::max(head_.load(), v.version());
        Kick();
        return !stopping_.load();
      });
      if (stopping_) return;
      if (!s.ok()) spdlog::debug("sink {}: watch: {}", config_.name, s.ToString());
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
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
    return NotFoundError("parent " + parent + " is not registered");
  }

  void SyncLoop() {
    while (!stopping_) {
      {
        std::unique_lock<std::mutex> lock(sync_mu_);
        sync_cv_.wait_for(lock, std::chrono::milliseconds(500), [&] { return kicked_ || stopping_.load(); });
        kicked_ = false;
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
      if (!w || parent.empty() || w->applied() >= head) continue;
      wsync::Status s = SyncOnce(w, parent, resync || w->applied() == 0 ? 0 : w->applied(), head);
      if (!s.ok()) {
        spdlog::warn("sink {}: sync {}->{} from {}: {}", config_.name, w->applied(), head, parent, s.ToString());
        if (s.code() == StatusCode::kUnavailable) peers_.erase(parent);
        if (s.code() == StatusCode::kFailedPrecondition || s.code() == StatusCode::kDataLoss ||
            s.code() == StatusCode::kNotFound) {
          // The patch does not fit what we hold: a keyframe next time.
          s = SyncOnce(w, parent, 0, head);
          if (!s.ok()) spdlog::warn("sink {}: keyframe {}: {}", config_.name, head, s.ToString());
        }
        Kick();
      }
    }
  }

  wsync::Status SyncOnce(const std::shared_ptr<SinkWeights>& w, const std::string& parent, uint64_t from,
                         uint64_t to) {
    const auto t0 = Clock::now();
    WSYNC_ASSIGN_OR_RETURN(transport::PeerId peer, ParentPeer(parent));
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
  std::map<uint64_t, std::shared_ptr<SinkWeights>> holds_;
  uint64_t next_hold_ = 1;
  std::string parent_;
  bool resync_ = false;
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<PatchStream>> streams_;
  std::map<std::string, transport::PeerId> peers_;  // sync thread only
  std::atomic<uint64_t> head_{0};
  std::mutex sync_mu_;
  std::condition_variable sync_cv_;
  bool kicked_ = false;
  std::thread watcher_, syncer_;
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
