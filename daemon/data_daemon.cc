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

#include "wsync/exchange/exchange.h"
#include "membership.h"
#include "sink_core.h"
#include "source_core.h"
#include "sink_weights.h"
#include "tensor_layout.h"
#include "wsync/buffers/descriptor_inbox.h"
#include "wsync/buffers/device_region.h"
#include "wsync/buffers/region.h"
#include "wsync/buffers/safetensors.h"
#include "wsync/control/rpc_status.h"
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

using control::ToGrpc;

double MillisecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

constexpr int kMaxRegions = 1 << 16;

StatusOr<std::unique_ptr<buffers::Region>> OpenRegion(const std::string& shm, const std::string& ipc) {
  if (shm.empty() == ipc.empty()) return InvalidArgumentError("needs exactly one of shm_name and cuda_ipc_handle");
  if (!shm.empty()) return buffers::OpenShm(shm);
  return buffers::OpenCudaIpc(ipc);
}

// The descriptors of a request's regions, taken from the inbox once per token.
class PassedDescriptors {
 public:
  explicit PassedDescriptors(buffers::DescriptorInbox* inbox) : inbox_(inbox) {}
  StatusOr<std::unique_ptr<buffers::Region>> Map(const std::string& token, uint32_t index) {
    auto it = taken_.find(token);
    if (it == taken_.end()) {
      WSYNC_ASSIGN_OR_RETURN(auto fds, inbox_->Take(token));
      it = taken_.emplace(token, std::move(fds)).first;
    }
    if (index >= it->second.size()) {
      return InvalidArgumentError("fd_index " + std::to_string(index) + ": " + std::to_string(it->second.size()) +
                                  " descriptors were sent with token " + Quoted(token));
    }
    buffers::OwnedFd fd = std::move(it->second[index]);  // closed once mapped: the mapping keeps the memory
    if (fd.get() < 0) {
      return InvalidArgumentError("fd_index " + std::to_string(index) + " of token " + Quoted(token) + " is named twice");
    }
    return buffers::MapDescriptor(fd.get(), "memfd " + std::to_string(index) + " of " + token);
  }

 private:
  buffers::DescriptorInbox* inbox_;
  std::map<std::string, std::vector<buffers::OwnedFd>> taken_;
};

StatusOr<std::unique_ptr<buffers::Region>> OpenRegion(const v1::MemoryRegion& r, PassedDescriptors* passed) {
  if (r.shm_name().empty() + r.cuda_ipc_handle().empty() + r.fd_token().empty() != 2) {
    return InvalidArgumentError("needs exactly one of shm_name, cuda_ipc_handle and fd_token");
  }
  if (!r.fd_token().empty()) return passed->Map(r.fd_token(), r.fd_index());
  return OpenRegion(r.shm_name(), r.cuda_ipc_handle());
}

std::vector<uint64_t> Dims(const google::protobuf::RepeatedField<uint64_t>& f) { return {f.begin(), f.end()}; }

// A tensor of a request: name, dtype, shape, place and pieces.
StatusOr<buffers::TensorEntry> EntryOf(const v1::TensorSpec& t) {
  auto dtype = codec::ParseDType(t.dtype());
  if (!dtype.ok()) return dtype.status().WithContext("tensor " + Quoted(t.name()));
  buffers::TensorEntry e{t.name(), *dtype, Dims(t.shape()), t.offset(), t.region(), {}};
  for (const auto& p : t.pieces()) e.pieces.push_back({p.canonical(), Dims(p.start()), Dims(p.extent()), Dims(p.at())});
  return e;
}

// The layouts a source request names (runtime tensors without data).
StatusOr<std::vector<std::vector<codec::RuntimeTensor>>> ServedLayouts(const v1::RegisterTensorsRequest& req) {
  std::vector<std::vector<codec::RuntimeTensor>> out;
  for (int i = 0; i < req.serve_layouts_size(); ++i) {
    auto layout = RuntimeLayoutOf(req.serve_layouts(i));
    if (!layout.ok()) return layout.status().WithContext("served layout " + std::to_string(i));
    out.push_back(std::move(*layout));
  }
  return out;
}

// What a sink registering pieces offers the coordinator: its runtime tensors
// and their pieces (no memory).
v1::ServedLayout OfferedLayout(const v1::RegisterTensorsRequest& req) {
  v1::ServedLayout out;
  for (const auto& t : req.tensors()) {
    v1::TensorSpec* spec = out.add_tensors();
    spec->set_name(t.name());
    spec->set_dtype(t.dtype());
    *spec->mutable_shape() = t.shape();
    *spec->mutable_pieces() = t.pieces();
  }
  return out;
}

// The memory and table of a RegisterTensors request, mapped and validated.
StatusOr<buffers::MappedTensors> OpenRegistered(const v1::RegisterTensorsRequest& req, buffers::DescriptorInbox* inbox) {
  std::vector<buffers::TensorEntry> table;
  table.reserve(req.tensors_size());
  for (const auto& t : req.tensors()) {
    WSYNC_ASSIGN_OR_RETURN(auto e, EntryOf(t));
    table.push_back(std::move(e));
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
    PassedDescriptors passed(inbox);
    for (int i = 0; i < req.regions_size(); ++i) {
      auto r = OpenRegion(req.regions(i), &passed);
      if (!r.ok()) return r.status().WithContext("region " + std::to_string(i));
      regions.push_back(std::move(*r));
    }
  } else {
    WSYNC_ASSIGN_OR_RETURN(auto r, OpenRegion(req.shm_name(), req.cuda_ipc_handle()));
    regions.push_back(std::move(r));
  }
  return buffers::MappedTensors::Create(std::move(regions), std::move(table));
}

// What source and sink share: the data-plane transport with its exchange,
// the coordinator registration and heartbeats, and the local API server.
class Node : public DataDaemon {
 public:
  explicit Node(DataDaemonConfig config, v1::Role role)
      : config_(std::move(config)), role_(role), pool_(config_.threads) {}

  ~Node() override { Shutdown(); }

  // Brings up the data plane and the coordinator client, then the role
  // (`make_role` returns what the role serves its pullers), then registers,
  // serves the local API and heartbeats.
  Status StartCommon(const std::function<StatusOr<PatchProvider*>()>& make_role, grpc::Service* local_service) {
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
    fetcher_ = std::make_unique<PatchFetcher>(&handler_);
    if (config_.security.mode == exchange::SecurityMode::kNone) {
      spdlog::warn("data plane without security: anyone who reaches {} can pull the weights (give the daemon the "
                   "cluster token: docs/security.md)",
                   transport_->LocalConnInfo());
    }
    control::ClientOptions co = config_.coordinator;
    co.wait_for_ready = true;
    WSYNC_ASSIGN_OR_RETURN(coordinator_, control::NewCoordinatorClient(co));
    v1::RegisterRequest r;
    r.set_name(config_.name);
    r.set_role(role_);
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    r.set_host(host);
    r.set_data_address(transport_->LocalConnInfo());
    r.set_ttl_ms(config_.node_ttl_ms);
    membership_ = std::make_unique<Membership>(
        coordinator_.get(), r,
        Membership::Hooks{[this](v1::HeartbeatRequest* h) { FillHeartbeat(h); },
                          [this](const v1::HeartbeatResponse& hb) { OnHeartbeat(hb); },
                          [this](const v1::Node& n) { AfterRegister(n); }});
    WSYNC_ASSIGN_OR_RETURN(PatchProvider * provider, make_role());
    server_ = std::make_unique<PatchServer>(&handler_, provider);
    handler_.Attach(server_.get(), fetcher_.get());
    WSYNC_RETURN_IF_ERROR(membership_->Register());

    // Before the local API: a client that reaches the API finds it.
    WSYNC_ASSIGN_OR_RETURN(inbox_, buffers::DescriptorInbox::Listen(config_.local_socket + ".fds"));
    ::unlink(config_.local_socket.c_str());
    grpc::ServerBuilder builder;
    // A rank of a large mixture of experts registers tens of thousands of pieces.
    builder.SetMaxReceiveMessageSize(control::kMaxMessageBytes);
    builder.AddListeningPort("unix:" + config_.local_socket, grpc::InsecureServerCredentials());
    builder.RegisterService(local_service);
    local_ = builder.BuildAndStart();
    if (!local_) return UnavailableError("cannot serve the local API on " + config_.local_socket);
    if (::chmod(config_.local_socket.c_str(), 0600) != 0) {
      return ErrnoToStatus(errno, "chmod 0600 " + config_.local_socket);
    }
    membership_->Start();
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
    if (membership_) membership_->Stop();
    if (local_) local_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    if (coordinator_) (void)coordinator_->Deregister(config_.name);
    handler_.Detach();
    server_.reset();
    fetcher_.reset();
    transport_.reset();
    ::unlink(config_.local_socket.c_str());
    inbox_.reset();
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



  DataDaemonConfig config_;
  v1::Role role_;
  ThreadPool pool_;
  ExchangeHandler handler_{config_.security};
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<PatchServer> server_;
  std::unique_ptr<PatchFetcher> fetcher_;
  std::unique_ptr<control::CoordinatorClient> coordinator_;
  std::unique_ptr<Membership> membership_;
  std::unique_ptr<grpc::Server> local_;
  std::unique_ptr<buffers::DescriptorInbox> inbox_;  // memory passed as descriptors, beside the local API
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::condition_variable wake_;
};

// ------------------------------------------------------------------ source

// The source's local API: a thin adapter over SourceCore (source_core.h).
class Source : public Node, public v1::Local::Service {
 public:
  explicit Source(DataDaemonConfig config) : Node(std::move(config), v1::ROLE_SOURCE) {}
  // Stops here, while the core StopRole stops is alive.
  ~Source() override { Shutdown(); }

  wsync::Status Start() {
    return StartCommon(
        [this]() -> StatusOr<PatchProvider*> {
          core_ = std::make_unique<SourceCore>(config_, coordinator_.get(), &pool_);
          WSYNC_RETURN_IF_ERROR(core_->StartMirror());
          return core_->provider();
        },
        this);
  }

  grpc::Status RegisterTensors(grpc::ServerContext*, const v1::RegisterTensorsRequest* req,
                               v1::RegisterTensorsResponse* resp) override {
    auto reg = OpenRegistered(*req, inbox_.get());
    if (!reg.ok()) return ToGrpc(reg.status());
    if (reg->has_pieces()) return ToGrpc(InvalidArgumentError("a source registers published tensors, not pieces"));
    auto served = ServedLayouts(*req);
    if (!served.ok()) return ToGrpc(served.status());
    auto r = core_->RegisterTensors(std::move(*reg), *served, req->part(), req->parts(), req->serve_offered_layouts());
    if (!r.ok()) return ToGrpc(r.status());
    for (const auto& name : r->cast_to_bf16) resp->add_cast_to_bf16(name);
    resp->set_head_version(r->head);
    resp->set_next_version(r->head + 1);
    return grpc::Status::OK;
  }

  grpc::Status Unregister(grpc::ServerContext*, const v1::UnregisterRequest*, v1::UnregisterResponse*) override {
    return ToGrpc(core_->Unregister());
  }

  grpc::Status Publish(grpc::ServerContext*, const v1::LocalPublishRequest* req,
                       v1::LocalPublishResponse* resp) override {
    const auto entered = Clock::now();
    auto r = core_->Publish(PublishRequest{req->version(), req->wait_ms(), req->return_after_copy()});
    if (!r.ok()) return ToGrpc(r.status());
    resp->set_version(r->published.version);
    resp->set_base_version(r->published.base_version);
    resp->set_patch_bytes(r->published.patch_bytes);
    resp->set_dense_bytes(r->published.dense_bytes);
    resp->set_pending(r->pending);
    if (r->pending) resp->set_copy_ms(r->copy_ms);
    if (r->encode_ms > 0) resp->set_encode_ms(r->encode_ms);
    resp->set_server_ms(MillisecondsSince(entered));
    return grpc::Status::OK;
  }

  grpc::Status OfferedLayouts(grpc::ServerContext*, const v1::OfferedLayoutsRequest*,
                              v1::OfferedLayoutsResponse* resp) override {
    auto offered = coordinator_->ListOfferedLayouts();
    if (!offered.ok()) return ToGrpc(offered.status().WithContext("the layouts sinks offered"));
    for (auto& l : *offered) *resp->add_layouts() = std::move(l);
    return grpc::Status::OK;
  }

  grpc::Status Status(grpc::ServerContext*, const v1::LocalStatusRequest*, v1::LocalStatusResponse* resp) override {
    const SourceStatus st = core_->status();
    resp->set_role("source");
    resp->set_name(config_.name);
    resp->set_version(st.version);
    resp->set_head_version(st.head);
    resp->set_tensors(st.tensors);
    resp->set_bytes_served(Node::server_ ? Node::server_->bytes_served() : 0);
    resp->set_pulls_served(Node::server_ ? Node::server_->pulls_served() : 0);
    return grpc::Status::OK;
  }

 protected:
  void StopRole() override {
    if (core_) core_->Stop();
  }
  void OnHeartbeat(const v1::HeartbeatResponse& hb) override { core_->OnHeartbeat(hb); }
  void FillHeartbeat(v1::HeartbeatRequest* h) override { core_->FillHeartbeat(h); }

 private:
  std::unique_ptr<SourceCore> core_;
};

// -------------------------------------------------------------------- sink

// The sink's local API: a thin adapter over SinkCore (sink_core.h).
class Sink : public Node, public v1::Local::Service {
 public:
  explicit Sink(DataDaemonConfig config) : Node(std::move(config), v1::ROLE_SINK) {}
  // Stops here, while the core StopRole stops is alive.
  ~Sink() override { Shutdown(); }

  wsync::Status Start() {
    WSYNC_RETURN_IF_ERROR(StartCommon(
        [this]() -> StatusOr<PatchProvider*> {
          if (!config_.store_tier.url.empty()) {
            WSYNC_ASSIGN_OR_RETURN(store_, StoreTier::Open(config_.store_tier));
            spdlog::info("sink {}: reading {} when no daemon serves a version", config_.name, store_->where());
          }
          core_ = std::make_unique<SinkCore>(config_, SinkEnvironment{coordinator_.get(), transport_.get(),
                                                                      fetcher_.get(), membership_.get(), &pool_,
                                                                      store_.get()});
          return core_.get();
        },
        this));
    core_->Start();  // registered: its watch carries this incarnation
    return wsync::Status::Ok();
  }

  grpc::Status RegisterTensors(grpc::ServerContext*, const v1::RegisterTensorsRequest* req,
                               v1::RegisterTensorsResponse* resp) override {
    if (req->serve_layouts_size() > 0 || req->parts() > 1) {
      return ToGrpc(InvalidArgumentError("serve_layouts, part and parts are a source's"));
    }
    auto reg = OpenRegistered(*req, inbox_.get());
    if (!reg.ok()) return ToGrpc(reg.status());
    if (reg->has_pieces()) {
      // Offered first: a source registering with serve_offered_layouts then
      // serves it, also when the grid published now does not hold it yet.
      auto n = coordinator_->OfferLayout(config_.name, OfferedLayout(*req));
      if (n.ok()) {
        spdlog::info("sink {}: its layout offered to the coordinator ({} distinct layouts offered)", config_.name, *n);
      } else {
        spdlog::warn("sink {}: its layout was not offered (a source serves it only if named in serve_layouts): {}",
                     config_.name, n.status().ToString());
      }
    }
    auto head = core_->RegisterTensors(std::move(*reg), req->applied_version());
    if (!head.ok()) return ToGrpc(head.status());
    resp->set_head_version(*head);
    return grpc::Status::OK;
  }

  grpc::Status Unregister(grpc::ServerContext*, const v1::UnregisterRequest*, v1::UnregisterResponse*) override {
    return ToGrpc(core_->Unregister());
  }

  // Waits for version `v` in the tensors registered now, and in the ones
  // registered in their place while it waits (a client that re-registers
  // after a restart, from another thread); NotRegistered when none are.
  // Returns the weights it waited on last.
  std::pair<std::shared_ptr<SinkWeights>, wsync::Status> WaitOnRegistered(uint64_t v, uint64_t timeout_ms) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      auto w = core_->weights();
      if (!w) return {nullptr, NotRegisteredError()};
      wsync::Status s = w->WaitForVersion(v, deadline);
      if (s.ok() || !w->closed() || core_->weights() == w) return {w, s};
    }
  }

  grpc::Status WaitForVersion(grpc::ServerContext*, const v1::WaitForVersionRequest* req,
                              v1::WaitForVersionResponse* resp) override {
    auto [w, s] = WaitOnRegistered(req->version(), req->timeout_ms());
    if (w) resp->set_applied_version(w->applied());
    return ToGrpc(s);
  }

  // The call stays open while the hold lasts: it ends on Release, when the
  // holder cancels or its connection closes, or at the TTL.
  grpc::Status Hold(grpc::ServerContext* ctx, const v1::HoldRequest* req,
                    grpc::ServerWriter<v1::HoldResponse>* writer) override {
    auto grant = core_->BeginHold(req->holder(), req->ttl_ms());
    if (!grant.ok()) return ToGrpc(grant.status());
    v1::HoldResponse r;
    r.set_version(grant->version);
    r.set_hold_id(grant->id);
    r.set_ttl_ms(grant->ttl_ms);
    bool gone = !writer->Write(r);
    core_->AwaitHold(grant->id, [&] { return gone || ctx->IsCancelled(); });
    return grpc::Status::OK;
  }

  grpc::Status RenewHold(grpc::ServerContext*, const v1::RenewHoldRequest* req, v1::RenewHoldResponse*) override {
    return ToGrpc(core_->RenewHold(req->hold_id()));
  }

  grpc::Status Release(grpc::ServerContext*, const v1::ReleaseRequest* req, v1::ReleaseResponse*) override {
    return ToGrpc(core_->ReleaseHold(req->hold_id()));
  }

  grpc::Status Dump(grpc::ServerContext*, const v1::DumpRequest* req, v1::DumpResponse* resp) override {
    auto [w, waited] = WaitOnRegistered(req->version(), req->timeout_ms());
    if (!waited.ok()) return ToGrpc(waited);
    const uint64_t v = w->Hold();
    auto host = w->store().HostCopy();
    wsync::Status s = host.ok() ? buffers::WriteSafetensors(req->path(), buffers::Views(*host),
                                                            {{"wsync_version", std::to_string(v)}})
                                : host.status();
    w->Release();
    resp->set_version(v);
    return ToGrpc(s);
  }

  grpc::Status Status(grpc::ServerContext*, const v1::LocalStatusRequest*, v1::LocalStatusResponse* resp) override {
    const SinkStatus st = core_->status();
    resp->set_role("sink");
    resp->set_name(config_.name);
    resp->set_version(st.applied);
    resp->set_head_version(st.head);
    resp->set_tensors(st.tensors);
    resp->set_bytes_served(Node::server_ ? Node::server_->bytes_served() : 0);
    resp->set_pulls_served(Node::server_ ? Node::server_->pulls_served() : 0);
    resp->set_pulls_made(st.pulls_made);
    resp->set_bytes_received(st.bytes_received);
    resp->set_sync_failures(st.sync_failures);
    if (!st.sync_error.ok()) resp->set_sync_error(st.sync_error.ToString());
    resp->set_active_holds(st.active_holds);
    resp->set_oldest_hold_ms(st.oldest_hold_ms);
    resp->set_staged_version(st.timings.staged_version);
    resp->set_staging_ms(st.timings.staging_ms);
    resp->set_apply_ms(st.timings.apply_ms);
    resp->set_foreign_writes(st.timings.foreign_writes);
    return grpc::Status::OK;
  }

 protected:
  void StopRole() override {
    if (core_) core_->Stop();
  }
  void OnHeartbeat(const v1::HeartbeatResponse& hb) override { core_->OnHeartbeat(hb); }
  void AfterRegister(const v1::Node& node) override { core_->AfterRegister(node); }
  void FillHeartbeat(v1::HeartbeatRequest* h) override { core_->FillHeartbeat(h); }

 private:
  std::unique_ptr<StoreTier> store_;  // before the core: it outlives it
  std::unique_ptr<SinkCore> core_;
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
